"""A decode step is not lost when another request borrows from this one mid-step.

Borrowing from a live donor marks the donor's row (its LENT flag, a journaled change of the
donor's row made by the borrowing process). The donor's writer, between two layers' appends
of one step, must keep its pending tokens: found by the demo in a 64 MiB /dev/shm, where a
worker's commit raised 'layers have different pending token counts [0, 1, 1, 1]'.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import shmkv
from _share_scenes import L, borrow_and_die, kv_store, lent_in_a_full_store


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
def test_a_borrower_keeps_its_pending_tokens_when_its_donor_truncates_below_its_loans(make_store, dtype: str) -> None:
    """The donor truncates below the cells it lent in a full store (no range to move to): it
    keeps lending them (its next write moves it first), and its borrower's row is not touched.
    The borrower's writer, mid-step, keeps its pending tokens and its span (an attack on
    730ba4e found this step lost when the truncate still gave borrowers private copies)."""
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


@contextlib.contextmanager
def _lock_held_in_another_thread(store: shmkv.Store, then: Callable[[], None] | None = None) -> Iterator[None]:
    """The store lock held by another thread of this process for the ``with`` block (a lock
    holder, as another process would be); ``then()`` runs under it at the block's end, before
    the release."""
    inside, go = threading.Event(), threading.Event()

    def holder() -> None:
        with store.transaction():
            inside.set()
            assert go.wait(60)
            if then is not None:
                then()

    h = threading.Thread(target=holder)
    h.start()
    try:
        assert inside.wait(60)
        yield
    finally:
        go.set()
        h.join(timeout=60)
        assert not h.is_alive()


def test_a_commit_without_token_ids_flags_its_row_under_the_store_lock(make_store) -> None:
    """An id-less commit marks its row NOINDEX. FLAGS also holds LENT and STANDIN, which another
    process sets on this leased row under the store lock (a borrow from it, a copy of it): the
    writer's read-modify-write must wait for the lock, or it can write back flags without the
    other's bit (a donor that forgot it lent writes over its borrowers' cells)."""
    from shmkv._engine.table.header import FLAGS, LENT, NOINDEX

    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=256, max_seqs=4)
    seq = store.create_sequence(capacity=64)
    k = np.ones((2, 3, 2, 8), np.float32)
    seq.extend(k, k, tokens=[1, 2, 3])  # pages in place: the next commit needs nothing structural
    row = store._engine.row(store._engine.slot_of(seq.id))
    assert not row[FLAGS] & NOINDEX
    done: list[object] = []

    def commit() -> None:
        try:
            done.append(seq.extend(k[:, :1], k[:, :1]))  # no token ids
        except BaseException as e:
            done.append(e)

    def lend() -> None:  # what another process's borrow does: LENT set under the lock
        row[FLAGS] |= LENT

    c = threading.Thread(target=commit)
    with _lock_held_in_another_thread(store, then=lend):
        c.start()
        c.join(timeout=0.3)
        waited = c.is_alive()
    c.join(timeout=60)
    assert not c.is_alive()
    assert done and not isinstance(done[0], BaseException), done
    assert waited, "the id-less commit wrote FLAGS while another held the store lock"
    assert row[FLAGS] & NOINDEX and row[FLAGS] & LENT
    row[FLAGS] &= ~LENT  # (the test's own mark: nothing was lent)


def test_a_speculative_step_without_token_ids_takes_no_lock_to_commit(make_store) -> None:
    """A truncate keeps NOINDEX while its last kept token has no id (a decode without ids, as the
    Hugging Face adapter's, rolled back): the next id-less commit then flags nothing and takes no
    lock (it cost every speculative step a lock, 20% of truncate_step_us). A truncate back into
    tokens with ids clears it, and the next completed block is indexed again."""
    from shmkv._engine.table.header import FLAGS, NOINDEX

    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=256, max_seqs=4)
    seq = store.create_sequence(capacity=64)
    k = np.ones((2, 1, 2, 8), np.float32)
    ids = list(range(100, 120))
    for t in ids:
        seq.extend(k, k, tokens=[t])
    for _ in range(4):
        seq.extend(k, k)  # no ids: tokens 20..23
    row = store._engine.row(store._engine.slot_of(seq.id))
    assert row[FLAGS] & NOINDEX
    seq.truncate(22)
    assert row[FLAGS] & NOINDEX
    with _lock_held_in_another_thread(store):
        c = threading.Thread(target=lambda: seq.extend(k, k))
        c.start()
        c.join(timeout=30)
        assert not c.is_alive(), "an id-less commit after a speculative truncate waited for the store lock"
    assert len(seq) == 23 and row[FLAGS] & NOINDEX
    seq.truncate(20)  # back into tokens with ids: looked at again
    assert not row[FLAGS] & NOINDEX
    more = list(range(120, 132))
    seq.extend(np.ones((2, 12, 2, 8), np.float32), np.ones((2, 12, 2, 8), np.float32), tokens=more)
    assert store.match_prefix([*ids, *more, 7]) == 32


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
    back the donor's flags, never its length (the review of session 30: the whole row was put
    back and a returned commit, whose waiters were woken, was lost)."""
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


def test_a_borrower_that_saw_its_change_end_before_the_span_epoch_maps_again(make_store) -> None:
    """The end of a transaction makes its rows' generations even before the span epoch: a
    borrower's writer in another attachment can see the new generation while the epoch is still
    odd, when it cannot map yet. It must not keep that generation as mapped (review finding
    1c): it keeps none, and its next step maps the span as the table says. The change here is
    another attachment's change of the borrower's row (``changing(row, foreign=True)``, as a
    borrow marking a decoding donor LENT makes: since a donor's truncate no longer gives its
    borrowers private copies, the span itself is not what changes)."""
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
