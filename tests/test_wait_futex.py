"""seq.wait on a futex word: woken by commit, truncate and free from other processes,
by close of its own handle, with and without a timeout, many waiters on one row, asyncio
cancellation; no wake-up syscall while nobody waits."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from procs.wait import close_or_remove, wait_read_write
from conftest import START_METHODS

import shmkv
from shmkv._engine.clients import futex as _futex
from shmkv.testing import start_in_process

pytestmark = pytest.mark.skipif(not _futex.AVAILABLE, reason="futex(2): Linux x86-64 only")


def one_token(layers: int = 2) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((layers, 1, 2, 4)), np.ones((layers, 1, 2, 4))


def until_waiters(store: shmkv.Store, slot: int, n: int, child=None, timeout: float = 120.0, *,
                  readonly: int = 0) -> None:
    """Until ``n`` waiters of read-write attachments (and ``readonly`` of read-only ones: their
    count in the liveness file) sleep on row ``slot`` (the shared counts a registered waiter raises)."""
    t_end = time.monotonic() + timeout
    while store._engine.waiters[slot] != n or store._engine.ro_waiters.counts[slot] != readonly:
        assert child is None or child.process.is_alive(), "the waiting child died"
        e = store._engine
        assert time.monotonic() < t_end, (f"{e.waiters[slot]} + {e.ro_waiters.counts[slot]} read-only "
                                          f"waiters, not {n} + {readonly}, after {timeout} s")
        time.sleep(0.001)


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("event", ["commit", "truncate", "free"])
@pytest.mark.parametrize("timeout", [None, 600.0])
def test_a_waiter_in_another_process_is_woken(make_store, method, event, timeout):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    seq.extend(*one_token(), tokens=[1])
    slot = store._engine.slot_of(seq.id)
    length = None if event == "truncate" else 2  # truncate: a wait for any change
    child = start_in_process(wait_read_write, store.name, seq.id, length, timeout, start_method=method, timeout=180)
    try:
        until_waiters(store, slot, 1, child)
        if event == "commit":
            seq.extend(*one_token(), tokens=[2])
        elif event == "truncate":
            seq.truncate(0)
        else:
            seq.free()
        got = child.result()
    finally:
        child.kill()
    want = {"commit": ("ok", 2), "truncate": ("ok", 0), "free": ("error", "SequenceNotFound")}[event]
    assert got == want
    assert store._engine.waiters[slot] == 0  # the waiter took itself off the count


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("event", ["commit", "truncate", "free"])
def test_a_read_only_waiter_in_another_process_is_counted_and_woken(make_store, method, event):
    """A read-only attachment cannot write its mapping: it counts itself in the liveness file
    (atomically), so a commit or a structural change wakes it as it wakes read-write waiters."""
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    seq.extend(*one_token(), tokens=[1])
    slot = store._engine.slot_of(seq.id)
    length = None if event == "truncate" else 2
    child = start_in_process(wait_read_write, store.name, seq.id, length, 600.0, True, start_method=method,
                             timeout=180)
    try:
        until_waiters(store, slot, 0, child, readonly=1)
        if event == "commit":
            seq.extend(*one_token(), tokens=[2])
        elif event == "truncate":
            seq.truncate(0)
        else:
            seq.free()
        got = child.result()
    finally:
        child.kill()
    assert got == {"commit": ("ok", 2), "truncate": ("ok", 0), "free": ("error", "SequenceNotFound")}[event]
    assert store._engine.ro_waiters.counts[slot] == 0 and store._engine.waiters[slot] == 0


def test_many_waiters_on_one_row_all_wake_on_one_commit(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    slot = store._engine.slot_of(seq.id)
    children = [start_in_process(wait_read_write, store.name, seq.id, 1, 600.0, ro, start_method="fork", timeout=180)
                for ro in (False, False, False, True, True)]
    results: list[int] = []
    reader = store.sequence(seq.id)
    ro_store = shmkv.attach(store.name, readonly=True)
    ro_reader = ro_store.sequence(seq.id)
    threads = [threading.Thread(target=lambda r=r: results.append(r.wait(1)))
               for r in (reader, reader, reader, reader, ro_reader, ro_reader)]
    try:
        for t in threads:
            t.start()
        until_waiters(store, slot, 7, readonly=4)
        seq.extend(*one_token(), tokens=[1])
        got = [c.result() for c in children]
        for t in threads:
            t.join(60)
    finally:
        for c in children:
            c.kill()
        ro_store.close()
    assert got == [("ok", 1)] * 5 and results == [1] * 6
    assert store._engine.waiters[slot] == 0 and store._engine.ro_waiters.counts[slot] == 0


def test_wait_times_out_while_registered(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    with pytest.raises(shmkv.WaitTimeout, match=r"timeout=0\.05"):
        seq.wait(1, timeout=0.05)
    assert store._engine.waiters[store._engine.slot_of(seq.id)] == 0


@pytest.mark.parametrize("readonly", [False, True])
def test_close_wakes_the_handles_own_waiters(make_store, readonly):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32", persistent=True)
    seq = store.create_sequence(capacity=8)
    slot = store._engine.slot_of(seq.id)
    other = shmkv.attach(store.name, readonly=readonly)
    try:
        reader = other.sequence(seq.id)
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                reader.wait(1)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=waiter) for _ in range(2)]
        for t in threads:
            t.start()
        until_waiters(store, slot, 0 if readonly else 2, readonly=2 if readonly else 0)
        other.close()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert len(errors) == 2 and all(isinstance(e, shmkv.StoreClosedError) for e in errors), errors
        e = store._engine
        assert e.waiters[slot] == 0 and e.ro_waiters.counts[slot] == 0  # close took them off the row
    finally:
        other.close()


@pytest.mark.slow
@pytest.mark.parametrize("what", ["close", "remove"])
@pytest.mark.parametrize("readonly", [False, True])
def test_a_close_or_removal_in_another_process_does_not_end_a_wait(make_store, what, readonly):
    """What another process does to its own attachment is its business: the store lives on in
    every attachment's mapping, even once removed by name (no new process can attach, the
    attached ones work on), so a wait goes on and the next commit ends it. A waiter that must
    give up passes a timeout; a waiter's own handle, closed, ends it (test above)."""
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32", persistent=True)
    seq = store.create_sequence(capacity=8)
    slot = store._engine.slot_of(seq.id)
    att = shmkv.attach(store.name, readonly=readonly)
    results: list[int] = []
    t = threading.Thread(target=lambda: results.append(att.sequence(seq.id).wait(1, timeout=600)))
    t.start()
    try:
        until_waiters(store, slot, 0 if readonly else 1, readonly=1 if readonly else 0)
        child = start_in_process(close_or_remove, store.name, what, start_method="spawn", timeout=180)
        assert child.result() == what
        assert t.is_alive() and not results  # still waiting, still counted
        assert store._engine.waiters[slot] + store._engine.ro_waiters.counts[slot] == 1
        seq.extend(*one_token())
        t.join(60)
        assert results == [1]
        assert store._engine.waiters[slot] + store._engine.ro_waiters.counts[slot] == 0
    finally:
        if t.is_alive():
            seq.extend(*one_token())
            t.join(60)
        att.close()
        if what == "remove":
            store.close()


