"""Scenarios of tests/test_crash.py: each a setup (run by the test) and an operation (run by a child
that SHMKV_CRASH_AT kills inside it). Content is a function of the token id alone, so any mixed-up
or half-moved cell shows: K[cell] = f(token id at that cell)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

import shmkv

LAYOUT = dict(layers=2, kv_heads=2, head_dim=4, dtype="float32", max_tokens=512, max_seqs=12)
BOUNDED = dict(LAYOUT, layer_types=["full", "sliding"], window=4, memory=8)
# shared prefix pages (share.* points): cells of 1 KiB, a page unit of 4 cells, so that A (after X's
# 4 cells in the matrix of tests/test_journal.py, or at 0) may lend its first 32 cells
SHARED = dict(LAYOUT, head_dim=128)


def layout_for(point: str) -> dict:
    return BOUNDED if point.startswith(("compact", "rewind")) else SHARED if point.startswith("share") else LAYOUT


def kv(tokens: Any, layers: int = 2, head_dim: int = 4) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(tokens, np.float32)
    k = t[None, :, None, None] * 4 + np.arange(layers, dtype=np.float32)[:, None, None, None] * 0.5 + np.zeros(
        (1, 1, 2, head_dim), np.float32)
    return k, -k


def fill(seq: shmkv.Sequence, tokens: Any) -> None:
    """Append and commit ``tokens``, 8 at a time (a sliding layer takes at most memory=8 a commit)."""
    t = np.asarray(tokens, np.int64)
    d = seq.keys(0).shape[-1]
    for i in range(0, len(t), 8):
        k, v = kv(t[i : i + 8], head_dim=d)
        seq.extend(k, v, tokens=t[i : i + 8])


def base(store: shmkv.Store) -> dict[str, int]:
    """A: 40 tokens (finished), B: 30 tokens, C: 20 tokens (released), a neighbour after A."""
    a = store.create_sequence(capacity=40)
    fill(a, np.arange(100, 140))
    n = store.create_sequence(capacity=16)  # right after A: A cannot grow in place
    fill(n, np.arange(300, 310))
    b = store.create_sequence(capacity=64)
    fill(b, np.arange(200, 230))
    c = store.create_sequence(capacity=32)
    fill(c, np.arange(400, 420))
    ids = {"a": a.id, "b": b.id, "c": c.id, "n": n.id}
    a.finish()
    for s in (n, b, c):
        s.release()
    return ids


def prepare(store: shmkv.Store, point: str, ids: dict[str, int]) -> None:
    """What some points' operation starts from, set up on base() (in the test, for both stores)."""
    if point in ("share.unshared", "share.released", "share.moved"):  # S borrows A's first 32 cells
        s = store.create_sequence(capacity=64, prefix=np.concatenate([np.arange(100, 135), [7, 7]]))
        assert len(s) == 35 and store.stats().shared_tokens == 32, store.stats()
        s.release()  # (op finds it: the one sequence of 35 tokens)
        if point == "share.moved":  # A taken back (no longer finished) before: the op only truncates
            store.sequence(ids["a"], write=True).release()
    if point == "free.rehomed":  # a copy of C's 20 tokens: C's index entries stand for its own
        s = store.create_sequence(capacity=32, prefix=np.concatenate([np.arange(400, 420), [7]]))
        assert len(s) == 20
        s.release()
    if point == "grow.slid":  # C gets a neighbour after it and 64 free cells before it: it slides
        d = store.create_sequence(capacity=32)  # (created first: it takes the cells right after C)
        fill(d, np.arange(800, 805))
        d.release()
        store.sequence(ids["b"], write=True).free()


def _borrower(store: shmkv.Store) -> int:
    return next(i.id for i in store.sequences() if i.length == 35)


def op(store: shmkv.Store, point: str, ids: dict[str, int], snap: str) -> None:
    """The operation that passes through ``point``."""
    a, b, c = ids["a"], ids["b"], ids["c"]
    kind = point.split(".", maxsplit=1)[0]
    d = store.layout.head_dim
    if point == "share.borrowed":
        assert store.create_sequence(capacity=64, prefix=np.concatenate([np.arange(100, 135), [7, 7]])).id
    elif point == "share.unshared":  # the borrower truncates into its span: copy-on-write
        s = store.sequence(_borrower(store), write=True)
        s.truncate(10)
        fill(s, np.arange(500, 505))
    elif point == "share.released":  # the last borrower goes
        store.sequence(_borrower(store), write=True).free()
    elif point == "share.moved":  # the donor truncates into what it lent: it moves
        s = store.sequence(a, write=True)
        s.truncate(10)
        fill(s, np.arange(500, 505))
    elif kind == "create":
        store.create_sequence(capacity=64, prefix=np.concatenate([np.arange(100, 135), [7, 7]]))
    elif kind == "free":
        store.sequence(c, write=True).free()
    elif kind == "truncate":
        s = store.sequence(b, write=True)
        s.truncate(10)
        fill(s, np.arange(500, 505))
    elif point in ("grow.extended", "grow.slid"):  # C outgrows its 32 cells in one extend: free cells
        t = np.arange(420, 440)  # after it (in place), or before it (slide)
        store.sequence(c, write=True).extend(*kv(t, head_dim=d), tokens=t)
    elif kind == "grow":
        s = store.sequence(ids["n"], write=True)  # N: B right after it, A right before
        fill(s, np.arange(310, 330))  # 30 > capacity 16: it moves
    elif kind == "copy_prefix":
        store.copy_prefix(a, b, 35)
    elif kind == "fork":
        store.sequence(b).fork(n=25, capacity=30)
    elif kind == "remove":
        store.sequence(b, write=True).remove(5, 10, shift=lambda layer, k, d: k)
    elif kind == "shift_left":
        store.sequence(b, write=True).shift_left(7)
    elif kind == "compact":
        s = store.sequence(b, write=True)
        for t in range(230, 262):  # the sliding layer's window buffer fills and compacts
            fill(s, [t])
    elif kind == "rewind":  # B (tokens 200..229): back to n with the sliding layer's window given
        n = 20 if point == "rewind.copied" else 28  # before what the window holds: a copy; within: a cut
        k, v = kv(np.arange(n - 3, n) + 200, head_dim=d)
        store.sequence(b, write=True).rewind(n, k[1:], v[1:])
    elif kind == "set_encoder":
        s = store.sequence(b, write=True)
        s.set_encoder(*kv(np.arange(600, 606), head_dim=d))
        s.set_encoder(*kv(np.arange(700, 709), head_dim=d))  # replaces: the old encoder row is freed
    elif kind == "restore":
        store.restore(snap)
    elif kind == "lease":
        store.sequence(c, write=True)
    elif kind == "finish":
        store.sequence(b, write=True).finish()
    else:
        raise ValueError(point)


