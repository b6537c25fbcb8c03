"""A donor that lends cells (its borrowers' spans are its cells) never writes them.

A live donor lends all but its last page unit, so a speculative rollback by one token stays in
place, and its decode steps cost what a donor's that lends nothing cost (no more lock entries,
no scans of the sequence table: the lent end is cached per span epoch). A donor that goes below
what it lent (truncate, rewind, clear) keeps lending those cells and its LENT flag; its write
handle's room stops at its length (``_sequence/room.py`` ``mind_loans``), so its next write past
the length moves it first (``leave_loans``, ``Sharing.move_lender``). In a store with no free
range it stays where it is (the stuck lender): every write path raises CacheFullError with
nothing written, or writes in place once no borrower is left, and succeeds once a range is free;
other changes of its own row (meta=, set_tokens, set_encoder) neither move it nor evict. A
Ctrl-C inside the move, or inside a growth, leaves a handle that writes its own cells; a failed
growth rolls back. Freed or evicted, it leaves its loans to its borrowers; chains, threads and
an inherited handle keep every sequence's tokens.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import threading
from typing import Any

import _sharing_scenes as sharing
import numpy as np
import pytest
from _donor_scenes import (D, H, L, borrowers_decode_a_step, borrowers_hold_their_prefix, holds_its_tokens, junk_kv,
                           kv_store, lent_in_a_full_store, row_of, stuck, token_keys)
from _sharing_scenes import kv_and_tokens, seeded_donor, sharing_store, start_of

import shmkv
from shmkv._engine.locking import crash
from shmkv._engine.locking import journal as _journal
from shmkv._engine.table.header import FLAGS, LENT, SPAN_CELLS, START
from shmkv._sequence.writer import SeqWriter
from shmkv.store._store import engine_of


MAX_TOKENS = {"float16": 2048, "bfloat16": 2048, "float32": 4096, "int8": 8192}


def _sigint_entering_cache(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A real SIGINT at the first instruction of the ``SeqWriter.cache`` call that ends the
    ``finally`` of ``leave_loans`` or ``SeqWriter.grow`` (once): where the interpreter's eval
    breaker raises a Ctrl-C that arrived just before. ``signal.raise_signal`` runs the handler
    at once, so shmkv's handler (``_engine/locking/interrupts.py``) defers it if that path is
    critical, as it would a Ctrl-C from the terminal."""
    orig = SeqWriter.cache
    fired: list[str] = []

    def cache(self: SeqWriter, start: int, cap: int, woff: int) -> None:
        caller = sys._getframe(1).f_code.co_name
        if caller in ("leave_loans", "grow") and not fired:
            fired.append(caller)
            signal.raise_signal(signal.SIGINT)
        orig(self, start, cap, woff)

    monkeypatch.setattr(SeqWriter, "cache", cache)
    return fired


# -- a Ctrl-C inside the move off the loans, and inside a growth -----------------------------------


