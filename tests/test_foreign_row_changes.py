"""Journal invariant 10: a transaction that changes another writer's row
(a borrow marking its decoding donor LENT: ``changing(row, foreign=True)``) must never undo
what that row's lease holder does without the lock meanwhile, whichever way the transaction
ends (an exception at a crash point, a SIGKILL and another process's recovery), and whoever
reads meanwhile (a read-only attachment's ``settled_row``, ``store.sequences()``, a snapshot).

What the lease holder writes without the lock: its pending tokens' cells, then LENGTH (commit),
and LEASE_PID = 0 (release). The first two findings here:

* a rolled-back borrow dropped the donor's pending decode step (``writer.kept`` only kept it
  while the row still lent or borrowed; after the rollback it did neither, and the commit
  silently returned the old length);
* a rolled-back borrow gave a released lease back (the rollback restored the logged LEASE_PID:
  no other process could take the sequence until the releasing one exited).

Sections 4 to 6 are about the other such change there was, a donor's truncate in a full store
giving its decoding borrowers private copies. It is gone (session 32): the donor wrote those
cells at once while other attachments still mapped them as the borrower's. The donor now keeps
lending them and moves before it writes there; the tests show its borrowers left alone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import pytest

import shmkv
from shmkv._engine.locking import crash
from shmkv._engine.table import header as _header
from shmkv._engine.table.header import FLAGS, LEASE_PID, LENT, START
from shmkv.testing import unique_name
from _share_scenes import borrow_and_die, die_at, kv_store, lent_in_a_full_store, let_go_and_reap

L, H, D = 3, 2, 64


def _kv(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, n, H, D)).astype(np.float32), rng.integers(0, 30_000, n)


def _donor(store: shmkv.Store, kv: np.ndarray, toks: np.ndarray, n: int, capacity: int) -> shmkv.Sequence:
    donor = store.create_sequence(capacity=capacity, prefix=toks[:1])
    donor.extend(kv[:, :n], kv[:, :n], tokens=toks[:n])
    return donor


def _expected_keys(store: shmkv.Store, kv: np.ndarray, n: int) -> list[np.ndarray]:
    """Keys of ``kv[:, :n]`` as the store's dtype stores them (a sequence of its own, freed)."""
    ref = store.create_sequence(capacity=n)
    try:
        ref.extend(kv[:, :n], kv[:, :n])
        return [ref.keys(layer).copy() for layer in range(L)]
    finally:
        ref.free()


def _raise_at(point: str, before: Any = None, count: int = 1, fail: bool = True):
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


# -- 1. the donor's pending step survives a rolled-back borrow -----------------------------------


@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("appended_before", [1, L])
def test_a_rolled_back_borrow_keeps_the_donors_pending_step(make_store, monkeypatch, dtype: str,
                                                            appended_before: int) -> None:
    """The donor appended ``appended_before`` layers of its next token; another attachment's
    create borrows from it (LENT) and fails after the borrow; the donor then appends the other
    layers and commits: the step is there, with its token id and its values. (On main the
    rollback moved the row's generation with LENT gone, ``kept`` said no, and the pending
    tokens were dropped: a commit with no token pending, or one layer short.)"""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=8)
    other = shmkv.attach(store.name)  # the requester's process
    try:
        n = 3 * store._engine.page_unit
        kv, toks = _kv(11, n + 1)
        want = _expected_keys(store, kv, n + 1)
        donor = _donor(store, kv, toks, n, n + 64)
        drow = store._engine.row(store._engine.slot_of(donor.id))
        for layer in range(appended_before):
            donor.append(layer, kv[layer, n], kv[layer, n])
        seen: list[bool] = []
        monkeypatch.setattr(crash, "point", _raise_at("create.copied", lambda: seen.append(bool(drow[FLAGS] & LENT))))
        with pytest.raises(RuntimeError, match=r"create\.copied"):
            other.create_sequence(capacity=n + 64, prefix=toks[:n])
        monkeypatch.setattr(crash, "point", crash._noop)
        assert seen == [True], "the borrow this test is about did not happen"
        assert not drow[FLAGS] & LENT
        for layer in range(appended_before, L):
            donor.append(layer, kv[layer, n], kv[layer, n])
        assert donor.commit(tokens=toks[n : n + 1]) == n + 1
        assert len(other.sequence(donor.id)) == n + 1
        assert int(donor.tokens[n]) == int(toks[n])
        for layer in range(L):
            np.testing.assert_array_equal(donor.keys(layer), want[layer])
        assert store.match_prefix([*toks[: n + 1].tolist(), 1]) >= n  # still a donor
    finally:
        other.close()


