"""Scenes of a donor and its borrowers in two attachments of one store (3 layers, 2 kv heads, 64
dims), and the helpers the tests of them share (tests/test_sharing_lenders.py,
test_sharing_pending_steps.py, test_sharing_unlocked_writes.py).

The main scene (``lent_in_a_full_store``): a donor that lent cells, in a store with no free range.

A finished donor of three page units (``n`` tokens), leased again by ``other`` (the donor's
process); borrowers of it made by ``store`` (the borrowers' process), each over the donor's
whole prefix; then the rest of the store filled (by ``other``) so no range is free and the
donor cannot move. A truncate of the donor below what it lent then leaves it lending cells it no
longer holds (``_engine/spans/lending.py``): its next write past its length must move it first.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np

import shmkv
from shmkv._engine.table.header import FLAGS, LENT

L, H, D = 3, 2, 64


@dataclass
class Lent:
    donor: shmkv.Sequence  # ``other``'s write handle
    borrowers: list[shmkv.Sequence]  # ``store``'s write handles
    fillers: list[shmkv.Sequence]  # ``other``'s write handles of the sequences that fill the store
    kv: np.ndarray  # float32 [L, n + 4, H, D]: the donor's keys and values, then the borrowers' next tokens
    toks: np.ndarray  # int64 [n + 4]
    n: int  # the donor's length
    m: int  # the borrowers' length (the prefix they reuse)
    want: list[np.ndarray]  # per layer: kv[l, :n + 4] as the store's dtype keeps it

    def spans(self, store: shmkv.Store) -> list[int]:
        """SPAN_CELLS of each borrower's row."""
        from shmkv._engine.table.header import SPAN_CELLS

        e = store._engine
        return [int(e.row(e.slot_of(b.id))[SPAN_CELLS]) for b in self.borrowers]

    def free_a_filler(self, other: shmkv.Store) -> None:  # (``other``: the attachment that made them)
        """Room for the donor to move to: the largest filler freed (the first is never the
        largest: a test may use it)."""
        sizes = {s.id: s.capacity for s in other.sequences()}
        biggest = max(self.fillers[1:], key=lambda f: sizes[f.id])
        self.fillers.remove(biggest)
        biggest.free()


def die_at(point: str, at: Any, go: Any) -> None:
    """In a child: at crash point ``point``, set event ``at``, wait for ``go`` (120 s at most:
    the parent looks at the store meanwhile, then ``let_go_and_reap``), then SIGKILL itself."""
    from shmkv._engine.locking import crash

    def pause_then_die(name: str) -> None:
        if name == point:
            at.set()
            go.wait(120)
            os.kill(os.getpid(), signal.SIGKILL)

    crash.point = pause_then_die


def borrow_and_die(name: str, prefix: list[int], capacity: int, at: Any, go: Any) -> None:  # a child
    """A requester SIGKILLed inside its create over ``prefix`` (``die_at`` create.copied: the
    borrow made, the transaction not committed)."""
    die_at("create.copied", at, go)
    shmkv.attach(name).create_sequence(capacity=capacity, prefix=prefix)


def let_go_and_reap(child: Any, go: Any) -> None:
    """Let a child paused at a crash point (waiting on event ``go``) go on, to its end or its
    SIGKILL, and reap it (killed after 60 s). ``child`` None: not started."""
    go.set()
    if child is not None:
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()


def kv_store(make_store, dtype: str = "float16") -> shmkv.Store:
    """A store where the scene fits a few times (int8's page unit is larger)."""
    return make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype,
                      max_tokens=2048 if dtype == "float16" else 8192, max_seqs=8)


def lent_in_a_full_store(store: shmkv.Store, other: shmkv.Store, seed: int, borrowers: int = 1) -> Lent:
    """The scene of the module docstring (``store`` and ``other``: two attachments of one store)."""
    n = 3 * store._engine.page_unit
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((L, n + 4, H, D)).astype(np.float32)
    toks = rng.integers(0, 30_000, n + 4)
    ref = store.create_sequence(capacity=n + 4)
    try:
        ref.extend(kv, kv)
        want = [ref.keys(layer).copy() for layer in range(L)]
    finally:
        ref.free()
    donor = other.create_sequence(capacity=n + 64, prefix=toks[:1])
    donor.extend(kv[:, :n], kv[:, :n], tokens=toks[:n])
    donor.finish()
    donor = other.sequence(donor.id, write=True)
    bs = [store.create_sequence(capacity=n + 64, prefix=toks[: n + 1]) for _ in range(borrowers)]
    m = len(bs[0])
    scene = Lent(donor, bs, [], kv, toks, n, m, want)
    assert all(len(b) == m for b in bs) and all(scene.spans(store)), "the borrows this scene is about did not happen"
    fillers = [other.create_sequence(capacity=64)]  # (two at least: see free_a_filler)
    while other.stats().largest_free_range:  # the rest of the store in use: the donor cannot move
        fillers.append(other.create_sequence(capacity=other.stats().largest_free_range))
    assert len(fillers) >= 2 and other.stats().largest_free_range == 0
    scene.fillers = fillers
    return scene


