"""Random operation sequences against a plain numpy model."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import shmkv

L, H, D = 2, 2, 3
SEEDS = [int(s) for s in os.environ.get("SHMKV_SEEDS", "").split(",") if s] or list(range(12))


class Model:
    """What a sequence should hold: plain arrays, no sharing, no ranges."""

    def __init__(self) -> None:
        self.k = np.zeros((L, 0, H, D))
        self.v = np.zeros((L, 0, H, D))
        self.tokens = np.zeros(0, np.int64)
        self.positions = np.zeros(0, np.int64)


def roundtrip(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a store of ``dtype`` gives back for ``x``: an independent reference encoding."""
    if dtype == "int8":
        x = np.asarray(x, np.float32)
        scale = (np.abs(x).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
        q = np.clip(np.rint(x / np.where(scale > 0, scale, np.float32(1))), -127, 127)
        return (q.astype(np.int8).astype(np.float32) * scale).astype(np.float64)
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(x, np.float64)


def keys_dtype(dtype: str) -> type:
    """The dtype shift() receives: the storage float, float32 for encoded storage."""
    return {"float16": np.float16, "float64": np.float64}.get(dtype, np.float32)


def check(seq: shmkv.Sequence, m: Model, where: str) -> None:
    assert seq.length == m.k.shape[1], where
    for layer in range(L):
        np.testing.assert_array_equal(seq.keys(layer), m.k[layer], err_msg=where)
        np.testing.assert_array_equal(seq.values(layer), m.v[layer], err_msg=where)
    np.testing.assert_array_equal(seq.tokens, m.tokens, err_msg=where)
    np.testing.assert_array_equal(seq.positions, m.positions, err_msg=where)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16", "int8"])
def test_random_operations_match_model(make_store, seed, dtype):
    print(f"seed={seed} dtype={dtype} (rerun with SHMKV_SEEDS={seed})")
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=160, max_seqs=6)
    seqs: dict[int, shmkv.Sequence] = {}
    models: dict[int, Model] = {}
    next_tok = 0
    full_errors = 0

    def rand_kv(n: int) -> np.ndarray:
        # values exactly representable in float16 so every dtype compares exactly
        return nrng.integers(-512, 512, size=(L, n, H, D)).astype(np.float64) / 4

    for step in range(150):
        op = rng.choice(["create", "append", "append", "append", "extend", "truncate", "remove",
                         "remove_shift", "shift_left", "copy_prefix", "fork", "free"])
        live = list(seqs)
        where = f"seed={seed} step={step} op={op}"
        try:
            if op == "create" or not live:
                s = store.create_sequence(capacity=rng.randint(1, 12))
                seqs[s.id], models[s.id] = s, Model()
                continue
            sid = rng.choice(live)
            s, m = seqs[sid], models[sid]
            if op == "append":
                n = rng.randint(1, 5)
                k, v = rand_kv(n), rand_kv(n)
                toks = list(range(next_tok, next_tok + n))
                views = []
                for layer in range(L):
                    kk, _ = s.append(layer, k[layer], v[layer])
                    assert kk.shape[0] == m.k.shape[1] + n
                    # int8: pending tokens as given until the commit quantizes them (_sequence/mirror.py)
                    want = k[layer] if dtype == "int8" else roundtrip(k[layer], dtype)
                    np.testing.assert_array_equal(kk[-n:], want)
                    views.append(kk)
                if rng.random() < 0.2:
                    s.release()  # pending tokens are dropped with the lease
                    seqs[sid] = store.sequence(sid, write=True)
                else:
                    s.commit(tokens=toks)
                    last = m.positions[-1] + 1 if m.positions.size else 0
                    m.k = np.concatenate([m.k, roundtrip(k, dtype)], 1)
                    m.v = np.concatenate([m.v, roundtrip(v, dtype)], 1)
                    m.tokens = np.concatenate([m.tokens, toks])
                    m.positions = np.concatenate([m.positions, np.arange(last, last + n)])
                    next_tok += n
                    for layer, kk in enumerate(views):  # committed: what the cells hold
                        np.testing.assert_array_equal(kk, m.k[layer], err_msg=where)
            elif op == "extend":
                n = rng.randint(0, 6)
                k, v = rand_kv(n), rand_kv(n)
                s.extend(k, v)
                last = m.positions[-1] + 1 if m.positions.size else 0
                m.k = np.concatenate([m.k, roundtrip(k, dtype)], 1)
                m.v = np.concatenate([m.v, roundtrip(v, dtype)], 1)
                m.tokens = np.concatenate([m.tokens, np.full(n, -1)])
                m.positions = np.concatenate([m.positions, np.arange(last, last + n)])
            elif op == "truncate":
                n = rng.randint(0, m.k.shape[1])
                s.truncate(n)
                m.k, m.v, m.tokens, m.positions = m.k[:, :n], m.v[:, :n], m.tokens[:n], m.positions[:n]
            elif op in ("remove", "remove_shift"):
                length = m.k.shape[1]
                b = rng.randint(0, length)
                e = rng.randint(b, length)
                moved = length - e
                delta = int(m.positions[b] - m.positions[e]) if moved and e > b else 0
                shift = None
                if op == "remove_shift":
                    def shift(layer, keys, d):
                        assert keys.dtype.kind == "f"
                        return keys + layer - d  # a stand-in rotation
                s.remove(b, e, shift=shift)
                if e > b:
                    tail_k = m.k[:, e:].copy()
                    if shift is not None and moved:
                        for layer in range(L):
                            tail_k[layer] = roundtrip(tail_k[layer].astype(keys_dtype(dtype)) + layer - delta, dtype)
                    m.k = np.concatenate([m.k[:, :b], tail_k], 1)
                    m.v = np.concatenate([m.v[:, :b], m.v[:, e:]], 1)
                    m.tokens = np.concatenate([m.tokens[:b], m.tokens[e:]])
                    m.positions = np.concatenate([m.positions[:b], m.positions[e:] + delta])
            elif op == "shift_left":
                n = rng.randint(0, m.k.shape[1])
                s.shift_left(n)
                m.k, m.v, m.tokens, m.positions = m.k[:, n:], m.v[:, n:], m.tokens[n:], m.positions[n:]
            elif op == "copy_prefix":
                dst = rng.choice(live)
                if dst == sid:
                    continue
                n = rng.randint(0, m.k.shape[1])
                store.copy_prefix(sid, dst, n)
                d = models[dst]
                d.k, d.v, d.tokens, d.positions = m.k[:, :n], m.v[:, :n], m.tokens[:n], m.positions[:n]
                check(seqs[dst], d, where + " (dst)")
            elif op == "fork":
                n = rng.randint(0, m.k.shape[1])
                f = s.fork(n)
                fm = Model()
                fm.k, fm.v, fm.tokens, fm.positions = m.k[:, :n], m.v[:, :n], m.tokens[:n], m.positions[:n]
                seqs[f.id], models[f.id] = f, fm
                check(f, fm, where + " (fork)")
            elif op == "free":
                s.free()
                del seqs[sid], models[sid]
                with pytest.raises(shmkv.SequenceNotFound):
                    store.sequence(sid)
                continue
        except shmkv.CacheFullError:
            # the store is full: nothing committed may have changed (checked below);
            # a half-done append leaves pending tokens, which release() drops
            full_errors += 1
            if op == "append":
                seqs[sid].release()
                seqs[sid] = store.sequence(sid, write=True)
        for sid2, seq2 in seqs.items():
            check(seq2, models[sid2], where + f" seq={sid2}")
    print(f"{full_errors} CacheFullError(s)")
    st = store.stats()
    assert st.sequences == len(seqs)
    assert st.tokens == sum(m.k.shape[1] for m in models.values())
    assert st.free_tokens + st.reserved_tokens == st.max_tokens