# -- 2. a lease released during a rolled-back borrow stays released ----------------------------


def _take_lease(name: str, seq_id: int, out: Any) -> None:  # a child: the next decode worker
    try:
        s = shmkv.attach(name)
        try:
            s.sequence(seq_id, write=True).release()
            out.put("taken")
        finally:
            s.close()
    except BaseException as e:  # reported, not raised: the parent asserts on it
        out.put(f"{type(e).__name__}: {e}")


def _in_child(ctx: Any, target: Any, *args: Any) -> str:
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


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_lease_released_during_a_rolled_back_borrow_stays_released(make_store, monkeypatch, method: str) -> None:
    """The tokenizer prefills a donor and releases it (for a decode worker) while another
    request's create borrows from it and then fails: the rollback restored the logged
    LEASE_PID, and every other process got LeaseError ('leased by live process') until the
    tokenizer exited."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=8)
    other = shmkv.attach(store.name)
    try:
        n = 3 * store._engine.page_unit
        kv, toks = _kv(12, n)
        donor = _donor(store, kv, toks, n, n + 64)
        monkeypatch.setattr(crash, "point", _raise_at("create.copied", donor.release))
        with pytest.raises(RuntimeError, match=r"create\.copied"):
            other.create_sequence(capacity=n + 64, prefix=toks[:n])
        monkeypatch.setattr(crash, "point", crash._noop)
        drow = store._engine.row(store._engine.slot_of(donor.id))
        assert drow[LEASE_PID] == 0
        assert [s.lease_pid for s in other.sequences() if s.id == donor.id] == [0]
        assert _in_child(mp.get_context(method), _take_lease, store.name, donor.id) == "taken"
    finally:
        other.close()


def _read_only_view(name: str, seq_id: int, out: Any) -> None:  # a child: an inspector
    try:
        ro = shmkv.attach(name, readonly=True)
        try:
            info = [(s.length, s.lease_pid) for s in ro.sequences() if s.id == seq_id]
            out.put(f"{len(ro.sequence(seq_id))} {info}")
        finally:
            ro.close()
    except BaseException as e:
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_requester_killed_after_its_borrow_leaves_the_donors_step_and_release(make_store, method: str) -> None:
    """A requester (a ``method`` child) is SIGKILLed inside its create, after marking the
    decoding donor LENT. Meanwhile the donor commits the step it had pending and its writer
    releases the lease (a tokenizer handing over). An inspector (read-only, another process:
    rows as the rollback will leave them) sees the committed length and no lease; the next
    decode worker (a third process, whose lock entry rolls the dead create back) takes the
    lease; the committed step is there with its values."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=8)
    n = 3 * store._engine.page_unit
    kv, toks = _kv(13, n + 1)
    want = _expected_keys(store, kv, n + 1)
    donor = _donor(store, kv, toks, n, n + 64)
    drow = store._engine.row(store._engine.slot_of(donor.id))
    for layer in range(L):
        donor.append(layer, kv[layer, n], kv[layer, n])
    ctx = mp.get_context(method)
    at, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=borrow_and_die, args=(store.name, toks[:n].tolist(), n + 64, at, go))
    child.start()
    try:
        assert at.wait(120), "the child never reached its borrow"
        assert drow[FLAGS] & LENT
        assert donor.commit(tokens=toks[n : n + 1]) == n + 1
        donor.release()
    finally:
        let_go_and_reap(child, go)
    assert child.exitcode == -signal.SIGKILL
    assert drow[LEASE_PID] == 0 and len(donor) == n + 1  # not rolled back yet: nobody took the lock
    assert _in_child(ctx, _read_only_view, store.name, donor.id) == f"{n + 1} [({n + 1}, 0)]"
    assert _in_child(ctx, _take_lease, store.name, donor.id) == "taken"  # (its lock entry recovers)
    assert not drow[FLAGS] & LENT and drow[LEASE_PID] == 0
    assert len(donor) == n + 1 and store.stats().sequences == 1
    for layer in range(L):
        np.testing.assert_array_equal(donor.keys(layer), want[layer])