@pytest.mark.parametrize("how", ["append", "extend"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_a_ctrl_c_while_the_donor_moves_off_its_loans_never_lets_it_write_them(
        make_store, monkeypatch, dtype: str, how: str) -> None:
    """The stuck donor's next write moves it (a range was freed); a Ctrl-C lands right after
    the move, in leave_loans' ``finally``. The caller catches it and goes on decoding: the
    donor's tokens must land in its new range, never in the cells its borrower reads."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=MAX_TOKENS[dtype], max_seqs=8)
    other = shmkv.attach(store.name)  # the donor's process
    try:
        s = lent_in_a_full_store(store, other, 31)
        s.donor.truncate(1)
        s.free_a_filler(other)
        drow = row_of(other, s.donor.id)
        start = drow[START]
        fired = _sigint_entering_cache(monkeypatch)
        one = junk_kv(1)
        with pytest.raises(KeyboardInterrupt):
            if how == "append":
                s.donor.append(0, one[0], one[0])
            else:
                s.donor.extend(one, one)
        monkeypatch.undo()
        assert fired == ["leave_loans"] and drow[START] != start, "the move this test is about did not happen"
        more = junk_kv(40)
        if how == "append":
            for layer in range(L):
                s.donor.append(layer, more[layer], more[layer])
            s.donor.commit()
        else:
            s.donor.extend(more, more)
        borrowers_hold_their_prefix(s, store)
        for layer in range(L):
            np.testing.assert_allclose(np.asarray(s.donor.keys(layer), np.float32)[1:], 7.0, rtol=1e-2)
    finally:
        other.close()


@pytest.mark.parametrize("moves", [True, False])
def test_a_ctrl_c_after_a_growth_leaves_a_handle_that_appends(make_store, monkeypatch, moves: bool) -> None:
    """A sequence grows past its capacity (moved elsewhere, or extended in place) and a Ctrl-C
    lands in grow's ``finally``. Its next appends (within the grown capacity) must work and
    read back, and a neighbour's cells stay as they were."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=4096, max_seqs=8)
    a = store.create_sequence(capacity=64)
    neighbour = store.create_sequence(capacity=256) if moves else None  # right after a: it must move
    nk = np.random.default_rng(5).standard_normal((L, 200, H, D)).astype(np.float16)
    if neighbour is not None:
        neighbour.extend(nk, nk)
    a.extend(junk_kv(64, 3.0), junk_kv(64, 3.0))
    arow = row_of(store, a.id)
    start = arow[START]
    fired = _sigint_entering_cache(monkeypatch)
    one = np.full((H, D), 5.0, np.float16)
    with pytest.raises(KeyboardInterrupt):
        a.append(0, one, one)
    monkeypatch.undo()
    assert fired == ["grow"] and (arow[START] != start) == moves and a.capacity > 64, "the growth did not happen"
    for _ in range(3):
        for layer in range(L):
            a.append(layer, one, one)
        a.commit()
    assert len(a) == 67
    np.testing.assert_array_equal(a.keys(0)[:64], 3.0)
    np.testing.assert_array_equal(a.keys(0)[64:], 5.0)
    if neighbour is not None:
        for layer in range(L):
            np.testing.assert_array_equal(neighbour.keys(layer), nk[layer])


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_ctrl_c_inside_the_move_rolls_it_back_and_the_next_write_moves(make_store, monkeypatch, dtype: str) -> None:
    """A Ctrl-C inside the move itself (at ``share.moved``: cells copied, row not switched) rolls
    the move back: the donor stays, lending, at its length, and its next write moves it."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=MAX_TOKENS[dtype], max_seqs=8)
    other = shmkv.attach(store.name)
    try:
        s = stuck(store, other, 47)
        s.free_a_filler(other)
        drow = row_of(other, s.donor.id)
        start = drow[START]
        fired: list[str] = []

        def sigint_at_move(name: str) -> None:
            if name == "share.moved" and not fired:
                fired.append(name)
                signal.raise_signal(signal.SIGINT)

        monkeypatch.setattr(crash, "point", sigint_at_move)
        one = junk_kv(1)
        with pytest.raises(KeyboardInterrupt):
            s.donor.append(0, one[0], one[0])
        monkeypatch.undo()
        assert fired and drow[START] == start and drow[FLAGS] & LENT and len(s.donor) == 1
        borrowers_hold_their_prefix(s, store)
        k = junk_kv(30)
        for layer in range(L):
            s.donor.append(layer, k[layer], k[layer])
        assert s.donor.commit() == 31 and drow[START] != start
        np.testing.assert_allclose(np.asarray(s.donor.keys(0), np.float32)[1:], 7.0, rtol=1e-2)
        borrowers_hold_their_prefix(s, store)
    finally:
        other.close()


# -- the hot path of a donor that lends -----------------------------------------------------------


def test_a_live_donor_rolls_back_one_token_in_place(make_store):
    """A leased donor lends all but its last page unit: B (same prompt + 1) borrows less than
    A's length, and A's speculative rollback by one token neither moves nor copies it."""
    st = sharing_store(make_store, max_tokens=2048)
    u = engine_of(st).page_unit
    a, p = seeded_donor(st, n=38 * u, capacity=512, finish=False)  # a whole number of units, still leased
    b = st.create_sequence(capacity=512, prefix=np.r_[p, [1]])
    assert len(b) == 38 * u and st.stats().shared_tokens == 37 * u
    start = start_of(st, a.id)
    a.truncate(38 * u - 1)
    assert start_of(st, a.id) == start


class _CountingTable(np.ndarray):
    """The sequence table, counting column reads ``t[:, WORD]``: a scan of every row."""

    scans = 0

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, tuple) and key and isinstance(key[0], slice) and key[0] == slice(None):
            _CountingTable.scans += 1
        return super().__getitem__(key)


def _decode_counts(make_store, monkeypatch, *, lends: bool, how: str, steps: int = 20) -> tuple[int, int]:
    """(lock entries, table column reads) of ``steps`` decode steps of a live donor of four page
    units that lends (a request reused its prefix) or not. ``how``: "speculative" (a draft
    token rejected: truncate by one, then append the next on every layer and commit), or
    "extend" (one token a step through extend)."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=64)
    e = store._engine
    n = 4 * e.page_unit
    rng = np.random.default_rng(9)
    kv = rng.standard_normal((L, n + steps + 4, H, D)).astype(np.float16)
    toks = rng.integers(0, 30_000, n)
    donor = store.create_sequence(capacity=n + 1024, prefix=toks[:1])
    donor.extend(kv[:, :n], kv[:, :n], tokens=toks)
    if lends:
        store.create_sequence(capacity=n + 64, prefix=toks)
    assert bool(row_of(store, donor.id)[FLAGS] & LENT) == lends, "the borrow this test is about did not happen"
    def step() -> None:  # one decode step: a speculative one (roll back one, append it again) or an extend
        t = len(donor)
        if how == "speculative":
            donor.truncate(t - 1)
            for layer in range(L):
                donor.append(layer, kv[layer, t - 1], kv[layer, t - 1])
            donor.commit()
        else:
            donor.extend(kv[:, t : t + 1], kv[:, t : t + 1])

    for _ in range(2):  # (warm: what the first steps after the borrow settle once is not counted)
        step()
    locks = [0]
    enter = _journal._Entered.__enter__  # every entry into the store lock goes through it

    def counting_enter(self: Any) -> None:
        locks[0] += 1
        enter(self)

    monkeypatch.setattr(_journal._Entered, "__enter__", counting_enter)
    counting = e.table_np.view(_CountingTable)
    for part in (e, e.journal, e.arena, e.spans):  # every part that reads the table
        monkeypatch.setattr(part, "table_np", counting)
    _CountingTable.scans = 0
    try:
        for _ in range(steps):
            step()
        assert len(donor) == n + (steps + 2 if how == "extend" else 0)
        return locks[0], _CountingTable.scans
    finally:
        monkeypatch.undo()


def test_a_lending_donors_speculative_step_scans_the_table_no_more_than_a_plain_ones(make_store, monkeypatch) -> None:
    """A live donor lends all but its last page unit, so its speculative rollback by one token
    stays in place: its step must cost what a donor's that lends nothing costs, in lock
    entries and in scans of the sequence table."""
    plain = _decode_counts(make_store, monkeypatch, lends=False, how="speculative")
    lending = _decode_counts(make_store, monkeypatch, lends=True, how="speculative")
    assert plain[1] == 0
    assert plain[0] >= 20, plain  # (a truncate takes the lock: the count sees every step's entry)
    assert lending[0] == plain[0]
    assert lending[1] == plain[1], f"table column reads in 20 steps: {lending[1]} (a donor that lends nothing: 0)"


def test_a_lending_donors_extend_step_takes_no_lock(make_store, monkeypatch) -> None:
    """Decoding one token a step with extend: a donor that lends (all below its length) must not
    take the store lock or scan the table per step (a donor that lends nothing takes it once
    in 20 steps, to index a completed block)."""
    plain = _decode_counts(make_store, monkeypatch, lends=False, how="extend")
    lending = _decode_counts(make_store, monkeypatch, lends=True, how="extend")
    assert lending == plain, f"(lock entries, table column reads) in 20 steps: {lending} vs {plain}"


# -- a donor below its loans in a full store (the stuck lender) ---------------------------------------


def test_a_donor_in_a_full_store_truncates_below_its_loans(make_store):
    """No free range to move to: the donor's truncate still succeeds (it never fails for want of
    room because of sharing); it keeps lending the cells it no longer holds, so its next extend
    is CacheFullError, nothing written, until a range is free; then it moves and writes, and
    its borrower reads its own tokens throughout."""
    st = sharing_store(make_store, max_tokens=2048)
    a, p = seeded_donor(st, n=304, capacity=512)
    a = st.sequence(a.id, write=True)  # taken back: it may truncate and write again
    b = st.create_sequence(capacity=512, prefix=np.r_[p, [1]])
    shared = st.stats().shared_tokens
    assert shared > 100
    b_before = kv_and_tokens(b)
    fillers = []
    while st.stats().largest_free_range:  # the rest of the store in use
        fillers.append(st.create_sequence(capacity=st.stats().largest_free_range))
    a.truncate(100)
    rng = np.random.default_rng(7)
    k = rng.standard_normal((sharing.L, 200, sharing.H, sharing.D))
    with pytest.raises(shmkv.CacheFullError, match="lent its first"):
        a.extend(k, k)
    assert len(a) == 100 and kv_and_tokens(b) == b_before and st.stats().shared_tokens == shared
    fillers[-1].free()
    a.extend(k, k)
    assert kv_and_tokens(b) == b_before
    assert np.array_equal(np.asarray(a.keys(0))[100:], k[0].astype(np.float16))
    assert st.stats().shared_tokens == shared  # the borrower's span stays: its cells are its own now


def _write(op: str, s: Any, store: shmkv.Store, other: shmkv.Store, tmp_path: Any) -> int:
    """One write path of the stuck donor; returns the donor's length it leaves."""
    d = s.donor
    k = junk_kv(80)
    if op == "append-token":  # the fast path's one-token shape
        for layer in range(L):
            d.append(layer, k[layer, 0], k[layer, 0])
        return d.commit()
    if op == "append-tokens":
        for layer in range(L):
            d.append(layer, k[layer, :5], k[layer, :5])
        return d.commit()
    if op == "extend":
        return d.extend(k[:, :5], k[:, :5])
    if op == "grow":  # past its capacity (a growth, then the move)
        n = d.capacity + 10
        big = junk_kv(n)
        for layer in range(L):
            d.append(layer, big[layer], big[layer])
        return d.commit()
    if op == "shift_left":
        d.shift_left(1)
        return len(d)
    if op == "remove":
        d.remove(0, 1)
        return len(d)
    if op == "set_encoder":
        d.set_encoder(k[:, :4], k[:, :4])
        return len(d)
    if op == "copy_prefix":
        other.copy_prefix(s.fillers[0].id, d.id, 8)
        return len(d)
    if op == "restore":
        store.restore(tmp_path / "donor.skv", seq_ids=[d.id])
        return len(store.sequence(d.id))
    if op == "forward":
        with other.forward([d.id, d.id], [1, 2]) as batch:
            for layer in range(L):
                batch.put(layer, k[layer, :2], k[layer, :2])
            batch.commit()
        return len(d)
    raise AssertionError(op)


WRITES = ["append-token", "append-tokens", "extend", "grow", "shift_left", "remove", "set_encoder", "copy_prefix",
          "restore", "forward"]


@pytest.mark.parametrize(("dtype", "op"), [("float16", op) for op in WRITES]
                         + [(dt, op) for dt in ("bfloat16", "float32", "int8")
                            for op in ("append-token", "append-tokens", "extend", "grow")])
def test_every_write_path_of_a_stuck_donor_leaves_the_lent_cells_alone(make_store, tmp_path, dtype: str,
                                                                        op: str) -> None:
    """Each write path of the donor below its loans in a full store raises CacheFullError (or,
    set_encoder, needs a range it does not find) with nothing written: its borrowers read their
    prefix, their spans and the donor's row stay. Once a range is free the write succeeds, the
    lent cells still their borrowers'."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=MAX_TOKENS[dtype], max_seqs=12)
    other = shmkv.attach(store.name)  # the donor's process
    try:
        s = stuck(store, other, 40, borrowers=2)
        s.fillers[0].extend(junk_kv(8, 2.0), junk_kv(8, 2.0))  # copy_prefix's source
        store.save(tmp_path / "donor.skv", seq_ids=[s.donor.id])  # restore's source (its one token)
        spans = s.spans(store)
        drow = row_of(other, s.donor.id)
        start = drow[START]
        with pytest.raises(shmkv.CacheFullError):
            _write(op, s, store, other, tmp_path)
        assert drow[START] == start and drow[FLAGS] & LENT and len(store.sequence(s.donor.id)) == 1
        assert s.spans(store) == spans
        borrowers_hold_their_prefix(s, store)
        s.free_a_filler(other)
        length = _write(op, s, store, other, tmp_path)
        assert s.spans(store) == spans
        borrowers_hold_their_prefix(s, store)
        if op != "set_encoder":  # (a fresh encoder range: the donor itself does not move)
            assert drow[START] != start and not drow[FLAGS] & LENT
        got = store.sequence(s.donor.id)
        assert len(got) == length
        want = {"copy_prefix": 2.0, "shift_left": None, "remove": None, "restore": None, "set_encoder": None}
        if op in want:
            if want[op] is not None:
                np.testing.assert_array_equal(got.keys(0), want[op])
        else:  # its first token, then what it wrote
            np.testing.assert_array_equal(got.keys(0)[:1], s.want[0][:1])
            np.testing.assert_allclose(np.asarray(got.keys(0), np.float32)[1:], 7.0, rtol=1e-2)
        borrowers_decode_a_step(s)  # the borrowers decode on
        borrowers_hold_their_prefix(s, store)
    finally:
        other.close()


@pytest.mark.parametrize("down", ["truncate", "rewind"])
def test_a_stuck_donor_on_a_sliding_layout_extends_in_steps_only_once_it_moved(make_store, down: str) -> None:
    """Full and sliding layers: the donor goes below its loans by truncate or by rewind (both
    structural: its room stops at its length) in a full store. extend(in_steps=True) of more
    tokens than a window buffer takes between commits raises CacheFullError, nothing
    committed; once a range is free it moves and commits every step; the borrowers' full
    layers keep the donor's cells."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=12,
                       layer_types=["full", "sliding", "full"], window=16, memory=64)
    other = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 41, borrowers=2)
        spans = s.spans(store)
        if down == "truncate":
            s.donor.truncate(1)
        else:
            w = s.kv[1:2, :1]  # the sliding layer's state of token 0
            s.donor.rewind(1, w, w)
        drow = row_of(other, s.donor.id)
        start = drow[START]
        assert len(s.donor) == 1 and drow[FLAGS] & LENT and s.spans(store) == spans
        k = junk_kv(200)
        with pytest.raises(shmkv.CacheFullError):
            s.donor.extend(k, k, in_steps=True)
        assert len(s.donor) == 1 and drow[START] == start
        borrowers_hold_their_prefix(s, store, (0, 2))
        s.free_a_filler(other)
        assert s.donor.extend(k, k, in_steps=True) == 201
        assert drow[START] != start and s.spans(store) == spans
        for layer in (0, 2):
            np.testing.assert_array_equal(s.donor.keys(layer)[1:], 7.0)
        np.testing.assert_array_equal(s.donor.keys(1)[-16:], 7.0)
        borrowers_hold_their_prefix(s, store, (0, 2))
        for b in s.borrowers:  # the sliding layer: its window, the donor's tokens before its length
            win = np.asarray(b.keys(1))
            np.testing.assert_array_equal(win, s.kv[1, len(b) - len(win) : len(b)].astype(np.float16))
    finally:
        other.close()