def junk_kv(n: int, value: float = 7.0) -> np.ndarray:
    """K or V of ``n`` tokens, every number ``value``."""
    return np.full((L, n, H, D), value, np.float32)


def row_of(store: shmkv.Store, seq_id: int) -> memoryview:
    """The live table row of ``seq_id`` (its words change as the store does)."""
    e = store._engine
    return e.row(e.slot_of(seq_id))


def borrowers_hold_their_prefix(s: Lent, store: shmkv.Store, layers: tuple[int, ...] = tuple(range(L))) -> None:
    """Every borrower of the scene reads the donor's tokens it reused (and those it committed)
    on ``layers`` (full ones: a sliding layer's keys are its window)."""
    for b in s.borrowers:
        n = len(b)
        for layer in layers:
            np.testing.assert_array_equal(np.asarray(b.keys(layer))[:n], s.want[layer][:n])
            np.testing.assert_array_equal(np.asarray(store.sequence(b.id).keys(layer))[:n], s.want[layer][:n])


def borrowers_decode_a_step(s: Lent) -> None:
    """Every borrower of the scene appends its next token (the donor's, ``s.kv``) on every layer
    and commits it."""
    for b in s.borrowers:
        t = len(b)
        for layer in range(L):
            b.append(layer, s.kv[layer, t], s.kv[layer, t])
        assert b.commit(tokens=s.toks[t : t + 1]) == t + 1


def stuck(store: shmkv.Store, other: shmkv.Store, seed: int, borrowers: int = 1) -> Lent:
    """The main scene with its donor (``other``'s handle) truncated to one token: stuck, still
    lending, its borrowers' spans as they were."""
    s = lent_in_a_full_store(store, other, seed, borrowers=borrowers)
    spans = s.spans(store)
    s.donor.truncate(1)
    assert s.spans(store) == spans and row_of(other, s.donor.id)[FLAGS] & LENT
    return s


def token_keys(tokens: np.ndarray) -> np.ndarray:
    """The keys every sequence of the thread and process tests stores for token ids ``tokens``:
    [n, H, D], each token's id mod 251 (exact in float16)."""
    return np.broadcast_to((np.asarray(tokens) % 251).astype(np.float32)[:, None, None], (len(tokens), H, D))


def holds_its_tokens(seq: shmkv.Sequence) -> None:
    """Every full layer of ``seq`` holds, for each token, the keys of its id (``token_keys``)."""
    toks = np.asarray(seq.tokens)
    for layer in range(L):
        np.testing.assert_array_equal(np.asarray(seq.keys(layer), np.float32), token_keys(toks),
                                      err_msg=f"sequence {seq.id} layer {layer}")


def seeded_kv(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 K/V [L, n, H, D] and ``n`` token ids, drawn from a generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, n, H, D)).astype(np.float32), rng.integers(0, 30_000, n)


def prefilled_donor(store: shmkv.Store, kv: np.ndarray, toks: np.ndarray, n: int, capacity: int) -> shmkv.Sequence:
    """A sequence of ``toks[:n]`` with K = V = ``kv[:, :n]``, leased by ``store``'s attachment."""
    donor = store.create_sequence(capacity=capacity, prefix=toks[:1])
    donor.extend(kv[:, :n], kv[:, :n], tokens=toks[:n])
    return donor


def expected_keys(store: shmkv.Store, kv: np.ndarray, n: int) -> list[np.ndarray]:
    """Keys of ``kv[:, :n]`` as the store's dtype stores them (a sequence of its own, freed)."""
    ref = store.create_sequence(capacity=n)
    try:
        ref.extend(kv[:, :n], kv[:, :n])
        return [ref.keys(layer).copy() for layer in range(L)]
    finally:
        ref.free()


def raise_at(point: str, before: Any = None, count: int = 1, fail: bool = True):
    """A crash.point replacement: at the ``count``-th ``point``, run ``before()`` then raise
    (``fail``; else carry on)."""
    left = [count]

    def hook(name: str) -> None:
        if name == point:
            left[0] -= 1
            if left[0] == 0:
                if before is not None:
                    before()
                if fail:
                    raise RuntimeError(f"the operation fails at {point}")

    return hook


def in_child(ctx: Any, target: Any, *args: Any) -> str:
    """Run ``target(*args, queue)`` in a child process of ``ctx`` and return what it put on the
    queue (the child is reaped, killed after 60 s)."""
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        got: str = q.get(timeout=120)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    return got