# -- 3. a commit that completes a block during another process's borrow ------------------------


def _borrow_then_end(name: str, prefix: list[int], capacity: int, events: tuple[Any, Any], end: str) -> None:  # a child
    at, go = events
    def pause_then_end(point: str) -> None:
        if point == "create.copied":
            at.set()
            go.wait(120)
            if end == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("the request fails after its borrow")

    crash.point = pause_then_end
    s = shmkv.attach(name)
    try:
        s.create_sequence(capacity=capacity, prefix=prefix)
    except RuntimeError:
        os._exit(3)
    os._exit(0)


@pytest.mark.parametrize("end", ["raise", "kill"])
def test_a_commit_completing_a_block_during_a_borrow_is_kept_and_indexed(make_store, monkeypatch, end: str) -> None:
    """The donor's commit completes a 16-token block while another process's create holds the
    store lock with the donor's row logged (LENT): the commit publishes its length, then waits
    for the lock to index the block. The create then fails (``raise``: its own rollback) or
    dies (``kill``: the donor's own lock entry recovers it). The block is committed, indexed
    (a later request reuses it) and its values are there."""
    from shmkv._sequence.writer import SeqWriter

    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=8)
    n = 3 * store._engine.page_unit
    assert n % 16 == 0
    kv, toks = _kv(14, n + 17)
    want = _expected_keys(store, kv, n + 16)
    donor = _donor(store, kv, toks, n, n + 64)
    drow = store._engine.row(store._engine.slot_of(donor.id))
    for layer in range(L):
        donor.append(layer, kv[layer, n : n + 16], kv[layer, n : n + 16])
    published = mp.get_context("fork").Event()  # (a threading.Event would do: one process)
    index = SeqWriter.index_committed

    def index_after_publish(self: SeqWriter, length: int) -> None:
        published.set()  # the length is out; the lock comes next
        index(self, length)

    monkeypatch.setattr(SeqWriter, "index_committed", index_after_publish)
    ctx = mp.get_context("fork")
    at, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_borrow_then_end, args=(store.name, toks[:n].tolist(), n + 64, (at, go), end))
    child.start()
    got: list[object] = []
    import threading

    committer = threading.Thread(target=lambda: got.append(donor.commit(tokens=toks[n : n + 16])))
    try:
        assert at.wait(120), "the child never reached its borrow"
        assert drow[FLAGS] & LENT
        committer.start()
        assert published.wait(120), "the commit never published its length"
        assert drow[FLAGS] & LENT  # the borrow's transaction is still open
    finally:
        let_go_and_reap(child, go)
        if committer.ident is not None:
            committer.join(120)
    assert child.exitcode == (-signal.SIGKILL if end == "kill" else 3)
    assert got == [n + 16]
    assert len(donor) == n + 16 and not drow[FLAGS] & LENT
    assert store.match_prefix(toks[: n + 17].tolist()) == n + 16  # indexed after the rollback
    for layer in range(L):
        np.testing.assert_array_equal(donor.keys(layer), want[layer])
    b = store.create_sequence(capacity=n + 64, prefix=toks[: n + 17])
    assert len(b) == n + 16
    for layer in range(L):
        np.testing.assert_array_equal(b.keys(layer), want[layer])


# -- 4. a donor truncated below its loans in a full store: its borrowers are left alone ------------