def test_a_lender_below_its_loans_is_copied_into_elsewhere(make_store) -> None:
    """copy_prefix into a donor that lends cells it no longer holds (cleared, in a full store)
    never writes those cells in place: CacheFullError while no range is free, then a fresh
    range; its borrower keeps its prefix throughout."""
    store = kv_store(make_store)
    other = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 21)
        b, src = s.borrowers[0], s.fillers[0]
        src.extend(junk_kv(8), junk_kv(8))  # what an in-place copy would write over the lent cells
        s.donor.clear()
        drow = other._engine.row(other._engine.slot_of(s.donor.id))
        start = drow[START]
        with pytest.raises(shmkv.CacheFullError):
            other.copy_prefix(src.id, s.donor.id, 8)
        assert drow[START] == start and len(s.donor) == 0
        for layer in range(L):
            np.testing.assert_array_equal(b.keys(layer), s.want[layer][: s.m])
        s.free_a_filler(other)
        other.copy_prefix(src.id, s.donor.id, 8)
        assert drow[START] != start and len(s.donor) == 8
        for layer in range(L):
            np.testing.assert_array_equal(b.keys(layer), s.want[layer][: s.m])
            np.testing.assert_array_equal(s.donor.keys(layer), 7.0)
    finally:
        other.close()