@pytest.mark.parametrize("readonly", [False, True])
def test_no_wake_up_syscall_while_nobody_waits(make_store, monkeypatch, readonly):
    """Commits wake a counted waiter (read-write or read-only) with a syscall, and only then; the
    waiter sleeps in long futex waits, never in a polling loop of short ones."""
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=16)
    calls: list[int] = []
    sleeps: list[float | None] = []
    real_wake, real_wait = _futex.wake, _futex.wait
    monkeypatch.setattr(_futex, "wake", lambda addr: calls.append(addr) or real_wake(addr))
    asleep = threading.Event()  # the waiter is in a futex wait (counted is not enough: it may not sleep yet)
    monkeypatch.setattr(_futex, "wait",
                        lambda addr, v, t: sleeps.append(t) or asleep.set() or real_wait(addr, v, t))
    for _ in range(3):
        seq.extend(*one_token())
    seq.truncate(1)
    assert calls == []
    att = shmkv.attach(store.name, readonly=True) if readonly else store
    try:
        reader = att.sequence(seq.id)
        t = threading.Thread(target=reader.wait, args=(3,))
        t.start()
        until_waiters(store, store._engine.slot_of(seq.id), 0 if readonly else 1, readonly=int(readonly))
        assert asleep.wait(30)
        seq.extend(*one_token())
        seq.extend(*one_token())
        t.join(60)
        assert not t.is_alive()
    finally:
        if readonly:
            att.close()
    assert len(calls) >= 2  # a wake-up per commit while it slept
    assert sleeps and all(s is None or s >= 1.0 for s in sleeps), sleeps  # woken, not polling


@pytest.mark.parametrize("readonly", [False, True])
def test_wait_async_cancellation_ends_its_thread(make_store, readonly):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    slot = store._engine.slot_of(seq.id)
    att = shmkv.attach(store.name, readonly=True) if readonly else store
    reader = att.sequence(seq.id)
    counts = store._engine.ro_waiters.counts if readonly else store._engine.waiters

    async def main() -> None:
        task = asyncio.create_task(reader.wait_async(5))
        while counts[slot] != 1:  # the loop stays free while its thread sleeps
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = {t.name for t in threading.enumerate()}
    try:
        asyncio.run(asyncio.wait_for(main(), 120))
        t_end = time.monotonic() + 60
        while any(t.name.startswith("shmkv-wait") for t in threading.enumerate() if t.name not in before):
            assert time.monotonic() < t_end, "the waiting thread did not end after the cancellation"
            time.sleep(0.001)
        assert counts[slot] == 0
        assert store._engine.waiters[slot] == 0
        seq.extend(*one_token())  # the row works on: no waiter left behind
        assert reader.wait(1, timeout=5) == 1
    finally:
        if readonly:
            att.close()