def _junk(n: int) -> np.ndarray:
    return np.full((L, n, H, D), 7.0, np.float32)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_donor_below_its_loans_in_a_full_store_leaves_its_decoding_borrowers_alone(make_store, dtype: str) -> None:
    """The donor (another attachment) truncates below what it lent to two decoding borrowers,
    in a store with no free range. The truncate succeeds and changes neither borrower (their
    spans, pending steps and views stay); the donor's next append and extend raise
    CacheFullError, naming the loan, with nothing written; once a range is free, its extend
    moves it there and writes, and the borrowers still read their prefix. (Before, the donor
    gave its borrowers private copies and wrote the cells at once, under views other
    attachments held of them.)"""
    store = kv_store(make_store, dtype)
    other = shmkv.attach(store.name)  # the donor's process
    try:
        s = lent_in_a_full_store(store, other, 15, borrowers=2)
        m, n, kv = s.m, s.n, s.kv
        spans = s.spans(store)
        views = [b.append(0, kv[0, m : n + 1], kv[0, m : n + 1])[0] for b in s.borrowers]  # mid-step
        drow = other._engine.row(other._engine.slot_of(s.donor.id))
        start = drow[START]
        s.donor.truncate(1)
        assert s.spans(store) == spans and drow[FLAGS] & LENT and drow[START] == start
        junk = _junk(n)
        with pytest.raises(shmkv.CacheFullError, match=r"lent its first .* none is free"):
            s.donor.append(0, junk[0, :1], junk[0, :1])
        with pytest.raises(shmkv.CacheFullError, match=r"lent its first .* \(nothing was written\)"):
            s.donor.extend(junk, junk)
        assert len(s.donor) == 1 and drow[START] == start
        for b, k in zip(s.borrowers, views, strict=True):
            np.testing.assert_array_equal(k[:m], s.want[0][:m])  # (int8: the pending tokens as given, in the mirror)
            for layer in range(1, L):
                b.append(layer, kv[layer, m : n + 1], kv[layer, m : n + 1])
            assert b.commit(tokens=s.toks[m : n + 1]) == n + 1
        s.free_a_filler(other)
        assert s.donor.extend(junk, junk) == n + 1
        assert drow[START] != start and not drow[FLAGS] & LENT  # moved: the lent cells stay the borrowers'
        assert s.spans(store) == spans
        for layer in range(L):
            np.testing.assert_allclose(s.donor.keys(layer)[1:], 7.0, rtol=1e-2)
        for b in s.borrowers:
            for layer in range(L):
                np.testing.assert_array_equal(b.keys(layer), s.want[layer][: n + 1])
                np.testing.assert_array_equal(other.sequence(b.id).keys(layer), s.want[layer][: n + 1])
    finally:
        other.close()


# -- 5. views of a borrower held by its attachment while its donor goes below its loans ------------


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_borrowers_views_taken_mid_step_keep_its_prefix_when_its_donor_writes(make_store, dtype: str) -> None:
    """The borrower appended layer 0 of its step (the views attention runs on); then its donor
    truncates in a full store and tries to write into the cells it had lent: by append, by
    extend, and through a handle another attachment takes over the lease with. Each raises
    CacheFullError, and the borrower's views still show its prefix. (Found last session as a
    strict xfail: the donor gave the borrower private copies and wrote the cells at once, while
    the borrower's attachment still mapped them: attention of a step whose commit succeeded
    read another sequence's keys.)"""
    store = kv_store(make_store, dtype)
    other = shmkv.attach(store.name)  # the donor's process
    third = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 17)
        b, m, n, kv = s.borrowers[0], s.m, s.n, s.kv
        k, _ = b.append(0, kv[0, m:], kv[0, m:])  # mid-step: attention of layer 0 runs on k
        want = np.asarray(k[:m]).copy()
        s.donor.truncate(1)
        junk = _junk(n - 1)
        with pytest.raises(shmkv.CacheFullError):
            s.donor.extend(junk, junk)
        with pytest.raises(shmkv.CacheFullError):
            for layer in range(L):
                s.donor.append(layer, junk[layer, :2], junk[layer, :2])
        s.donor.release()
        taken = third.sequence(s.donor.id, write=True)  # a new handle: its room is what is written
        with pytest.raises(shmkv.CacheFullError):
            taken.append(0, junk[0, :1], junk[0, :1])
        np.testing.assert_array_equal(k[:m], want)
        np.testing.assert_array_equal(k[:m], s.want[0][:m])
        for layer in range(1, L):
            b.append(layer, kv[layer, m:], kv[layer, m:])
        assert b.commit(tokens=s.toks[m:]) == n + 4
        for layer in range(L):
            np.testing.assert_array_equal(b.keys(layer), s.want[layer])
    finally:
        third.close()
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
        src.extend(_junk(8), _junk(8))  # what an in-place copy would write over the lent cells
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


# -- 6. a donor killed while it moves away from its loans; an inspector reads meanwhile -----------


def _extend_and_die(name: str, donor_id: int, n: int, at: Any, go: Any) -> None:  # a child: the donor's process
    s = shmkv.attach(name)
    donor = s.sequence(donor_id, write=True)
    die_at("share.moved", at, go)  # its cells copied to the fresh range, the row not yet switched
    donor.extend(_junk(n), _junk(n))
    os._exit(0)  # (not reached)


