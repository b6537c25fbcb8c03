"""A tiny numpy transformer shared by the examples (plain numpy; no shmkv inside).

``Model.forward(cache, tokens, positions)`` runs new tokens through every layer
and returns their logits. ``cache.put(layer, k, v, positions)`` stores the new
keys and values and returns ``(K, V, mask)``: every key and value the new
tokens attend to, and the additive mask (0 / -inf). Two caches fit:
:class:`SeqCache` (a shmkv sequence) and :class:`NumpyCache` (plain arrays, one
process: the reference every example compares against). ``store.forward``'s
batch fits too (examples/batch_forward.py).
"""

from __future__ import annotations

import queue
from typing import Any

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 8, 64
STORE_LAYOUT = dict(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32")


class Model:
    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        d = KV_HEADS * HEAD_DIM
        self.embed = rng.standard_normal((VOCAB, d)).astype(np.float32)
        self.w = [[(rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for _ in range(4)]
                  for _ in range(LAYERS)]  # q, k, v, out per layer
        self.unembed = rng.standard_normal((d, VOCAB)).astype(np.float32)
        self.freq = rng.uniform(0.1, 2.0, d).astype(np.float32)  # a position signal per dimension

    def forward(self, cache: Any, tokens: Any, positions: Any) -> np.ndarray:
        """Logits ``[n, VOCAB]`` of the new ``tokens`` at ``positions`` (their K/V go into ``cache``)."""
        tokens, positions = np.asarray(tokens), np.asarray(positions)
        x = self.embed[tokens] + np.sin(positions[:, None] * self.freq).astype(np.float32)
        for layer, (wq, wk, wv, wo) in enumerate(self.w):
            shape = (len(tokens), KV_HEADS, HEAD_DIM)
            q, k, v = (x @ wq).reshape(shape), (x @ wk).reshape(shape), (x @ wv).reshape(shape)
            K, V, mask = cache.put(layer, k, v, positions)
            scores = np.einsum("qhd,khd->hqk", q, K) / np.sqrt(HEAD_DIM) + mask
            att = np.exp(scores - scores.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            x = x + np.einsum("hqk,khd->qhd", att, V).reshape(len(tokens), -1) @ wo
        return x @ self.unembed


class SeqCache:
    """A shmkv write handle as the model's cache: ``append`` returns zero-copy views
    (committed + pending tokens), ``mask`` the matching causal mask. The caller commits."""

    def __init__(self, seq: Any) -> None:
        self.seq = seq

    def put(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> tuple[Any, Any, Any]:
        K, V = self.seq.append(layer, k, v)
        return K, V, self.seq.mask(layer, positions)


class NumpyCache:
    """The reference: per-layer arrays in one process, no shmkv."""

    def __init__(self) -> None:
        self.k: list[np.ndarray] = [np.zeros((0, KV_HEADS, HEAD_DIM), np.float32) for _ in range(LAYERS)]
        self.v = [a.copy() for a in self.k]
        self.pos: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(LAYERS)]

    def put(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> tuple[Any, Any, Any]:
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])
        self.pos[layer] = np.concatenate([self.pos[layer], positions])
        mask = np.where(self.pos[layer][None, :] <= positions[:, None], 0.0, -np.inf).astype(np.float32)
        return self.k[layer], self.v[layer], mask


def encode(text: str) -> list[int]:
    return [b % VOCAB for b in text.encode()]


def reference_generate(prompt: list[int], new_tokens: int, model: Model | None = None) -> list[int]:
    """Greedy continuation of ``prompt`` in one process without shmkv."""
    model = model or Model()
    cache = NumpyCache()
    logits = model.forward(cache, prompt, np.arange(len(prompt)))
    out: list[int] = []
    pos = len(prompt)
    while len(out) < new_tokens:
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        logits = model.forward(cache, [tok], [pos])
        pos += 1
    return out


def decode_greedy(seq: Any, model: Model, new_tokens: int, logits: np.ndarray | None = None) -> list[int]:
    """Continue a shmkv write handle greedily by ``new_tokens``, committing each one.

    ``logits``: those of the last committed token, if the caller has them. Without
    them the last token is rolled back and run again (``truncate``), so a worker
    that takes a sequence over needs nothing but the sequence to carry on.
    """
    if logits is None:
        last, pos = int(seq.tokens[-1]), int(seq.positions[-1])
        seq.truncate(len(seq) - 1)
        logits = model.forward(SeqCache(seq), [last], [pos])
        seq.commit(tokens=[last], positions=[pos])
    out: list[int] = []
    for _ in range(new_tokens):
        tok, pos = int(np.argmax(logits[-1])), int(seq.positions[-1]) + 1
        logits = model.forward(SeqCache(seq), [tok], [pos])
        seq.commit(tokens=[tok], positions=[pos])  # visible to every process from here
        out.append(tok)
    return out


def collect(results: Any, n: int, procs: list[Any], timeout: float = 120.0) -> list[Any]:
    """``n`` items from a multiprocessing queue; fails at once, naming it, if a process dies."""
    import time

    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        try:
            got.append(results.get(timeout=0.1))
        except queue.Empty:
            for p in procs:
                if p.exitcode not in (None, 0):
                    raise RuntimeError(f"{p.name} (pid {p.pid}) exited with code {p.exitcode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(got)} of {n} results after {timeout} s") from None
    return got


if __name__ == "__main__":  # a module the examples import; run alone, it says so and shows the model
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"toymodel: {LAYERS} layers, {KV_HEADS} KV heads of {HEAD_DIM}, vocabulary {VOCAB}; the examples "
          "import it (run one of them, e.g. python examples/multi_worker.py)")
    print("greedy continuation of 'Hello' without shmkv:", reference_generate(encode("Hello"), 8))
