"""seq.wait on a futex word (issue 24): woken by commit, truncate and free from other processes,
by close of its own handle, with and without a timeout, many waiters on one row, asyncio
cancellation; no wake-up syscall while nobody waits."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from _wait_children import wait_read_write
from conftest import START_METHODS

import shmkv
from shmkv._engine import futex as _futex
from shmkv.testing import start_in_process

pytestmark = pytest.mark.skipif(not _futex.AVAILABLE, reason="futex(2): Linux x86-64 only")


def one_token(layers: int = 2) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((layers, 1, 2, 4)), np.ones((layers, 1, 2, 4))


def until_waiters(store: shmkv.Store, slot: int, n: int, child=None, timeout: float = 120.0) -> None:
    """Until ``n`` waiters sleep on row ``slot`` (the shared count a registered waiter raises)."""
    t_end = time.monotonic() + timeout
    while store._engine.waiters[slot] != n:
        assert child is None or child.process.is_alive(), "the waiting child died"
        assert time.monotonic() < t_end, f"{store._engine.waiters[slot]} waiters, not {n}, after {timeout} s"
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


def test_many_waiters_on_one_row_all_wake_on_one_commit(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    slot = store._engine.slot_of(seq.id)
    children = [start_in_process(wait_read_write, store.name, seq.id, 1, 600.0, start_method="fork", timeout=180)
                for _ in range(3)]
    results: list[int] = []
    reader = store.sequence(seq.id)
    threads = [threading.Thread(target=lambda: results.append(reader.wait(1))) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        until_waiters(store, slot, 7)
        seq.extend(*one_token(), tokens=[1])
        got = [c.result() for c in children]
        for t in threads:
            t.join(60)
    finally:
        for c in children:
            c.kill()
    assert got == [("ok", 1)] * 3 and results == [1] * 4
    assert store._engine.waiters[slot] == 0


def test_wait_times_out_while_registered(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    with pytest.raises(shmkv.WaitTimeout, match=r"timeout=0\.05"):
        seq.wait(1, timeout=0.05)
    assert store._engine.waiters[store._engine.slot_of(seq.id)] == 0


def test_close_wakes_the_handles_own_waiters(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32", persistent=True)
    seq = store.create_sequence(capacity=8)
    slot = store._engine.slot_of(seq.id)
    other = shmkv.attach(store.name)
    try:
        reader = other.sequence(seq.id)
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                reader.wait(1)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        until_waiters(store, slot, 1)
        other.close()
        t.join(60)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], shmkv.StoreClosedError), errors
        assert store._engine.waiters[slot] == 0  # close took its waiter off the row
    finally:
        other.close()


def test_no_wake_up_syscall_while_nobody_waits(make_store, monkeypatch):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=16)
    calls: list[int] = []
    real = _futex.wake
    monkeypatch.setattr(_futex, "wake", lambda addr: calls.append(addr) or real(addr))
    for _ in range(3):
        seq.extend(*one_token())
    seq.truncate(1)
    assert calls == []
    reader = store.sequence(seq.id)
    t = threading.Thread(target=reader.wait, args=(3,))
    t.start()
    until_waiters(store, store._engine.slot_of(seq.id), 1)
    seq.extend(*one_token())
    seq.extend(*one_token())
    t.join(60)
    assert len(calls) >= 2  # a wake-up per commit while it slept


def test_wait_async_cancellation_ends_its_thread(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    slot = store._engine.slot_of(seq.id)
    reader = store.sequence(seq.id)

    async def main() -> None:
        task = asyncio.create_task(reader.wait_async(5))
        while store._engine.waiters[slot] != 1:  # the loop stays free while its thread sleeps
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = {t.name for t in threading.enumerate()}
    asyncio.run(asyncio.wait_for(main(), 120))
    t_end = time.monotonic() + 60
    while any(t.name.startswith("shmkv-wait") for t in threading.enumerate() if t.name not in before):
        assert time.monotonic() < t_end, "the waiting thread did not end after the cancellation"
        time.sleep(0.001)
    assert store._engine.waiters[slot] == 0
    seq.extend(*one_token())  # the row works on: no waiter left behind
    assert reader.wait(1, timeout=5) == 1