def _inspect(name: str, ids: list[int], out: Any) -> None:  # a child: a read-only inspector
    try:
        ro = shmkv.attach(name, readonly=True)
        try:
            seqs = [ro.sequence(i) for i in ids]
            out.put([(len(s), [s.keys(layer).tobytes() for layer in range(L)]) for s in seqs])
        finally:
            ro.close()
    except BaseException as e:
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_donor_killed_moving_off_its_loans_leaves_its_borrowers_steps(make_store, tmp_path, method: str) -> None:
    """The donor truncated below what it lent in a full store; a range is freed, and its
    process (a ``method`` child) extends, so it moves, and is SIGKILLed with its cells copied
    and the row not yet switched. Its borrowers commit a step meanwhile; a read-only inspector
    (another process) reads both at their committed length with their values, and a read-only
    attachment's snapshot holds them; the next lock entry rolls the move back (the donor where
    it was, still lending, at its length), the borrowers decode on, and the donor's next
    extend moves it."""
    store = kv_store(make_store)
    other = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 18, borrowers=2)
        m, n, kv = s.m, s.n, s.kv
        for b in s.borrowers:
            for layer in range(L):
                b.append(layer, kv[layer, m : n + 1], kv[layer, m : n + 1])
        s.donor.truncate(1)
        s.donor.release()
        s.free_a_filler(other)
        drow = store._engine.row(store._engine.slot_of(s.donor.id))
        start = drow[START]
        ctx = mp.get_context(method)
        at, go = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_extend_and_die, args=(store.name, s.donor.id, n, at, go))
        child.start()
        try:
            assert at.wait(120), "the donor's process never reached its move"
            for b in s.borrowers:
                assert b.commit(tokens=s.toks[m : n + 1]) == n + 1
        finally:
            let_go_and_reap(child, go)
        assert child.exitcode == -signal.SIGKILL
        seen = _in_child(ctx, _inspect, store.name, [b.id for b in s.borrowers])  # the dead move still in the log
        assert not isinstance(seen, str), seen
        for length, keys in seen:
            assert length == n + 1
            for layer in range(L):
                assert keys[layer] == s.want[layer][: n + 1].tobytes()
        ro = shmkv.attach(store.name, readonly=True)
        try:
            ro.save(tmp_path / "during.skv")  # (under its shared lock: rows as the rollback leaves them)
        finally:
            ro.close()
        loaded = shmkv.load(tmp_path / "during.skv", name=unique_name())
        try:
            assert len(loaded.sequence(s.donor.id)) == 1
            for b in s.borrowers:
                for layer in range(L):
                    np.testing.assert_array_equal(loaded.sequence(b.id).keys(layer), s.want[layer][: n + 1])
        finally:
            loaded.close()
        with store.transaction():  # the dead move rolled back
            pass
        assert drow[START] == start and drow[FLAGS] & LENT and len(store.sequence(s.donor.id)) == 1
        for b in s.borrowers:
            for layer in range(L):
                b.append(layer, kv[layer, n + 1 :], kv[layer, n + 1 :])
            assert b.commit(tokens=s.toks[n + 1 :]) == n + 4
            for layer in range(L):
                np.testing.assert_array_equal(b.keys(layer), s.want[layer])
        donor = store.sequence(s.donor.id, write=True)
        assert donor.extend(_junk(n), _junk(n)) == n + 1 and drow[START] != start
        for b in s.borrowers:
            for layer in range(L):
                np.testing.assert_array_equal(b.keys(layer), s.want[layer])
    finally:
        other.close()


# -- 7. a speculative decoder (truncate, then the next step) mid-step when its donor or borrower changes


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_speculative_donor_keeps_its_step_when_borrowed_from_mid_step(make_store, dtype: str) -> None:
    """Speculative decoding: the donor rolls back two draft tokens (truncate), appends its next
    step on every layer, and another request borrows from it before the commit. The commit
    keeps the step. (On main the handle's known length was the one before the truncate, so
    ``kept`` said no and the commit silently returned the old length.)"""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=8)
    other = shmkv.attach(store.name)  # the requester's process
    try:
        n = 3 * store._engine.page_unit
        kv, toks = _kv(19, n + 4)
        want = _expected_keys(store, kv, n + 3)
        donor = _donor(store, kv, toks, n + 4, n + 64)
        donor.truncate(n + 2)  # two draft tokens rejected
        for layer in range(L):
            donor.append(layer, kv[layer, n + 2], kv[layer, n + 2])
        other.create_sequence(capacity=n + 64, prefix=toks[:n])
        assert other.stats().shared_tokens > 0, "the borrow this test is about did not happen"
        assert donor.commit(tokens=toks[n + 2 : n + 3]) == n + 3
        for layer in range(L):
            np.testing.assert_array_equal(donor.keys(layer), want[layer])
    finally:
        other.close()


