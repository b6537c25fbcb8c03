"""A child forked while another thread of the parent holds one of shmkv's process-wide locks
gets that lock free: the thread that holds it does not exist in the child, and a lock it
inherits held would hang the child's first use of it (inside the store lock, for the interval
lists: every other process's next structural operation then times out)."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pkgutil
import threading
import time

import numpy as np
import pytest
from procs.store_ops import use_after_the_creator_removed

import shmkv
from shmkv.testing import shm_entries

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def _process_locks() -> list[tuple[str, str, str]]:
    """(module, global, attribute or "") of every lock a module of shmkv keeps for the process:
    a global that is a lock, or a global object's ``lock`` attribute."""
    found = []
    for info in pkgutil.walk_packages(shmkv.__path__, "shmkv."):
        if info.name.startswith(("shmkv.cli", "shmkv.transformers", "shmkv.testing", "shmkv.__main__")):
            continue  # (programs and optional extras: no process-wide lock of the store's)
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, _LOCK_TYPES):
                found.append((info.name, name, ""))
            elif isinstance(getattr(value, "lock", None), _LOCK_TYPES) and not isinstance(value, type):
                found.append((info.name, name, "lock"))
    return sorted(set(found))


def _resolve(where: tuple[str, str, str]) -> object:
    module, name, attr = where
    value = getattr(importlib.import_module(module), name)
    return getattr(value, attr) if attr else value


def test_every_process_wide_lock_is_free_in_a_child_forked_while_a_thread_holds_it():
    locks = _process_locks()
    assert {("shmkv._engine.memory.intervals", "_LOCK", ""), ("shmkv._engine.clients.row_waiters", "LOCK", ""),
            ("shmkv._engine.memory.shm_room", "ROOM", "lock")} <= set(locks), locks  # (the walk finds them)
    for where in locks:
        lock = _resolve(where)
        held, done = threading.Event(), threading.Event()

        def hold(lock=lock, held=held, done=done) -> None:
            with lock:
                held.set()
                done.wait(30)

        t = threading.Thread(target=hold)
        t.start()
        try:
            assert held.wait(10)
            pid = os.fork()
            if pid == 0:  # the child: the lock, as its code would find it now, must be free
                code = 1
                try:
                    code = 0 if _resolve(where).acquire(timeout=5) else 3
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
        finally:
            done.set()
            t.join(10)
        assert os.waitstatus_to_exitcode(status) == 0, f"{where}: held in the forked child"


def test_a_child_forked_while_a_thread_of_the_parent_writes_runs_its_own_operations(make_store):
    """The parent's threads create, extend and free sequences while the parent forks; each
    child attaches and creates, extends and frees a sequence of its own within the timeout."""
    store = make_store(layers=2, kv_heads=2, head_dim=8, max_tokens=4096, max_seqs=64)
    stop = threading.Event()

    def busy() -> None:
        mine = shmkv.attach(store.name)
        try:
            while not stop.is_set():
                s = mine.create_sequence(capacity=16)
                s.extend(np.ones((2, 8, 2, 8)), np.ones((2, 8, 2, 8)))
                s.truncate(3)
                s.free()
        finally:
            mine.close()

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    child = shmkv.attach(store.name, lock_timeout=5)
                    s = child.create_sequence(capacity=8)
                    s.extend(np.ones((2, 4, 2, 8)), np.ones((2, 4, 2, 8)))
                    s.free()
                    child.close()
                    code = 0
                finally:
                    os._exit(code)
            deadline = time.monotonic() + 30
            while (got := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if got[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("a forked child hung in its first operations")
            assert os.waitstatus_to_exitcode(got[1]) == 0
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def test_a_forked_handle_of_a_removed_store_leaves_no_lock_file(make_store):
    """The creator forks a child with its handle, then closes it (the store is removed); the
    child still reads its mapping, its first structural operation says StoreNotFound, and no
    file of the store is made again (a lock file would outlive it, listed nowhere)."""
    ctx = mp.get_context("fork")
    store = make_store(layers=1, kv_heads=1, head_dim=2, max_tokens=64, max_seqs=2)
    seq = store.create_sequence(capacity=8)
    seq.extend(np.full((1, 2, 1, 2), 7.0), np.zeros((1, 2, 1, 2)))
    go, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=use_after_the_creator_removed, args=(store, seq.id, go, out))
    child.start()
    try:
        store.close()
        go.set()
        gone = {f for f in shm_entries() if store.name in f}
        got = out.get(timeout=30)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    assert got[0] == 7.0 and got[1].startswith("StoreNotFound: ") and "was removed" in got[1], got
    assert gone == set() and {f for f in shm_entries() if store.name in f} == set()
