"""Child-process functions of tests/test_prefix.py (module level, so spawn can import them)."""

from __future__ import annotations

import time
import zlib

import numpy as np

import shmkv


def kv_for(tokens: np.ndarray, layers: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic stand-in for a model: token i's K/V depend on its id, its position and every
    id before it (as attention makes them), so a reused prefix equals a recompute only if it is the
    same prefix. Exact in float32 (small integers)."""
    t = np.asarray(tokens, np.int64)
    ctx = np.cumsum(t * 7 + 3) % 4093  # depends on the whole prefix
    n = len(t)
    base = (ctx * 3 + np.arange(n) % 97)[None, :, None, None]
    lay = np.arange(layers)[:, None, None, None] * 5
    head = np.arange(heads)[None, None, :, None] * 2
    d = np.arange(dim)[None, None, None, :]
    k = (base + lay + head + d).astype(np.float32)
    return k, -k - 1


def serve(store: shmkv.Store, prompt: np.ndarray, capacity: int | None = None) -> tuple[shmkv.Sequence, int]:
    """What an inference worker does: reuse what it can, compute the rest, commit with ids.
    Returns the sequence and how many tokens it reused."""
    lay = store.layout
    seq = store.create_sequence(capacity=capacity or len(prompt) + 8, prefix=prompt)
    n = len(seq)
    k, v = kv_for(prompt, lay.layers, lay.kv_heads, lay.head_dim)
    seq.extend(k[:, n:], v[:, n:], tokens=prompt[n:])
    return seq, n


def check(seq: shmkv.Sequence, prompt: np.ndarray, layout: shmkv.Layout) -> None:
    """The sequence's content equals a full recompute of ``prompt``: ids, positions, K and V."""
    n = len(seq)
    assert n == len(prompt), (n, len(prompt))
    np.testing.assert_array_equal(seq.tokens, prompt)
    np.testing.assert_array_equal(seq.positions, np.arange(n))
    k, v = kv_for(prompt, layout.layers, layout.kv_heads, layout.head_dim)
    for layer in range(layout.layers):
        np.testing.assert_array_equal(seq.keys(layer), k[layer])
        np.testing.assert_array_equal(seq.values(layer), v[layer])


def serve_and_finish(name: str, prompt: list[int]) -> tuple[int, int]:
    """In a child: serve one request, check it, finish it; return (id, tokens reused)."""
    store = shmkv.attach(name)
    try:
        p = np.asarray(prompt, np.int64)
        seq, reused = serve(store, p)
        check(seq, p, store.layout)
        seq.finish()
        return seq.id, reused
    finally:
        store.close()


def match_readonly(name: str, prompt: list[int]) -> int:
    store = shmkv.attach(name, readonly=True)
    try:
        return store.match_prefix(prompt)
    finally:
        store.close()


def stress_worker(name: str, seed: int, seconds: float, prompts: list[list[int]]) -> dict[str, int]:
    """Create, verify, finish, match and sometimes free, for ``seconds``; every reuse is checked."""
    rng = np.random.default_rng(seed)
    store = shmkv.attach(name)
    done = {"requests": 0, "hits": 0, "reused": 0, "full": 0}
    try:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            base = prompts[int(rng.integers(len(prompts)))]
            cut = int(rng.integers(1, len(base) + 1))
            tail = rng.integers(0, 50, int(rng.integers(0, 40))).tolist()
            p = np.asarray(base[:cut] + tail, np.int64)
            store.match_prefix(p)
            try:
                seq, reused = serve(store, p)
            except shmkv.CacheFullError:
                done["full"] += 1
                continue
            check(seq, p, store.layout)
            done["hits"] += reused > 0
            done["reused"] += reused
            if rng.random() < 0.2:
                seq.free()
            else:
                seq.finish()
            done["requests"] += 1
        return done
    finally:
        store.close()


def crc_of(name: str) -> int:
    store = shmkv.attach(name, readonly=True)
    try:
        return zlib.crc32(b"".join(np.asarray(store.sequence(i.id).keys(0)).tobytes() for i in store.sequences()))
    finally:
        store.close()