def test_a_speculative_borrower_keeps_its_step_when_its_donor_truncates_mid_step(make_store) -> None:
    """As above, on the borrower's side: it rolls back a draft token and appends its next step;
    its donor then truncates below what it lent in a full store (it cannot move, so it keeps
    lending cells it no longer holds). The borrower's span stays, and its commit keeps the step."""
    store = kv_store(make_store)
    other = shmkv.attach(store.name)  # the donor's process
    try:
        s = lent_in_a_full_store(store, other, 20)
        b, m, n, kv = s.borrowers[0], s.m, s.n, s.kv
        b.extend(kv[:, m : n + 2], kv[:, m : n + 2], tokens=s.toks[m : n + 2])
        b.truncate(n + 1)  # a draft token rejected
        for layer in range(L):
            b.append(layer, kv[layer, n + 1], kv[layer, n + 1])
        spans = s.spans(store)
        s.donor.truncate(1)
        assert s.spans(store) == spans
        assert b.commit(tokens=s.toks[n + 1 : n + 2]) == n + 2
        for layer in range(L):
            np.testing.assert_array_equal(b.keys(layer), s.want[layer][: n + 2])
    finally:
        other.close()


# -- 8. the journal's rule itself -----------------------------------------------------------------


def test_a_foreign_entry_keeps_the_lock_free_words_and_a_whole_change_puts_them_back(make_store) -> None:
    """Journal invariant 10 at its source. A row changed as another writer's (``foreign``) and
    rolled back keeps the LENGTH and LEASE_PID its holder wrote meanwhile; once the same
    transaction changes that row as a whole (not foreign), its rollback puts every word back
    but a release of the lease (``lease.keeping_release``)."""
    from shmkv._engine.table.header import LENGTH

    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=256, max_seqs=4)
    seq = store.create_sequence(capacity=64)
    k = np.ones((2, 3, 2, 8), np.float32)
    seq.extend(k, k)
    e = store._engine
    row = e.row(e.slot_of(seq.id))
    pid = int(row[LEASE_PID])
    assert pid == os.getpid() and row[LENGTH] == 3
    for whole in (False, True):
        with pytest.raises(RuntimeError), e.locked(), e.transaction():
            with e.changing(row, foreign=True):
                row[FLAGS] |= LENT
            e.journal.spans_odd()  # (what a borrow does first: the mark is cleared only while spans change)
            row[LENGTH] = 4  # the holder's lock-free commit and release, meanwhile
            row[LEASE_PID] = 0
            if whole:
                with e.changing(row):
                    row[LENGTH] = 0
            raise RuntimeError("rolled back")
        assert not row[FLAGS] & LENT
        assert (int(row[LENGTH]), int(row[LEASE_PID])) == ((3, 0) if whole else (4, 0))
        row[LENGTH], row[LEASE_PID] = 3, pid  # (the test's own writes undone)


@pytest.mark.parametrize("point", ["copy_prefix.copied", "share.borrowed"])
def test_a_rolled_back_copy_prefix_of_this_process_drops_the_pending_tokens(make_store, point: str) -> None:
    """copy_prefix into an empty sequence writes its cells in place (or borrows over them); when
    it fails and rolls back, the row's words are as before but its cells are not: a write
    handle of this process with tokens pending there must drop them, never commit what the
    copy left (the review of this session: kept() took it for someone else's harmless change
    and committed the source's keys, or punched holes read as zeros)."""
    from shmkv._engine.locking import crash

    L, H, D = 2, 2, 64
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=8)
    u = store._engine.page_unit
    n = 2 * u
    rng = np.random.default_rng(9)
    src = store.create_sequence(capacity=n + 8, prefix=[1])
    ka = rng.standard_normal((L, n, H, D)).astype(np.float16)
    src.extend(ka, ka, tokens=rng.integers(0, 100, n))
    src.finish()
    b = store.create_sequence(capacity=n + 8, prefix=[2])
    kb = rng.standard_normal((u, H, D)).astype(np.float16)
    for layer in range(L):
        b.append(layer, kb, kb)  # pending
    crash.arm(point, RuntimeError("the copy fails"))
    try:
        with pytest.raises(RuntimeError, match="the copy fails"):
            store.copy_prefix(src.id, b.id, n)
    finally:
        crash.disarm()
    with pytest.raises(shmkv.InvalidArgumentError, match="no token is pending"):
        b.commit(tokens=list(range(u)))
    assert len(b) == 0
    for layer in range(L):  # what it appends now is what it reads
        b.append(layer, kb, kb)
    b.commit(tokens=list(range(u)))
    np.testing.assert_array_equal(b.keys(0), kb)
    np.testing.assert_array_equal(src.keys(1), ka[1])