@pytest.mark.parametrize("point", ["grow.copied", "grow.switched"])
def test_a_failed_growth_of_a_stuck_donor_rolls_back_and_keeps_its_borrowers_commit(make_store, monkeypatch,
                                                                                    point: str) -> None:
    """The stuck donor's append past its capacity grows it (a range was freed): the growth
    fails at ``point`` while a borrower commits its step. The donor is back where it was (one
    token, still lending, its room at its length: the next append goes the checked way), the
    borrower's step stays, and the next append grows and moves it."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=12)
    other = shmkv.attach(store.name)
    try:
        s = stuck(store, other, 42)
        b, m = s.borrowers[0], s.m
        for layer in range(L):
            b.append(layer, s.kv[layer, m], s.kv[layer, m])
        s.free_a_filler(other)
        drow = row_of(other, s.donor.id)
        start = drow[START]
        seen: list[int] = []

        def commit_then_fail(name: str) -> None:
            if name == point:
                seen.append(b.commit(tokens=s.toks[m : m + 1]))
                raise RuntimeError(f"the growth fails at {point}")

        big = junk_kv(s.donor.capacity + 10)
        monkeypatch.setattr(crash, "point", commit_then_fail)
        with pytest.raises(RuntimeError, match="the growth fails"):
            s.donor.append(0, big[0], big[0])
        monkeypatch.undo()
        assert seen == [m + 1], "the growth this test is about did not happen"
        assert drow[START] == start and drow[FLAGS] & LENT and len(s.donor) == 1
        assert len(b) == m + 1
        borrowers_hold_their_prefix(s, store)
        one = junk_kv(1)
        for layer in range(L):  # within its capacity: still the checked way, so it moves first
            s.donor.append(layer, one[layer], one[layer])
        assert s.donor.commit() == 2 and drow[START] != start
        borrowers_hold_their_prefix(s, store)
        for layer in range(L):
            s.donor.append(layer, big[layer], big[layer])
        assert s.donor.commit() == 2 + big.shape[1]
        np.testing.assert_array_equal(s.donor.keys(0)[1:], 7.0)
        borrowers_hold_their_prefix(s, store)
    finally:
        other.close()


@pytest.mark.parametrize("how", ["free", "evict"])
def test_a_stuck_donor_freed_or_evicted_leaves_its_loans_to_its_borrowers(make_store, how: str) -> None:
    """The stuck donor is freed, or finished (it still cannot move) and evicted by a create that
    needs its room. New sequences take its cells but the lent ones and fill them; the
    borrowers read their prefix and decode on."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=16)
    other = shmkv.attach(store.name)
    try:
        s = stuck(store, other, 43, borrowers=2)
        spans = s.spans(store)
        cap = s.donor.capacity
        if how == "free":
            s.donor.free()
        else:
            s.donor.finish()
            assert row_of(other, s.donor.id)[FLAGS] & LENT  # (finish tried to move it: no room)
        made = []
        while True:  # everything free filled with 5.0 (the first create evicts the finished donor)
            room = store.stats().largest_free_range if made or how == "free" else cap - 2 * store._engine.page_unit
            if not room:
                break
            seq = store.create_sequence(capacity=room)
            seq.extend(junk_kv(room, 5.0), junk_kv(room, 5.0))
            made.append(seq)
        assert made and s.spans(store) == spans
        with pytest.raises(shmkv.SequenceNotFound):
            store.sequence(s.donor.id)
        if how == "evict":
            assert store.stats().evictions == 1
        borrowers_hold_their_prefix(s, store)
        borrowers_decode_a_step(s)
        borrowers_hold_their_prefix(s, store)
    finally:
        other.close()


