"""What a lease holder writes without the store lock stays, whatever a transaction that changed
its row meanwhile does (journal invariant 10).

The holder's lock-free words are LENGTH (a commit) and LEASE_PID (a release). A transaction that
changed the row as another writer's (a borrow marking its donor LENT: ``changing(row,
foreign=True)``) and is rolled back, by an exception or by another process's recovery after a
SIGKILL, puts back its own words only: a released lease stays released, and readers meanwhile
(a read-only attachment's listing) see the rows as the rollback leaves them. A rollback of a
whole change of this process's own row puts back every word but a release of the lease. FLAGS,
which others change under the lock, is written by the holder under the lock too (an id-less
commit marking NOINDEX), and a speculative id-less step that marks nothing takes no lock.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _donor_scenes import (D, H, L, borrow_and_die, expected_keys, in_child, let_go_and_reap, prefilled_donor,
                           raise_at, seeded_kv)

import shmkv
from shmkv._engine.locking import crash
from shmkv._engine.table import header as _header
from shmkv._engine.table.header import FLAGS, LEASE_PID, LENT


# -- a lease released during a rolled-back borrow stays released ----------------------------


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
        kv, toks = seeded_kv(12, n)
        donor = prefilled_donor(store, kv, toks, n, n + 64)
        monkeypatch.setattr(crash, "point", raise_at("create.copied", donor.release))
        with pytest.raises(RuntimeError, match=r"create\.copied"):
            other.create_sequence(capacity=n + 64, prefix=toks[:n])
        monkeypatch.setattr(crash, "point", crash._noop)
        drow = store._engine.row(store._engine.slot_of(donor.id))
        assert drow[LEASE_PID] == 0
        assert [s.lease_pid for s in other.sequences() if s.id == donor.id] == [0]
        assert in_child(mp.get_context(method), _take_lease, store.name, donor.id) == "taken"
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
    kv, toks = seeded_kv(13, n + 1)
    want = expected_keys(store, kv, n + 1)
    donor = prefilled_donor(store, kv, toks, n, n + 64)
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
    assert in_child(ctx, _read_only_view, store.name, donor.id) == f"{n + 1} [({n + 1}, 0)]"
    assert in_child(ctx, _take_lease, store.name, donor.id) == "taken"  # (its lock entry recovers)
    assert not drow[FLAGS] & LENT and drow[LEASE_PID] == 0
    assert len(donor) == n + 1 and store.stats().sequences == 1
    for layer in range(L):
        np.testing.assert_array_equal(donor.keys(layer), want[layer])


# -- the journal's rule itself, and a rollback of this process's own change ------------------------------


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


def test_a_rollback_of_this_process_s_own_change_keeps_a_lease_released_meanwhile(make_store, monkeypatch) -> None:
    """A copy_prefix of this process into its own leased row (a whole change, not foreign) fails
    after the copy; just before, another of its threads released the lease (LEASE_PID zeroed
    without the lock). The rollback puts back the row but not the released lease: another
    attachment can take the sequence at once (not leased to a handle that let it go until this
    process exits)."""
    import threading

    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2048, max_seqs=8)
    kv, toks = seeded_kv(31, 40)
    src = prefilled_donor(store, kv, toks, 40, 64)
    dst = store.create_sequence(capacity=64)
    e = store._engine
    drow = e.row(e.slot_of(dst.id))
    seen: list[int] = []

    def release_in_another_thread() -> None:
        t = threading.Thread(target=dst.release)
        t.start()
        t.join(30)
        seen.append(int(drow[LEASE_PID]))

    monkeypatch.setattr(crash, "point", raise_at("copy_prefix.copied", release_in_another_thread))
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
    kv, toks = seeded_kv(32, 40)
    src = prefilled_donor(store, kv, toks, 40, 64)
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


# -- FLAGS: written under the store lock, and not at all by a speculative id-less step -------------------


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
