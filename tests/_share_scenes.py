"""One scene several share tests start from: a donor that lent cells, in a store with no free range.

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