def test_a_rollback_of_this_process_s_own_change_keeps_a_lease_released_meanwhile(make_store, monkeypatch) -> None:
    """A copy_prefix of this process into its own leased row (a whole change, not foreign) fails
    after the copy; just before, another of its threads released the lease (LEASE_PID zeroed
    without the lock). The rollback puts back the row but not the released lease: another
    attachment can take the sequence at once. (Before, the rollback restored the pid: the
    sequence stayed leased to a handle that had let it go, until this process exited.)"""
    import threading

    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=8)
    kv, toks = _kv(31, 40)
    src = _donor(store, kv, toks, 40, 64)
    dst = store.create_sequence(capacity=64)
    e = store._engine
    drow = e.row(e.slot_of(dst.id))
    seen: list[int] = []

    def release_in_another_thread() -> None:
        t = threading.Thread(target=dst.release)
        t.start()
        t.join(30)
        seen.append(int(drow[LEASE_PID]))

    monkeypatch.setattr(crash, "point", _raise_at("copy_prefix.copied", release_in_another_thread))
    with pytest.raises(RuntimeError, match=r"copy_prefix\.copied"):
        store.copy_prefix(src.id, dst.id, 20)
    monkeypatch.setattr(crash, "point", crash._noop)
    assert seen == [0], "the release this test is about did not happen"
    assert drow[LEASE_PID] == 0 and len(dst) == 0
    other = shmkv.attach(store.name)
    try:
        taken = other.sequence(dst.id, write=True)
        taken.extend(kv[:, :3], kv[:, :3])
        assert len(taken) == 3
    finally:
        other.close()


def _copy_release_and_die(name: str, src_id: int, at: Any, go: Any) -> None:  # a fork child
    s = shmkv.attach(name)
    dst = s.create_sequence(capacity=64)

    def release_then_die(point: str) -> None:
        if point == "copy_prefix.copied":  # its own change of its own leased row, in the log
            dst.release()  # (lock-free: LEASE_PID zeroed)
            at.put(dst.id)
            go.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)

    crash.point = release_then_die
    s.copy_prefix(src_id, dst.id, 20)
    os._exit(0)  # (not reached)


def test_a_reader_sees_a_lease_released_during_a_dead_process_s_own_change_as_released(make_store) -> None:
    """As above, with the process SIGKILLed inside its change: until someone rolls the change
    back, a read-only attachment's listing (the rows as the rollback leaves them:
    ``settled_row``) shows the lease released, as the rollback then leaves it."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=8)
    kv, toks = _kv(32, 40)
    src = _donor(store, kv, toks, 40, 64)
    ctx = mp.get_context("fork")
    at, go = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_copy_release_and_die, args=(store.name, src.id, at, go))
    child.start()
    try:
        dst_id = at.get(timeout=60)
    finally:
        let_go_and_reap(child, go)
    assert child.exitcode == -signal.SIGKILL
    e = store._engine
    assert e.hdr[_header.W_UNDO_COUNT] and e.row(e.slot_of(dst_id))[LEASE_PID] == 0  # still in the log
    ro = shmkv.attach(store.name, readonly=True)
    try:
        listed = {i.id: i for i in ro.sequences()}
        assert listed[dst_id].lease_pid == 0 and listed[dst_id].length == 0
    finally:
        ro.close()
    with store.transaction():  # the rollback: the same
        pass
    assert e.row(e.slot_of(dst_id))[LEASE_PID] == 0 and len(store.sequence(dst_id)) == 0
