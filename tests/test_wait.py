"""seq.wait / seq.wait_async: waiting for another process's tokens."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest
from procs.wait import wait_for_commit
from conftest import START_METHODS

import shmkv
from shmkv._engine.clients import futex as _futex
from shmkv.testing import start_in_process


def one_token(layers: int = 2) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((layers, 1, 2, 4)), np.ones((layers, 1, 2, 4))


def until_waiting(store: shmkv.Store, seq_id: int, timeout: float = 120.0) -> None:
    """Until a wait of this process on ``seq_id`` took its first look and counts itself (a change
    before that look is not one it waits for: wait() for any change compares with that look)."""
    e = store._engine
    slot = e.slot_of(seq_id)
    t_end = time.monotonic() + timeout
    while not e.waiting.get(slot, 0):
        assert time.monotonic() < t_end, f"no wait on sequence {seq_id} began within {timeout} s"
        time.sleep(0.001)


def wait_for_file(path: str, child, timeout: float = 120.0) -> None:
    """Readiness through a file the child writes; fails at once if the child died."""
    t_end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert child.process.is_alive() or os.path.exists(path), "the child died before it was ready"
        assert time.monotonic() < t_end, f"the child did not become ready within {timeout} s"
        time.sleep(0.002)


@pytest.mark.parametrize("method", START_METHODS)
def test_wait_wakes_soon_after_a_commit_in_another_process(make_store, tmp_path, method):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    seq = store.create_sequence(capacity=8)
    ready = str(tmp_path / "ready")
    child = start_in_process(wait_for_commit, store.name, seq.id, ready, start_method=method, timeout=180)
    try:
        wait_for_file(ready, child)
        time.sleep(0.05)  # not synchronisation: lets the waiter reach its sleeping phase first
        committed_ns = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process
        seq.extend(*one_token(), tokens=[7])
        n, woke_ns, sleeps = child.result()
    finally:
        child.kill()
    assert n == 1
    assert woke_ns >= committed_ns  # it did not return before the commit
    # woken by the commit (how soon: tools/bench.py, wait_wakeup_us), not at the end of a sleep: a
    # counted waiter sleeps in long futex waits, and the one its wait ended on (if the commit did
    # not come before its first) did not time out (not a wall-clock bound: a loaded
    # machine may leave the child unscheduled for longer than any bound)
    if _futex.AVAILABLE:
        assert all(t is None or t >= 1.0 for t, _ in sleeps), sleeps
        assert not sleeps or sleeps[-1][1], f"the wait ended on a futex wait that timed out: {sleeps}"


def test_wait_returns_at_once_when_the_length_is_reached(store):
    seq = store.create_sequence(capacity=8)
    seq.extend(*one_token(store.layout.layers), tokens=[1])
    assert seq.wait(1, timeout=0) == 1
    assert seq.wait(0) == 1


def test_wait_for_any_change_sees_a_truncate(store):
    seq = store.create_sequence(capacity=8)
    seq.extend(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)))
    reader = store.sequence(seq.id)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(reader.wait(timeout=60)))
    t.start()
    until_waiting(store, seq.id)
    seq.truncate(1)
    t.join(90)
    assert got == [1]


def test_wait_times_out_with_a_clear_error(shmkv_store_factory):
    store = shmkv_store_factory(layers=2, kv_heads=2, head_dim=4)
    seq = store.create_sequence(capacity=8)
    ro = shmkv.attach(store.name, readonly=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(shmkv.WaitTimeout) as e:
            ro.sequence(seq.id).wait(5, timeout=0.05)
        assert time.monotonic() - t0 >= 0.05
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, shmkv.ShmkvError)
        assert "length 5" in str(e.value) and "timeout=0.05" in str(e.value)
        with pytest.raises(shmkv.WaitTimeout, match="a change from length 0"):
            ro.sequence(seq.id).wait(timeout=0.01)
    finally:
        ro.close()


def test_wait_raises_when_the_sequence_is_freed(store):
    seq = store.create_sequence(capacity=8)
    reader = store.sequence(seq.id)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            reader.wait(10, timeout=60)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    until_waiting(store, seq.id)  # freed during the wait (freed before it, its first look raises)
    seq.free()
    t.join(90)
    assert len(errors) == 1 and isinstance(errors[0], shmkv.SequenceNotFound), errors


@pytest.mark.parametrize("bad", [{"length": -1}, {"length": 1.5}, {"timeout": -1}, {"timeout": "1"}])
def test_wait_refuses_bad_arguments(store, bad):
    seq = store.create_sequence(capacity=8)
    with pytest.raises(shmkv.InvalidArgumentError):
        seq.wait(**{"length": 1, "timeout": 0, **bad})


def test_wait_async_does_not_block_the_event_loop(store):
    seq = store.create_sequence(capacity=8)
    reader = store.sequence(seq.id)

    async def main() -> tuple[int, int]:
        async def writer() -> None:
            for i in range(2):
                await asyncio.sleep(0.01)
                seq.extend(*one_token(store.layout.layers), tokens=[i])  # runs only if the loop is free

        w = asyncio.create_task(writer())
        n = await reader.wait_async(2, timeout=60)
        await w
        with pytest.raises(shmkv.WaitTimeout):
            await reader.wait_async(3, timeout=0.02)
        return n, len(reader)

    assert asyncio.run(main()) == (2, 2)
