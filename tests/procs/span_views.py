"""Child-process functions of tests/test_sharing_views.py (module level, so spawn can import them)."""

from __future__ import annotations

from typing import Any

import numpy as np

import shmkv


def kv_of(tokens: np.ndarray, layers: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V every sequence of the test stores for token ids ``tokens``: ``[layers, n,
    heads, dim]`` float32, different for each token, layer, head and dimension."""
    t = np.asarray(tokens, np.float64)[None, :, None, None]
    layer = np.arange(layers, dtype=np.float64)[:, None, None, None]
    head = np.arange(heads, dtype=np.float64)[None, None, :, None]
    d = np.arange(dim, dtype=np.float64)[None, None, None, :]
    amp = 1.0 + (np.asarray(tokens) % 7)[None, :, None, None]
    k = amp * np.sin(0.37 * t + layer + 0.7 * head + 0.13 * d)
    v = amp * np.cos(0.23 * t + 2 * layer + 0.3 * head + 0.29 * d)
    return k.astype(np.float32), v.astype(np.float32)


def _views(seq: shmkv.Sequence, layers: int, int8: bool) -> dict[str, np.ndarray]:
    """Every zero-copy view ``seq``'s read API gives of its committed cells, by name."""
    out: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for kind, raw in (("k", seq.raw_keys(layer)), ("v", seq.raw_values(layer))):
            out[f"raw_{kind}{layer}"] = raw[0]
            if raw[1] is not None:
                out[f"scales_{kind}{layer}"] = raw[1]
        if not int8:  # (int8: keys(), values() and kv() are dequantized copies)
            out[f"keys{layer}"] = seq.keys(layer)
            out[f"values{layer}"] = seq.values(layer)
            k, v = seq.kv(layer)
            out[f"kv_k{layer}"], out[f"kv_v{layer}"] = k, v
    return out


def check_views(views: dict[str, np.ndarray], copies: dict[str, np.ndarray], ref: tuple[np.ndarray, np.ndarray],
                n: int, *, int8: bool) -> list[str]:
    """What differs, in the first ``n`` cells, between the held ``views`` and the ``copies``
    taken when they were made, and between them and ``ref``, the reference (K, V) of the tokens."""
    ref_k, ref_v = ref
    bad = [name for name, view in views.items() if not np.array_equal(view[:n], copies[name][:n])]
    layers = ref_k.shape[0]
    for layer in range(layers):
        for kind, want in (("k", ref_k[layer, :n]), ("v", ref_v[layer, :n])):
            codes = views[f"raw_{kind}{layer}"][:n].astype(np.float32)
            if int8:
                got = codes * views[f"scales_{kind}{layer}"][:n, :, None]
                tol = np.abs(want).max(axis=-1, keepdims=True) / 100  # (a code step is max / 127)
                if not (np.abs(got - want) <= tol).all():
                    bad.append(f"reference {kind}{layer}")
            elif not np.array_equal(codes, want):
                bad.append(f"reference {kind}{layer}")
    return bad


def hold_views(name: str | None, seq: Any, n: int, ref: tuple[np.ndarray, np.ndarray],
               events: tuple[Any, Any]) -> list[str]:
    """In a child: take every view of a sequence (``seq``: its id in store ``name``, attached
    read-only here; or, ``name`` None, a reader handle inherited over fork) and copies of them,
    set event ``ready``, stay idle until event ``go`` (``events``), then return what changed in
    its first ``n`` cells (``ref``: the reference (K, V) of its tokens)."""
    ready, go = events
    store = shmkv.attach(name, readonly=True) if name is not None else None
    try:
        s = store.sequence(seq) if store is not None else seq
        int8 = s.store.layout.dtype == "int8"
        views = _views(s, ref[0].shape[0], int8)
        copies = {k: np.array(v) for k, v in views.items()}
        bad = check_views(views, copies, ref, len(s), int8=int8)  # (right when taken)
        ready.set()
        if not go.wait(120):
            raise TimeoutError("the parent never said go")
        return bad + check_views(views, copies, ref, n, int8=int8)
    finally:
        ready.set()
        if store is not None:
            store.close()
