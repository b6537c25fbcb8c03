"""A writer's decode step survives whatever another process does to its row or its donor's
meanwhile.

A borrow marks its live donor's row (its LENT flag: a change of another writer's row,
``changing(row, foreign=True)``, made by the borrowing process under the store lock). The
donor's writer, mid-step (some layers appended, or all, after a speculative rollback), keeps
its pending tokens and commits them; a commit that completes a block during the borrow is kept
and indexed; when the borrow is rolled back (an exception) or its process is SIGKILLed (another
process's recovery), the donor's commit stays. A borrower's step is kept likewise when its donor
goes below its loans (its span and the views its attachment took stay), when the donor moves
off them or dies moving or growing, and after a change of its row it saw end before the span
epoch did. A rolled-back copy_prefix into this process's own row drops the tokens pending
there rather than commit what the copy left.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import pytest
from _donor_scenes import (D, H, L, borrow_and_die, borrowers_decode_a_step, borrowers_hold_their_prefix, die_at,
                           expected_keys, holds_its_tokens, in_child, junk_kv, kv_store, lent_in_a_full_store,
                           let_go_and_reap, prefilled_donor, raise_at, row_of, seeded_kv, stuck, token_keys)

import shmkv
from shmkv._engine.locking import crash
from shmkv._engine.table.header import FLAGS, LENGTH, LENT, SPAN_CELLS, START
from shmkv.testing import unique_name


# -- a borrow from a donor mid-step -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_borrow_from_a_donor_mid_step_keeps_its_pending_tokens(make_store, dtype: str) -> None:
    L, H, D = 3, 2, 64
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=8)
    other = shmkv.attach(store.name)  # another attachment: what another process's borrow does
    try:
        u = store._engine.page_unit
        n = 3 * u
        rng = np.random.default_rng(1)
        kv = rng.standard_normal((L, n + 1, H, D)).astype(np.float32)
        toks = rng.integers(0, 30_000, n + 1)
        donor = store.create_sequence(capacity=n + 64, prefix=toks[:1])
        donor.extend(kv[:, :n], kv[:, :n], tokens=toks[:n])
        ref = [donor.keys(layer).copy() for layer in range(L)]
        donor.append(0, kv[0, n], kv[0, n])  # mid-step: layer 0 appended, the others not yet
        b = other.create_sequence(capacity=n + 64, prefix=toks[:n])
        assert other.stats().shared_tokens > 0, "the borrow this test is about did not happen"
        for layer in range(1, L):
            donor.append(layer, kv[layer, n], kv[layer, n])
        donor.commit(tokens=toks[n : n + 1])
        assert len(donor) == n + 1
        for layer in range(L):
            k = donor.keys(layer)
            np.testing.assert_array_equal(k[:n], ref[layer])
            np.testing.assert_array_equal(b.keys(layer)[:len(b)], ref[layer][:len(b)])
        if dtype == "float16":
            for layer in range(L):
                np.testing.assert_array_equal(donor.keys(layer)[n], kv[layer, n].astype(np.float16))
    finally:
        other.close()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_speculative_donor_keeps_its_step_when_borrowed_from_mid_step(make_store, dtype: str) -> None:
    """Speculative decoding: the donor rolls back two draft tokens (truncate), appends its next
    step on every layer, and another request borrows from it before the commit. The commit
    keeps the step (the handle's known length is the one after the truncate)."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=8)
    other = shmkv.attach(store.name)  # the requester's process
    try:
        n = 3 * store._engine.page_unit
        kv, toks = seeded_kv(19, n + 4)
        want = expected_keys(store, kv, n + 3)
        donor = prefilled_donor(store, kv, toks, n + 4, n + 64)
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


@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("appended_before", [1, L])
def test_a_rolled_back_borrow_keeps_the_donors_pending_step(make_store, monkeypatch, dtype: str,
                                                            appended_before: int) -> None:
    """The donor appended ``appended_before`` layers of its next token; another attachment's
    create borrows from it (LENT) and fails after the borrow; the donor then appends the other
    layers and commits: the step is there, with its token id and its values (the rollback
    moves the row's generation with LENT gone: the pending tokens are kept all the same)."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=8)
    other = shmkv.attach(store.name)  # the requester's process
    try:
        n = 3 * store._engine.page_unit
        kv, toks = seeded_kv(11, n + 1)
        want = expected_keys(store, kv, n + 1)
        donor = prefilled_donor(store, kv, toks, n, n + 64)
        drow = store._engine.row(store._engine.slot_of(donor.id))
        for layer in range(appended_before):
            donor.append(layer, kv[layer, n], kv[layer, n])
        seen: list[bool] = []
        monkeypatch.setattr(crash, "point", raise_at("create.copied", lambda: seen.append(bool(drow[FLAGS] & LENT))))
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


def _donor_mid_step(store: shmkv.Store, dtype_rng: int = 3):
    """A donor of 3 page units leased by ``store``'s attachment, one token appended to every
    layer and not yet committed (its commit will not complete a block: no lock needed)."""
    L, H, D = 3, 2, 64
    u = store._engine.page_unit
    n = 3 * u
    rng = np.random.default_rng(dtype_rng)
    kv = rng.standard_normal((L, n + 1, H, D)).astype(np.float32)
    toks = rng.integers(0, 30_000, n + 1)
    donor = store.create_sequence(capacity=n + 64, prefix=toks[:1])
    donor.extend(kv[:, :n], kv[:, :n], tokens=toks[:n])
    for layer in range(L):
        donor.append(layer, kv[layer, n], kv[layer, n])
    return donor, toks, n


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_rolled_back_borrow_keeps_the_donors_commit(make_store, dtype: str, monkeypatch) -> None:
    """Another attachment's create over a decoding donor marks the donor LENT inside its
    transaction; the donor's writer commits meanwhile (lock-free: its range and length stay).
    When that create then fails and rolls back, the donor's commit stays: the rollback puts
    back the donor's flags, never its length (a returned commit, whose waiters were woken,
    stays)."""
    from shmkv._engine.locking import crash
    from shmkv._engine.table.header import FLAGS, LENT

    store = make_store(layers=3, kv_heads=2, head_dim=64, dtype=dtype, max_tokens=16384, max_seqs=8)
    other = shmkv.attach(store.name)  # the requester's process
    try:
        donor, toks, n = _donor_mid_step(store)
        drow = store._engine.row(store._engine.slot_of(donor.id))
        seen: list[bool] = []

        def commit_then_fail(name: str) -> None:
            if name == "create.copied":
                seen.append(bool(drow[FLAGS] & LENT))
                assert donor.commit(tokens=toks[n : n + 1]) == n + 1
                raise RuntimeError("the request fails after its borrow")

        monkeypatch.setattr(crash, "point", commit_then_fail)
        with pytest.raises(RuntimeError, match="after its borrow"):
            other.create_sequence(capacity=n + 64, prefix=toks[:n])
        monkeypatch.setattr(crash, "point", crash._noop)
        assert seen == [True], "the borrow this test is about did not happen"
        assert not drow[FLAGS] & LENT  # the borrow itself was rolled back
        assert len(donor) == n + 1
        assert len(other.sequence(donor.id)) == n + 1
        assert other.sequences() and other.stats().shared_tokens == 0
        donor.extend(np.zeros((3, 1, 2, 64), np.float32), np.zeros((3, 1, 2, 64), np.float32))
        assert len(donor) == n + 2
    finally:
        other.close()


def test_a_borrower_killed_mid_transaction_keeps_the_donors_commit(make_store) -> None:
    """As test_a_rolled_back_borrow_keeps_the_donors_commit, with the requester SIGKILLed after
    its borrow: the recovery (another process's next lock) puts back the donor's flags only."""
    import multiprocessing as mp

    from shmkv._engine.table.header import FLAGS, LENT

    store = make_store(layers=3, kv_heads=2, head_dim=64, dtype="float16", max_tokens=16384, max_seqs=8)
    donor, toks, n = _donor_mid_step(store, 5)
    drow = store._engine.row(store._engine.slot_of(donor.id))
    ctx = mp.get_context("fork")
    at, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=borrow_and_die, args=(store.name, toks[:n].tolist(), n + 64, at, go))
    child.start()
    try:
        assert at.wait(60), "the child never reached its borrow"
        assert drow[FLAGS] & LENT  # borrowed, its transaction open
        assert donor.commit(tokens=toks[n : n + 1]) == n + 1
    finally:
        go.set()
        child.join(60)
    assert child.exitcode == -9
    ro = shmkv.attach(store.name, readonly=True)  # reads rows as the rollback will leave them
    try:
        assert len(ro.sequence(donor.id)) == n + 1
        assert [s.length for s in ro.sequences() if s.id == donor.id] == [n + 1]
    finally:
        ro.close()
    with store.transaction():  # the lock: the dead requester's transaction is rolled back first
        pass
    assert store.stats().shared_tokens == 0 and store.stats().sequences == 1
    assert not drow[FLAGS] & LENT
    assert len(donor) == n + 1 and len(shmkv.attach(store.name).sequence(donor.id)) == n + 1


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
    kv, toks = seeded_kv(14, n + 17)
    want = expected_keys(store, kv, n + 16)
    donor = prefilled_donor(store, kv, toks, n, n + 64)
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


@pytest.mark.parametrize("point", ["copy_prefix.copied", "share.borrowed"])
def test_a_rolled_back_copy_prefix_of_this_process_drops_the_pending_tokens(make_store, point: str) -> None:
    """copy_prefix into an empty sequence writes its cells in place (or borrows over them); when
    it fails and rolls back, the row's words are as before but its cells are not: a write
    handle of this process with tokens pending there must drop them, never commit what the
    copy left (the source's keys, or punched holes read as zeros)."""
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


# -- a borrower mid-step while its donor goes below its loans, moves or dies ------------------------------


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_borrower_keeps_its_pending_tokens_when_its_donor_truncates_below_its_loans(make_store, dtype: str) -> None:
    """The donor truncates below the cells it lent in a full store (no range to move to): it
    keeps lending them (its next write moves it first), and its borrower's row is not touched.
    The borrower's writer, mid-step, keeps its pending tokens and its span."""
    store = kv_store(make_store, dtype)
    other = shmkv.attach(store.name)  # the donor's process
    try:
        s = lent_in_a_full_store(store, other, 2)
        b, n, m, kv = s.borrowers[0], s.n, s.m, s.kv
        spans = s.spans(store)
        b.append(0, kv[0, m : n + 1], kv[0, m : n + 1])  # mid-step
        s.donor.truncate(1)  # below every lent cell
        assert s.spans(store) == spans
        for layer in range(1, L):
            b.append(layer, kv[layer, m : n + 1], kv[layer, m : n + 1])
        assert b.commit(tokens=s.toks[m : n + 1]) == n + 1
        for layer in range(L):
            np.testing.assert_array_equal(b.keys(layer), s.want[layer][: n + 1])
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


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_donor_below_its_loans_in_a_full_store_leaves_its_decoding_borrowers_alone(make_store, dtype: str) -> None:
    """The donor (another attachment) truncates below what it lent to two decoding borrowers,
    in a store with no free range. The truncate succeeds and changes neither borrower (their
    spans, pending steps and views stay); the donor's next append and extend raise
    CacheFullError, naming the loan, with nothing written; once a range is free, its extend
    moves it there and writes, and the borrowers still read their prefix."""
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
        junk = junk_kv(n)
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


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_borrowers_views_taken_mid_step_keep_its_prefix_when_its_donor_writes(make_store, dtype: str) -> None:
    """The borrower appended layer 0 of its step (the views attention runs on); then its donor
    truncates in a full store and tries to write into the cells it had lent: by append, by
    extend, and through a handle another attachment takes over the lease with. Each raises
    CacheFullError, and the borrower's views still show its prefix (attention of a step whose
    commit succeeds runs on them)."""
    store = kv_store(make_store, dtype)
    other = shmkv.attach(store.name)  # the donor's process
    third = shmkv.attach(store.name)
    try:
        s = lent_in_a_full_store(store, other, 17)
        b, m, n, kv = s.borrowers[0], s.m, s.n, s.kv
        k, _ = b.append(0, kv[0, m:], kv[0, m:])  # mid-step: attention of layer 0 runs on k
        want = np.asarray(k[:m]).copy()
        s.donor.truncate(1)
        junk = junk_kv(n - 1)
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


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_rolled_back_move_off_the_loans_keeps_the_borrowers_commit(make_store, dtype: str, monkeypatch) -> None:
    """The donor, below what it lent, moves to a freed range before its next write (its own
    row's change); its borrower commits meanwhile. When the move fails and rolls back, the
    borrower's commit stays, the donor stays where it was, still lending, and its next extend
    moves it."""
    from shmkv._engine.locking import crash
    from shmkv._engine.table.header import FLAGS, LENT, START

    store = kv_store(make_store, dtype)
    other = shmkv.attach(store.name)  # the donor's process
    try:
        s = lent_in_a_full_store(store, other, 4)
        b, n, m, kv = s.borrowers[0], s.n, s.m, s.kv
        for layer in range(L):
            b.append(layer, kv[layer, m : n + 1], kv[layer, m : n + 1])
        s.donor.truncate(1)
        s.free_a_filler(other)
        drow = other._engine.row(other._engine.slot_of(s.donor.id))
        start = drow[START]
        seen: list[int] = []

        def commit_then_fail(name: str) -> None:
            if name == "share.moved":
                seen.append(b.commit(tokens=s.toks[m : n + 1]))
                raise RuntimeError("the move fails after the copy")

        junk = np.ones((L, 5, 2, 64), np.float32)
        monkeypatch.setattr(crash, "point", commit_then_fail)
        with pytest.raises(RuntimeError, match="after the copy"):
            s.donor.extend(junk, junk)
        monkeypatch.setattr(crash, "point", crash._noop)
        assert seen == [n + 1], "the move this test is about did not happen"
        assert len(s.donor) == 1 and drow[START] == start and drow[FLAGS] & LENT
        assert len(b) == n + 1 and len(other.sequence(b.id)) == n + 1
        for layer in range(L):
            np.testing.assert_array_equal(b.keys(layer), s.want[layer][: n + 1])
        assert s.donor.extend(junk, junk) == 6 and drow[START] != start
        for layer in range(L):
            np.testing.assert_array_equal(b.keys(layer), s.want[layer][: n + 1])
    finally:
        other.close()


def _extend_and_die(name: str, donor_id: int, n: int, at: Any, go: Any) -> None:  # a child: the donor's process
    s = shmkv.attach(name)
    donor = s.sequence(donor_id, write=True)
    die_at("share.moved", at, go)  # its cells copied to the fresh range, the row not yet switched
    donor.extend(junk_kv(n), junk_kv(n))
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
        seen = in_child(ctx, _inspect, store.name, [b.id for b in s.borrowers])  # the dead move still in the log
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
        assert donor.extend(junk_kv(n), junk_kv(n)) == n + 1 and drow[START] != start
        for b in s.borrowers:
            for layer in range(L):
                np.testing.assert_array_equal(b.keys(layer), s.want[layer])
    finally:
        other.close()


def _grow_and_die(name: str, donor_id: int, n: int, point: str, events: tuple[Any, Any]) -> None:  # a child
    """The stuck donor's process: takes its lease, appends past its capacity (a growth that
    moves it) and is SIGKILLed at ``point``, after ``events`` (at, go) with the parent."""
    import os

    st = shmkv.attach(name)
    donor = st.sequence(donor_id, write=True)
    die_at(point, *events)
    k = junk_kv(n)
    donor.append(0, k[0], k[0])
    os._exit(0)  # (not reached)


@pytest.mark.parametrize("point", ["grow.copied", "grow.switched"])
def test_a_stuck_donor_killed_growing_off_its_loans_leaves_its_borrowers_steps(make_store, point: str) -> None:
    """The stuck donor's process (a forked child that took its lease) appends past its
    capacity once a range is free: the growth moves it, and the process is SIGKILLed at
    ``point``. Its borrowers commit meanwhile. The next lock entry rolls the growth back (the
    donor where it was, one token, still lending); the borrowers decode on, and the donor's
    next writer grows it and writes."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=12)
    other = shmkv.attach(store.name)
    ctx = mp.get_context("fork")
    at, go = ctx.Event(), ctx.Event()
    child = None
    try:
        s = stuck(store, other, 50, borrowers=2)
        m = s.m
        for b in s.borrowers:
            for layer in range(L):
                b.append(layer, s.kv[layer, m], s.kv[layer, m])
        cap = s.donor.capacity
        s.donor.release()
        s.free_a_filler(other)
        drow = row_of(store, s.donor.id)
        start = drow[START]
        child = ctx.Process(target=_grow_and_die, args=(store.name, s.donor.id, cap + 10, point, (at, go)))
        child.start()
        assert at.wait(120), "the donor's process never reached its growth"
        for b in s.borrowers:
            assert b.commit(tokens=s.toks[m : m + 1]) == m + 1
        go.set()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        with store.transaction():  # the dead growth rolled back
            pass
        assert drow[START] == start and drow[FLAGS] & LENT and drow[LENGTH] == 1 and s.donor.capacity == cap
        borrowers_hold_their_prefix(s, store)
        donor = store.sequence(s.donor.id, write=True)
        k = junk_kv(cap + 10)
        for layer in range(L):
            donor.append(layer, k[layer], k[layer])
        assert donor.commit() == cap + 11 and drow[START] != start
        np.testing.assert_array_equal(donor.keys(0)[1:], 7.0)
        borrowers_hold_their_prefix(s, store)
        borrowers_decode_a_step(s)
        borrowers_hold_their_prefix(s, store)
    finally:
        let_go_and_reap(child, go)
        other.close()


def _borrow_and_decode(name: str, prompt: np.ndarray, ready: Any, go: Any, out: Any) -> None:  # a child
    """A borrower in its own process: reuses ``prompt``'s prefix, appends layer 0 of its next
    token (the view attention runs on), waits while the donor goes below its loans and moves,
    then checks that view, finishes the step and reads its keys back."""
    try:
        st = shmkv.attach(name)
        try:
            b = st.create_sequence(capacity=len(prompt) + 64, prefix=prompt)
            m = len(b)
            e = st._engine
            span = int(e.row(e.slot_of(b.id))[SPAN_CELLS])
            nxt = token_keys(prompt[m : m + 1])
            k, _ = b.append(0, nxt, nxt)
            ready.set()
            if not go.wait(60):
                raise TimeoutError("the parent never said go")
            view_ok = bool(np.array_equal(np.asarray(k[:m], np.float32), token_keys(prompt[:m])))
            for layer in range(1, L):
                b.append(layer, nxt, nxt)
            n = b.commit(tokens=prompt[m : m + 1])
            holds_its_tokens(b)
            out.put((m, span, view_ok, n, b.id))
        finally:
            st.close()
    except BaseException as e:
        ready.set()
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_borrower_in_another_process_decodes_while_its_donor_is_stuck_then_moves(make_store, method: str) -> None:
    """The borrower is another process (``method``), mid-step with a view of its prefix. The
    donor (this process) truncates below what it lent in a full store, fails to write, moves
    once a range is freed and writes; a new sequence fills the rest. The child's view still
    shows its prefix, its step commits, its keys are its tokens'."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=12)
    other = shmkv.attach(store.name)  # the donor's attachment
    ctx = mp.get_context(method)
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = None
    try:
        n = 3 * store._engine.page_unit
        toks = np.arange(5000, 5000 + n + 4)
        donor = other.create_sequence(capacity=n + 64, prefix=toks[:1])
        kv = token_keys(toks[:n])[None].repeat(L, 0)
        donor.extend(kv, kv, tokens=toks[:n])
        donor.finish()
        donor = other.sequence(donor.id, write=True)
        child = ctx.Process(target=_borrow_and_decode, args=(store.name, toks[: n + 1], ready, go, out))
        child.start()
        assert ready.wait(120), "the borrower never got going"
        fillers = [other.create_sequence(capacity=64)]
        while other.stats().largest_free_range:
            fillers.append(other.create_sequence(capacity=other.stats().largest_free_range))
        donor.truncate(1)
        junk = junk_kv(40)
        with pytest.raises(shmkv.CacheFullError):
            donor.extend(junk, junk)
        max(fillers[1:], key=lambda f: f.capacity).free()
        drow = row_of(other, donor.id)
        start = drow[START]
        assert donor.extend(junk, junk) == 41 and drow[START] != start
        while room := store.stats().largest_free_range:
            store.create_sequence(capacity=room).extend(junk_kv(room, 5.0), junk_kv(room, 5.0))
        go.set()
        got = out.get(timeout=120)
        assert not isinstance(got, str), got
        child.join(60)
        assert child.exitcode == 0
        m, span, view_ok, length, bid = got
        assert span > 0, "the borrow this test is about did not happen"
        assert view_ok, "the borrower's view of its prefix changed while its donor wrote"
        assert length == m + 1
        holds_its_tokens(store.sequence(bid))
        np.testing.assert_array_equal(donor.keys(0)[1:], 7.0)
    finally:
        let_go_and_reap(child, go)
        other.close()


def test_a_borrower_that_saw_its_change_end_before_the_span_epoch_maps_again(make_store) -> None:
    """The end of a transaction makes its rows' generations even before the span epoch: a
    borrower's writer in another attachment can see the new generation while the epoch is still
    odd, when it cannot map yet. It must not keep that generation as mapped: it keeps none, and
    its next step maps the span as the table says. The change here is another attachment's
    change of the borrower's row (``changing(row, foreign=True)``, as a borrow marking a decoding
    donor LENT makes: a donor's truncate leaves its borrowers' spans as they are, so the span
    itself is not what changes)."""
    from shmkv._engine.table.header import GEN, W_SPANS

    store = make_store(layers=3, kv_heads=2, head_dim=64, dtype="float16", max_tokens=4096, max_seqs=8)
    other = shmkv.attach(store.name)  # the donor's process
    try:
        u = store._engine.page_unit
        n = 4 * u
        rng = np.random.default_rng(6)
        kv = rng.standard_normal((3, n + 2, 2, 64)).astype(np.float32)
        toks = rng.integers(0, 30_000, n + 2)
        donor = other.create_sequence(capacity=n + 64, prefix=toks[:1])
        donor.extend(kv[:, :n], kv[:, :n], tokens=toks[:n])
        donor.finish()
        b = store.create_sequence(capacity=n + 64, prefix=toks[:n])
        assert store.stats().shared_tokens > 0, "the borrow this test is about did not happen"
        m = len(b)
        ref = [b.keys(layer).copy() for layer in range(3)]
        b.append(0, kv[0, m], kv[0, m])  # mid-step
        e = other._engine
        with e.locked(), e.changing(e.row(e.slot_of(b.id)), foreign=True):
            pass  # another attachment's change of b's row: its span epoch moves (b borrows)
        hdr = store._engine.hdr
        hdr[W_SPANS] += 1  # as if that transaction's rows were even and its epoch not yet
        try:
            b.append(1, kv[1, m], kv[1, m])  # need_writer: kept, but nothing can be mapped now
            assert b._w.gen == -1, "a generation kept as mapped while nothing could be mapped"
        finally:
            hdr[W_SPANS] -= 1  # the epoch's end
        views = [b.append(2, kv[2, m], kv[2, m])[0]]
        brow = store._engine.row(store._engine.slot_of(b.id))
        assert b._w.gen == brow[GEN]  # mapped again
        assert b.commit(tokens=toks[m : m + 1]) == m + 1
        np.testing.assert_array_equal(views[0][:m], ref[2])
        for layer in range(3):
            np.testing.assert_array_equal(b.keys(layer)[:m], ref[layer])
    finally:
        other.close()