@pytest.mark.parametrize("middle", [5, 20])
def test_a_chain_whose_middle_truncates_while_its_donor_is_stuck(make_store, middle: int) -> None:
    """A chain: ``mid`` borrows the donor's prefix, ``tail`` is a fork of ``mid`` (it borrows the
    donor's cells through it). The donor, taken back, is stuck below its loans; ``mid``
    truncates into its span (copy-on-write of what it keeps) and decodes on; the donor then
    moves and writes. Everyone reads their own tokens throughout."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=16)
    other = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 44)
        mid = s.borrowers[0]
        s.fillers.pop().free()  # room for the fork (then filled again)
        tail = mid.fork(capacity=s.n + 64)
        while store.stats().largest_free_range:
            s.fillers.append(store.create_sequence(capacity=store.stats().largest_free_range))
        spans = {x.id: int(row_of(store, x.id)[SPAN_CELLS]) for x in (mid, tail)}
        assert all(spans.values()), f"the chain this test is about did not happen: spans {spans}"
        s.donor.truncate(1)  # stuck
        mid.truncate(middle)  # the middle into its span
        for t in range(middle, middle + 3):
            for layer in range(L):
                mid.append(layer, s.kv[layer, t], s.kv[layer, t])
            mid.commit(tokens=s.toks[t : t + 1])
        junk = junk_kv(30)
        with pytest.raises(shmkv.CacheFullError):
            s.donor.extend(junk, junk)
        s.free_a_filler(store)
        assert s.donor.extend(junk, junk) == 31
        for x in (mid, tail):
            for layer in range(L):
                np.testing.assert_array_equal(x.keys(layer), s.want[layer][: len(x)])
                np.testing.assert_array_equal(other.sequence(x.id).keys(layer), s.want[layer][: len(x)])
        np.testing.assert_array_equal(s.donor.keys(0)[1:], 7.0)
    finally:
        other.close()


def test_a_stuck_donor_whose_borrowers_are_gone_writes_in_place(make_store) -> None:
    """The stuck donor's borrowers are freed one by one (the store filled again each time).
    While one still borrows, the donor's write raises CacheFullError; once none does, it
    writes in place (no range needed), and its next change drops its LENT flag."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=12)
    other = shmkv.attach(store.name)
    try:
        s = stuck(store, other, 48, borrowers=2)
        drow = row_of(other, s.donor.id)
        start = drow[START]
        k = junk_kv(20)

        def refill() -> None:  # (a freed borrower's own range is a range the donor could move to)
            while room := store.stats().largest_free_range:
                s.fillers.append(store.create_sequence(capacity=room))

        s.borrowers.pop().free()
        refill()
        with pytest.raises(shmkv.CacheFullError):
            s.donor.extend(k, k)
        borrowers_hold_their_prefix(s, store)
        s.borrowers.pop().free()
        refill()
        assert s.donor.extend(k, k) == 21
        assert drow[START] == start
        np.testing.assert_array_equal(s.donor.keys(0)[1:], 7.0)
        s.donor.truncate(20)  # (its flag goes at its next change: leave_loans only reads it)
        assert not drow[FLAGS] & LENT
    finally:
        other.close()


