"""Child-process functions of tests/test_sharing_reads.py, test_sharing_borrow.py and
test_sharing_interrupts.py (module level, so spawn can import them)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import shmkv
from shmkv._engine.table.header import START
from shmkv.store._store import engine_of


def kv(seed: int, layers: int, n: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic K/V for tokens of one writer (the parent rebuilds them for its reference)."""
    r = np.random.default_rng(seed)
    shape = (layers, n, heads, dim)
    return r.standard_normal(shape).astype(np.float32), r.standard_normal(shape).astype(np.float32)


def free_and_reuse(name: str, free_id: int, capacity: int, seed: int, n: int) -> tuple[int, int]:
    """In a child: free sequence ``free_id`` (a borrower), create a new sequence of ``capacity``
    (it lands on the freed cells) and write ``n`` tokens of K/V ``seed`` into it. Returns (id,
    first cell of its range)."""
    store = shmkv.attach(name)
    try:
        store.sequence(free_id, write=True).free()
        lay = store.layout
        g = store.create_sequence(capacity=capacity)
        k, v = kv(seed, lay.layers, n, lay.kv_heads, lay.head_dim)
        g.extend(k, v, tokens=np.arange(5000, 5000 + n))
        eng = engine_of(store)
        start = int(eng.row(eng.slot_of(g.id))[START])
        g.release()
        return g.id, start
    finally:
        store.close()


def borrow_and_free(name: str, prompt: list[int]) -> int:
    """In a child: create a borrower of ``prompt`` (shared tokens must occur), then free it."""
    store = shmkv.attach(name)
    try:
        f = store.create_sequence(capacity=1024, prefix=prompt)
        shared = store.stats().shared_tokens
        f.free()
        return shared
    finally:
        store.close()


def digest(name: str, seq_id: int, readonly: bool) -> tuple[str, int]:
    """In a child: sha256 of every layer's keys and values of a sequence, and its length."""
    store = shmkv.attach(name, readonly=readonly)
    try:
        s = store.sequence(seq_id)
        h = hashlib.sha256()
        for layer in range(store.layout.layers):
            h.update(s.keys(layer).tobytes())
            h.update(s.values(layer).tobytes())
        return h.hexdigest(), len(s)
    finally:
        store.close()


def kv_of(tokens: np.ndarray, layers: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V that are a function of each token id (exact in float16): any cell read can be checked."""
    t = np.asarray(tokens, np.int64)[None, :, None, None]
    k = ((t * 7 + np.arange(dim)) % 128 + np.arange(layers)[:, None, None, None] * 0.25 + np.zeros((1, 1, heads, 1)))
    return k.astype(np.float32), -k.astype(np.float32)


def crash_op(name: str, op: str, donor: int, borrower: int) -> None:
    """In a child run with SHMKV_CRASH_AT set: the operation that reaches the share.* point (the
    child is SIGKILLed there)."""
    store = shmkv.attach(name)
    lay = store.layout
    if op == "borrow":
        toks = np.r_[np.arange(1000, 1200), [4242]]
        f = store.create_sequence(capacity=512, prefix=toks)
        k, v = kv_of(toks[len(f):], lay.layers, lay.kv_heads, lay.head_dim)
        f.extend(k, v, tokens=toks[len(f):])
    elif op == "unshare":
        store.sequence(borrower, write=True).truncate(101)
    elif op == "release":
        store.sequence(borrower, write=True).free()
    elif op == "move":
        store.sequence(donor, write=True).truncate(20)
    raise SystemExit(f"op {op} did not reach its crash point")


def read_inherited_after(store: shmkv.Store, conn: object) -> tuple[bytes, ...]:
    """In a fork child: with the parent's mappings inherited (its spans mapped), wait until the
    parent has freed the borrower and written a new sequence on its cells; read that sequence."""
    gid = conn.recv()  # type: ignore[attr-defined]
    g = store.sequence(gid)
    return tuple(g.keys(layer).tobytes() + g.values(layer).tobytes() for layer in range(store.layout.layers))


def borrow_truncate_compare() -> bool:
    """Standalone (run in a private /dev/shm): a borrower of 3,000 tokens of 8 x 128 float16,
    truncated into its span and extended, and a second borrower, equal the same with copies."""
    from shmkv._engine.spans import mappings as share
    from shmkv.testing import unique_name

    layers, heads, dim = 3, 8, 128
    r = np.random.default_rng(0)
    k = r.standard_normal((layers, 3000, heads, dim))
    p = np.arange(3000)
    out = []
    for sharing in (True, False):
        share.ENABLED = sharing
        st = shmkv.create(unique_name("hp"), layers=layers, kv_heads=heads, head_dim=dim, dtype="float16",
                          max_tokens=16384, max_seqs=32)
        try:
            d = st.create_sequence(capacity=3000, prefix=p)
            d.extend(k, -k, tokens=p)
            d.finish()
            f = st.create_sequence(capacity=3100, prefix=np.r_[p, [1]])
            f.truncate(2299)
            f.extend(k[:, :50], -k[:, :50])
            g = st.create_sequence(capacity=3100, prefix=np.r_[p, [2]])
            assert (st.stats().shared_tokens > 0) == sharing
            out.append([(f.keys(i).tobytes(), g.keys(i).tobytes(), d.keys(i).tobytes()) for i in range(layers)])
        finally:
            st.close()
    share.ENABLED = True
    return out[0] == out[1]


def cow_and_reuse(name: str, borrower: int) -> int:
    """In a child (run with SHMKV_SHARE=0): check the borrower's prefix, truncate it into its span
    (copy-on-write), extend it, and reuse the prompt (a copy here). Returns shared_tokens after."""
    st = shmkv.attach(name)
    try:
        lay = st.layout
        prompt = np.arange(1000, 1300)
        f = st.sequence(borrower, write=True)
        want = kv_of(prompt[: len(f)], lay.layers, lay.kv_heads, lay.head_dim)[0][0].astype(np.float16)
        assert f.keys(0).tobytes() == want.tobytes()
        f.truncate(101)
        t = np.arange(4000, 4050)
        k, v = kv_of(t, lay.layers, lay.kv_heads, lay.head_dim)
        f.extend(k, v, tokens=t)
        f.release()
        st.create_sequence(capacity=1024, prefix=np.r_[prompt, [2]]).release()
        return int(st.stats().shared_tokens)
    finally:
        st.close()


def flip_free_rows_span_words(name: str, started: Any, stop: Any, flips: Any) -> None:
    """In a child: keep rewriting the span word of every row but the first (free rows: no span
    is wanted either way) until ``stop``; ``started`` once it began; the rewrites in ``flips``."""
    from shmkv._engine.table.header import SPAN_CELLS

    store = shmkv.attach(name)
    try:
        t = engine_of(store).table_np
        i = 0
        started.set()
        while not stop.is_set():
            t[1:, SPAN_CELLS] = i & 1
            i += 1
        t[1:, SPAN_CELLS] = 0
        flips.value = i
    finally:
        store.close()