def state(store: shmkv.Store) -> list[tuple[Any, ...]]:
    """What the store holds, logically; asserts every cell's K/V is that of its token id."""
    out = []
    for info in store.sequences():
        s = store.sequence(info.id)
        toks = s.tokens.copy()
        for layer in range(store.layout.layers):
            k, v = s.read(layer)
            held = toks[len(toks) - len(k):] if len(k) < len(toks) else toks
            want_k, want_v = kv(held, head_dim=store.layout.head_dim)
            np.testing.assert_array_equal(k, want_k[layer], err_msg=f"sequence {info.id} layer {layer} K")
            np.testing.assert_array_equal(v, want_v[layer], err_msg=f"sequence {info.id} layer {layer} V")
        ek, _ = s.encoder_kv(0)
        out.append((info.id, tuple(toks.tolist()), tuple(s.positions.tolist()), info.finished,
                    tuple(np.asarray(ek)[:, 0, 0].tolist())))
    return out


def child(name: str, point: str, ids: dict[str, int], snap: str) -> None:
    store = shmkv.attach(name)
    op(store, point, ids, snap)
    store.close()


def stress(name: str, seed: int, done: Any = None) -> None:
    """Mixed operations until killed (test_random_kills); ``done.value`` (a shared counter,
    when given) counts the operations finished, so the killer can wait for the first."""
    rng = np.random.default_rng(seed)
    store = shmkv.attach(name)
    while True:
        if done is not None:
            done.value += 1
        live = [i.id for i in store.sequences()]
        r = rng.random()
        try:
            if r < 0.25 or not live:
                t0 = int(rng.integers(0, 3)) * 1000
                p = np.arange(t0, t0 + int(rng.integers(8, 60)))
                s = store.create_sequence(capacity=int(rng.integers(4, 40)), prefix=p)
                fill(s, p[len(s):])
                (s.finish if rng.random() < 0.7 else s.release)()
            else:
                sid = int(rng.choice(live))
                s = store.sequence(sid, write=True)
                n = len(s)
                x = rng.random()
                if x < 0.2:
                    s.truncate(int(rng.integers(0, n + 1)))
                elif x < 0.4:
                    last = int(s.tokens[-1]) + 1 if n else 5000
                    fill(s, np.arange(last, last + int(rng.integers(1, 50))))
                elif x < 0.5 and n > 2:
                    s.remove(1, 2, shift=lambda layer, k, d: k)
                elif x < 0.6 and n:
                    s.shift_left(1)
                elif x < 0.7:
                    s.fork(n=n // 2).free()
                elif x < 0.8:
                    s.free()
                    continue
                s.finish() if rng.random() < 0.5 else s.release()
        except (shmkv.CacheFullError, shmkv.LeaseError, shmkv.SequenceNotFound, shmkv.NotSupportedError):
            pass


if __name__ == "__main__":
    import json

    child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4])
    os._exit(0)


def copier(name: str, a: int, b: int, dst: int, n: int, *, rounds: int) -> int:
    """Long structural operations: copy_prefix of a or b into dst, alternately."""
    store = shmkv.attach(name)
    for i in range(rounds):
        store.copy_prefix(a if i % 2 else b, dst, n)
    store.close()
    return rounds


def reader(name: str, dst: int, lock_timeout: float, seconds: float) -> dict[str, int]:
    """read() on a read-only attachment while copier runs: every copy one version, whole. Reads for
    ``seconds``, and on until one read came back (where copies hold the lock back to back and the
    lock timeout is short, a loaded machine may give none in ``seconds``)."""
    store = shmkv.attach(name, readonly=True, lock_timeout=lock_timeout)
    out = {"reads": 0, "timeouts": 0}
    while True:  # opening the handle reads the row too: it may wait out a copy as well
        try:
            s = store.sequence(dst)
            break
        except shmkv.LockTimeout:
            out["timeouts"] += 1
    t_end = time.monotonic() + seconds
    give_up = t_end + 120  # a loaded machine: keep reading past ``seconds`` until one read is whole
    while time.monotonic() < t_end or (not out["reads"] and time.monotonic() < give_up):
        try:
            k, _ = s.read(0)
        except shmkv.LockTimeout:
            out["timeouts"] += 1
            continue
        first = float(k[0, 0, 0])
        want = kv(np.asarray([first / 4]))[0][0, 0, 0, 0]
        assert first == want
        base = int(first / 4)  # token ids of a version run base, base+1, ...
        np.testing.assert_array_equal(k[:, 0, 0], (np.arange(base, base + len(k)) * 4).astype(np.float32))
        out["reads"] += 1
    store.close()
    return out