def _inherited_write(donor: shmkv.Sequence, out: Any) -> None:  # a forked child
    """The donor's write handle, inherited across fork, tries every way to write."""
    got = []
    k = junk_kv(3)
    for attempt in (lambda: donor.append(0, k[0], k[0]), lambda: donor.extend(k, k), lambda: donor.truncate(0)):
        try:
            attempt()
            got.append("wrote")
        except shmkv.LeaseError:
            got.append("LeaseError")
        except BaseException as e:
            got.append(f"{type(e).__name__}: {e}")
    out.put(got)


def test_a_stuck_donors_handle_inherited_across_fork_writes_nothing(make_store) -> None:
    """A child forked from the stuck donor's process (a range free meanwhile, so a move would
    succeed) holds the donor's write handle: every write through it is a LeaseError, nothing
    moves, and the parent's handle then moves and writes."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=12)
    other = shmkv.attach(store.name)
    try:
        s = stuck(store, other, 49)
        s.free_a_filler(other)
        drow = row_of(other, s.donor.id)
        start = drow[START]
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_inherited_write, args=(s.donor, out))
        child.start()
        try:
            got = out.get(timeout=120)
        finally:
            child.join(60)
            if child.is_alive():
                child.kill()
                child.join()
        assert got == ["LeaseError"] * 3 and child.exitcode == 0
        assert drow[START] == start and drow[FLAGS] & LENT and len(s.donor) == 1
        borrowers_hold_their_prefix(s, store)
        assert s.donor.extend(junk_kv(3), junk_kv(3)) == 4 and drow[START] != start
        borrowers_hold_their_prefix(s, store)
    finally:
        other.close()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("how", ["meta", "set_tokens", "set_encoder"])
def test_a_donor_below_its_loans_is_not_moved_by_another_change_of_its_own(make_store, dtype: str, how: str) -> None:
    """The donor went below its loans in a full store and a range was freed since. Its meta=,
    set_tokens or set_encoder (changes of its own row that keep its length) does not move it (a
    move inside them would leave the handle the old range's addressing, and the donor's next
    tokens in the cells its borrowers read). Its next append moves it, and both read their own
    tokens."""
    from _donor_scenes import kv_store

    store = kv_store(make_store, dtype)
    other = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 5)
        d = s.donor
        drow = other._engine.row(other._engine.slot_of(d.id))
        d.truncate(s.n // 3)
        start = drow[START]
        s.free_a_filler(other)
        if how == "meta":
            d.meta = {"r": 1}
        elif how == "set_tokens":
            d.set_tokens(s.toks[:2], 0)
        else:
            k = np.ones((L, 4, H, D), np.float32)
            d.set_encoder(k, k)
        assert drow[START] == start and drow[FLAGS] & LENT  # not moved by it
        x = np.full((H, D), 9.0, np.float32)
        for layer in range(L):
            d.append(layer, x, x)
        assert d.commit() == s.n // 3 + 1
        assert drow[START] != start  # moved by the write
        for layer in range(L):
            np.testing.assert_array_equal(s.borrowers[0].keys(layer)[: s.m], s.want[layer][: s.m])
            assert float(np.asarray(d.keys(layer))[-1, 0, 0]) == 9.0
    finally:
        other.close()


def test_a_change_of_a_stuck_donors_meta_evicts_nothing(make_store) -> None:
    """In the same state, with a finished (evictable) sequence in the store instead of a free
    range: meta= evicts nothing (only a create, a growth or a write that needs room may); the
    donor's next append may, to move."""
    from _donor_scenes import kv_store

    store = kv_store(make_store)
    other = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 6)
        s.donor.truncate(1)
        s.fillers[-1].finish()  # evictable now
        before = store.stats()
        s.donor.meta = {"r": 2}
        after = store.stats()
        assert (after.sequences, after.evictions) == (before.sequences, before.evictions)
        x = np.full((H, D), 9.0, np.float32)
        for layer in range(L):
            s.donor.append(layer, x, x)
        assert s.donor.commit() == 2
        for layer in range(L):
            np.testing.assert_array_equal(s.borrowers[0].keys(layer)[: s.m], s.want[layer][: s.m])
    finally:
        other.close()


