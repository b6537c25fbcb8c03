"""A tiny decoder-only transformer in numpy, for the demo and the examples.

Fixed-seed weights; grouped-query attention (more query heads than KV heads),
rotary position embeddings, RMSNorm, a SiLU MLP; byte-level tokens. It reads
and writes its keys and values through a cache object with two methods, so the
same code runs on a shmkv sequence and on plain numpy arrays (the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    layers: int = 4
    seed: int = 1234


class KVCache(Protocol):
    def put(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class NumpyCache:
    """The reference cache: per-layer arrays grown by concatenation, one process."""

    def __init__(self, cfg: Config) -> None:
        shape = (0, cfg.kv_heads, cfg.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]

    def put(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.k[layer] = np.concatenate([self.k[layer], k.astype(np.float32)])
        self.v[layer] = np.concatenate([self.v[layer], v.astype(np.float32)])
        return self.k[layer], self.v[layer]

    def copy(self) -> NumpyCache:
        c = NumpyCache.__new__(NumpyCache)
        c.k = [a.copy() for a in self.k]
        c.v = [a.copy() for a in self.v]
        return c


class SeqCache:
    """A shmkv write handle seen as the model's cache: append returns the views to attend over."""

    def __init__(self, seq: object) -> None:
        self.seq = seq

    def put(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.seq.append(layer, k, v)  # type: ignore[attr-defined,no-any-return]  # a shmkv.Sequence


def rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotary embedding of ``x`` [n, heads, head_dim] at ``positions`` [n]."""
    half = x.shape[-1] // 2
    inv = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float32) / half))
    ang = positions.astype(np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(np.float32)


class Model:
    def __init__(self, cfg: Config = Config()) -> None:
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        d, hd = cfg.d_model, cfg.head_dim

        def w(*shape: int) -> np.ndarray:
            out: np.ndarray = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
            return out

        self.embed = w(cfg.vocab, d) * np.float32(4.0)
        self.wq = [w(d, cfg.n_heads * hd) for _ in range(cfg.layers)]
        self.wk = [w(d, cfg.kv_heads * hd) for _ in range(cfg.layers)]
        self.wv = [w(d, cfg.kv_heads * hd) for _ in range(cfg.layers)]
        self.wo = [w(cfg.n_heads * hd, d) for _ in range(cfg.layers)]
        self.w1 = [w(d, 4 * d) for _ in range(cfg.layers)]
        self.w2 = [w(4 * d, d) for _ in range(cfg.layers)]
        self.out = w(d, cfg.vocab)

    @staticmethod
    def _norm(x: np.ndarray) -> np.ndarray:
        out: np.ndarray = (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)
        return out

    def forward(self, cache: KVCache, tokens: np.ndarray, positions: np.ndarray,
                all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` at ``positions`` (new, after what the cache holds).

        Returns the logits of the last token, or of every token with ``all_logits``.
        """
        cfg = self.cfg
        n, hd, g = len(tokens), cfg.head_dim, cfg.n_heads // cfg.kv_heads
        x = self.embed[tokens]
        for layer in range(cfg.layers):
            h = self._norm(x)
            q = rope((h @ self.wq[layer]).reshape(n, cfg.n_heads, hd), positions)
            k = rope((h @ self.wk[layer]).reshape(n, cfg.kv_heads, hd), positions)
            v = (h @ self.wv[layer]).reshape(n, cfg.kv_heads, hd)
            keys, values = cache.put(layer, k, v)  # [t, kv_heads, hd], the new tokens last
            t = keys.shape[0]
            qg = q.reshape(n, cfg.kv_heads, g, hd)
            scores = np.einsum("nkgd,tkd->nkgt", qg, keys, dtype=np.float32) / np.float32(np.sqrt(hd))
            causal = np.arange(t)[None, :] > (t - n + np.arange(n))[:, None]
            scores = np.where(causal[:, None, None, :], np.float32(-np.inf), scores)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = (scores / scores.sum(-1, keepdims=True)).astype(np.float32)
            att = np.einsum("nkgt,tkd->nkgd", probs, values, dtype=np.float32).reshape(n, cfg.n_heads * hd)
            x = x + att @ self.wo[layer]
            hid = self._norm(x) @ self.w1[layer]
            x = (x + (hid / (1 + np.exp(-hid))) @ self.w2[layer]).astype(np.float32)
        logits: np.ndarray = self._norm(x if all_logits else x[-1:]) @ self.out
        return logits if all_logits else logits[0]


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)


def decode(tokens: list[int]) -> str:
    return bytes(int(t) % 256 for t in tokens).decode("utf-8", "replace")


def reference_generate(model: Model, prefix: np.ndarray, prompt: np.ndarray, new_tokens: int) -> list[int]:
    """What the demo must produce, without shmkv: same ops in the same order."""
    cache = NumpyCache(model.cfg)
    if len(prefix):
        model.forward(cache, prefix, np.arange(len(prefix)))
    pos = len(prefix)
    logits = model.forward(cache, prompt, np.arange(pos, pos + len(prompt)))
    pos += len(prompt)
    out = []
    for _ in range(new_tokens):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = model.forward(cache, np.array([tok]), np.array([pos]))
        pos += 1
    return out