# -- threads of one process --------------------------------------------------------------------------


@pytest.mark.slow
def test_threads_decode_a_donor_that_goes_below_its_loans_while_others_borrow_and_fill(make_store) -> None:
    """Three threads of one process, each with its own attachment: the donor's writer decodes
    (speculative steps, and now and then a rollback deep below what it lent, then a prefill
    again), a requester borrows the donor's current prefix and frees borrowers, a third fills
    the store and frees again (so the donor is now and then stuck, and moves). Every sequence
    reads the keys of its own tokens after each step, and at the end."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=24)
    u = store._engine.page_unit
    atts = [shmkv.attach(store.name) for _ in range(3)]
    errors: list[BaseException] = []
    done = threading.Event()
    next_id = iter(range(1000, 10**6))
    borrows: list[int] = []
    borrowed = threading.Event()  # the requester's first borrow: the filler starts filling after it

    def run(fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # (reported by the main thread)
            errors.append(e)
            done.set()

    # the donor is made before the other threads start: a finished sequence nobody leases is
    # evictable, and the filler would evict it (or fill the store) before its lease is taken back
    first = atts[0].create_sequence(capacity=8 * u)
    toks = np.array([next(next_id) for _ in range(4 * u)])
    first.extend(token_keys(toks)[None].repeat(L, 0), token_keys(toks)[None].repeat(L, 0), tokens=toks)
    first.finish()  # a finished donor lends all it holds: a rollback goes below its loans
    donor = atts[0].sequence(first.id, write=True)

    def donor_steps() -> None:
        d = donor
        rng = np.random.default_rng(45)
        for step in range(300):
            if done.is_set():
                return
            n = len(d)
            if step % 25 == 24:
                d.truncate(int(rng.integers(1, max(2, n))))
            else:
                d.truncate(max(1, n - int(rng.integers(0, 3))))
            add = np.array([next(next_id) for _ in range(int(rng.integers(1, 3)) if step % 25 else 3 * u)])
            kv = token_keys(add)[None].repeat(L, 0)
            try:
                if add.size > 2 or len(d) + add.size > d.capacity:
                    d.extend(kv, kv, tokens=add)
                else:
                    for layer in range(L):
                        d.append(layer, kv[layer], kv[layer])
                    d.commit(tokens=add)
            except shmkv.CacheFullError:  # (the store full: stuck below its loans, or no room to grow)
                d.discard()
            holds_its_tokens(d)
        done.set()

    def requester() -> None:
        st = atts[1]
        kept: list[shmkv.Sequence] = []
        rng = np.random.default_rng(46)
        while not done.is_set():
            donors = [i for i in st.sequences() if i.length >= 2 * u]
            if not donors:
                continue
            src = st.sequence(donors[int(rng.integers(len(donors)))].id)
            prompt = np.append(np.asarray(src.tokens), next(next_id))
            try:
                b = st.create_sequence(capacity=len(prompt) + 8, prefix=prompt)
            except (shmkv.CacheFullError, shmkv.SequenceNotFound):
                continue
            holds_its_tokens(b)
            if row_of(st, b.id)[SPAN_CELLS]:
                borrows.append(b.id)
                borrowed.set()
            kept.append(b)
            if len(kept) > 3:
                kept.pop(int(rng.integers(len(kept)))).free()
            for k in kept:
                holds_its_tokens(k)
        for k in kept:
            holds_its_tokens(k)
            k.free()

    def filler() -> None:
        st = atts[2]
        mine: list[shmkv.Sequence] = []
        # (a store kept full from the start could refuse every borrow of a run: 3 to 61 borrows
        # in 20 runs under load, so some run would have none and fail "no borrow happened")
        while not borrowed.wait(0.01) and not done.is_set():
            pass
        while not done.is_set():
            try:
                while (room := st.stats().largest_free_range) and len(mine) < 6:
                    mine.append(st.create_sequence(capacity=room))
            except shmkv.CacheFullError:
                pass
            if mine:
                mine.pop(0).free()
        for f in mine:
            f.free()

    threads = [threading.Thread(target=run, args=(f,)) for f in (donor_steps, requester, filler)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a thread did not finish"
        if errors:
            raise errors[0]
        assert borrows, "no borrow happened"  # (the requester borrows before the filler fills the store)
        for info in store.sequences():
            holds_its_tokens(store.sequence(info.id))
    finally:
        done.set()
        for t in threads:
            t.join(5)
        for a in atts:
            a.close()
