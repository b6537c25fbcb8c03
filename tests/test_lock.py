"""The structural lock (flock behind a per-process RLock) and the lifecycle lock (docs/design.md §3)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

import shmkv
from shmkv._engine.locking import lifecycle_lock as _lifecycle_lock
from shmkv._engine.memory import segment as _segment
from shmkv.testing import ChildProcess, shm_entries, start_in_process, unique_name

START_METHODS = ["fork", "spawn", "forkserver"]


def wait_for(path: str, child: ChildProcess, timeout: float = 30.0) -> None:
    """Wait until ``child`` creates ``path``; re-raise the child's error if it ends first."""
    t_end = time.monotonic() + timeout
    while not os.path.exists(path):
        if not child.process.is_alive():
            child.result(5)  # raises what the child raised
        assert time.monotonic() < t_end, f"{path} did not appear within {timeout} s"
        time.sleep(0.005)


# -- functions run in child processes (module level: spawn imports them) -----------------------


def hold_lock(name: str, ready: str, readonly: bool = False) -> None:
    """Attach, take the structural lock, say so, and keep it until killed."""
    store = shmkv.attach(name, readonly=readonly)
    with store._engine._lock.held(shared=readonly):
        open(ready, "w").close()
        time.sleep(600)


def try_lock(name: str, timeout: float, shared: bool = False) -> str:
    """Attach read-only (no client registration, which takes the lock) and report whether the lock,
    exclusive or shared, came within ``timeout`` (flock needs no write access)."""
    store = shmkv.attach(name, readonly=True)
    try:
        with store._engine._lock.held(timeout, shared=shared):
            return "acquired"
    except shmkv.LockTimeout:
        return "timeout"
    finally:
        store.close()


def count_under_lock(name: str, path: str, n: int) -> None:
    """Increment the number in ``path`` n times, read and write apart, under the store lock."""
    store = shmkv.attach(name)
    for _ in range(n):
        with store.transaction():
            with open(path) as f:
                value = int(f.read())
            time.sleep(0)  # let another process run between the read and the write
            with open(path, "w") as f:
                f.write(str(value + 1))
    store.close()


def fork_then_die_holding(name: str, ready: str, child_pid_path: str) -> None:
    """Hold the lock, fork a child that outlives us without touching the lock, then wait to be killed."""
    store = shmkv.attach(name)
    with store.transaction():
        pid = os.fork()
        if pid == 0:  # the grandchild: inherited the descriptor, must not keep the lock alive
            try:
                time.sleep(600)
            finally:
                os._exit(0)
        with open(child_pid_path, "w") as f:
            f.write(str(pid))
        open(ready, "w").close()
        time.sleep(600)


# -- the structural lock -----------------------------------------------------------------------


@pytest.mark.parametrize("method", START_METHODS)
def test_sigkilled_holder_releases_the_lock(store, tmp_path, method):
    ready = str(tmp_path / "ready")
    child = start_in_process(hold_lock, store.name, ready, start_method=method, timeout=120)
    try:
        wait_for(ready, child)
        with pytest.raises(shmkv.LockTimeout):
            store._engine._lock.acquire(0.2)
        child.kill(signal.SIGKILL)
        with store._engine._lock.held(10.0):  # the kernel released the dead holder's flock
            assert store._engine._lock.is_held
    finally:
        child.kill()
    assert not store._engine._lock.is_held


def test_lock_timeout_is_raised_and_names_the_setting(store, tmp_path):
    ready = str(tmp_path / "ready")
    other = shmkv.attach(store.name, lock_timeout=0.3)  # before the child holds the lock: attach takes it
    child = start_in_process(hold_lock, store.name, ready, timeout=120)
    try:
        wait_for(ready, child)
        try:
            t0 = time.monotonic()
            with pytest.raises(shmkv.LockTimeout) as e, other.transaction():
                pass
            assert 0.25 <= time.monotonic() - t0 < 10
            assert isinstance(e.value, TimeoutError) and isinstance(e.value, shmkv.ShmkvError)
            assert "lock_timeout=" in str(e.value) and store.name in str(e.value)
            with pytest.raises(shmkv.LockTimeout):
                other.create_sequence(capacity=4)  # a structural operation waits no longer either
            with pytest.raises(shmkv.LockTimeout):
                other._engine._lock.acquire(0)  # zero: one try
        finally:
            child.kill()
            other.close()
    finally:
        child.kill()


def test_reentrant_within_a_thread_and_across_attachments(store):
    second = shmkv.attach(store.name)
    try:
        with store.transaction():
            with store.transaction():
                seq = store.create_sequence(capacity=4)  # a structural operation inside: takes it again
                with second.transaction():  # another attachment, same process: re-entrant, no deadlock
                    seq.truncate(0)
                assert store._engine._lock.is_held
            assert store._engine._lock.is_held
        assert not store._engine._lock.is_held and not second._engine._lock.is_held
        # released for real: another process gets it at once
        assert start_in_process(try_lock, store.name, 0.0, timeout=60).result() == "acquired"
    finally:
        second.close()


def test_release_without_hold_is_an_error(store):
    with pytest.raises(RuntimeError, match="not held"):
        store._engine._lock.release()


def test_exclusion_between_threads(store):
    held_by_a, release_a = threading.Event(), threading.Event()
    result: list[str] = []

    def a() -> None:
        with store.transaction():
            held_by_a.set()
            release_a.wait(30)

    def b() -> None:
        try:
            store._engine._lock.acquire(0.2)
        except shmkv.LockTimeout:
            result.append("timeout")
        else:
            store._engine._lock.release()
            result.append("acquired")

    ta = threading.Thread(target=a)
    ta.start()
    assert held_by_a.wait(30)
    tb = threading.Thread(target=b)
    tb.start()
    tb.join(30)
    assert result == ["timeout"]  # one descriptor, two threads: the RLock excludes
    release_a.set()
    ta.join(30)
    tb = threading.Thread(target=b)
    tb.start()
    tb.join(30)
    assert result == ["timeout", "acquired"]


def test_threads_counting_under_the_lock_lose_no_update(store):
    counter = [0]
    second = shmkv.attach(store.name)

    def work(s: shmkv.Store) -> None:
        for _ in range(300):
            with s.transaction():
                v = counter[0]
                time.sleep(0)  # yield the GIL between the read and the write
                counter[0] = v + 1

    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in (store, store, second, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert counter[0] == 1200
    finally:
        second.close()


@pytest.mark.parametrize("method", START_METHODS)
def test_exclusion_between_processes(store, tmp_path, method):
    path = str(tmp_path / "counter")
    with open(path, "w") as f:
        f.write("0")
    children = [start_in_process(count_under_lock, store.name, path, 150, start_method=method, timeout=120)
                for _ in range(3)]
    try:
        count_under_lock(store.name, path, 150)
        for c in children:
            c.result()
    finally:
        for c in children:
            c.kill()
    with open(path) as f:
        assert int(f.read()) == 600


def test_forked_child_has_its_own_descriptor(store):
    store.create_sequence(capacity=4).release()  # the lock has been used (and its file opened) here
    parent_fd = store._engine._lock._fd
    with store.transaction():
        # fork while holding: a child sharing our descriptor would "acquire" at once
        assert start_in_process(try_lock, store.name, 0.3, start_method="fork", timeout=60).result() == "timeout"

        def in_child(s: shmkv.Store) -> tuple[bool, str]:
            lk = store._engine._lock  # the inherited handle's lock, re-opened on first use in the child
            try:
                lk.acquire(0.3)
            except shmkv.LockTimeout:
                outcome = "timeout"
            else:
                lk.release()
                outcome = "acquired"
            return lk._pid == os.getpid(), outcome  # re-opened here (the number may be the same)

        reopened, outcome = start_in_process(_run_with_store, in_child, start_method="fork", timeout=60).result()
        assert outcome == "timeout" and reopened
    reopened, outcome = start_in_process(_run_with_store, in_child, start_method="fork", timeout=60).result()
    assert outcome == "acquired" and reopened
    assert parent_fd == store._engine._lock._fd and store._engine._lock._pid == os.getpid()


def _run_with_store(fn):  # fork only: the closure and the inherited store come along
    return fn(None)


@pytest.mark.slow
def test_inherited_descriptor_does_not_keep_a_dead_holders_lock(store, tmp_path):
    ready, gpid_path = str(tmp_path / "ready"), str(tmp_path / "grandchild")
    child = start_in_process(fork_then_die_holding, store.name, ready, gpid_path, start_method="spawn",
                             timeout=120)
    gpid = 0
    try:
        wait_for(ready, child)
        with open(gpid_path) as f:
            gpid = int(f.read())
        with pytest.raises(shmkv.LockTimeout):
            store._engine._lock.acquire(0.2)
        child.kill(signal.SIGKILL)  # the holder dies; its forked child lives on
        os.kill(gpid, 0)  # still alive
        with store._engine._lock.held(10.0):
            pass
    finally:
        child.kill()
        if gpid:
            try:
                os.kill(gpid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_readers_share_a_lock_on_a_readonly_attachment(store, tmp_path):
    ready = str(tmp_path / "ready")
    reader = start_in_process(hold_lock, store.name, ready, True, timeout=120)
    try:
        wait_for(ready, reader)
        ro = shmkv.attach(store.name, readonly=True)
        try:
            # the reader's descriptor is read-only: no write access needed
            assert (os.O_ACCMODE & _fcntl_flags(ro._engine._lock._fd)) == os.O_RDONLY
            with ro._engine._lock.held(0.5, shared=True):  # a second shared holder gets in
                pass
        finally:
            ro.close()
        assert start_in_process(try_lock, store.name, 0.2, True, timeout=60).result() == "acquired"
        with pytest.raises(shmkv.LockTimeout):  # a writer waits for the readers
            store._engine._lock.acquire(0.2)
    finally:
        reader.kill()
    with store._engine._lock.held(10.0):
        pass


def _fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


@pytest.mark.slow
def test_closing_a_handle_while_holding_keeps_the_lock_until_release(store):
    second = shmkv.attach(store.name)
    with second.transaction():
        second.close()  # its descriptor holds the flock: closed at the release, not now
        assert start_in_process(try_lock, store.name, 0.2, timeout=60).result() == "timeout"
    assert start_in_process(try_lock, store.name, 0.0, timeout=60).result() == "acquired"
    with pytest.raises(shmkv.StoreClosedError):
        second._engine._lock.acquire(1)


def test_lock_file_lives_as_long_as_the_segments(tmp_path):
    name = unique_name()
    before = shm_entries()
    store = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=8, persistent=True)
    made = shm_entries() - before
    prefix = _segment.PREFIX + name
    assert {prefix + ".h", prefix + ".d", prefix + ".lock"} <= made  # created with the store
    store.create_sequence(capacity=4).release()
    store.close()
    assert prefix + ".lock" in shm_entries()  # the store persists: so does its lock file
    shmkv.remove(name)
    assert not {f for f in shm_entries() if f.startswith(prefix + ".")}  # all gone together


def test_failed_create_leaves_no_lock_file():
    name = unique_name()
    before = shm_entries()
    with pytest.raises(shmkv.InvalidArgumentError):
        shmkv.create(name, layers=0, kv_heads=1, head_dim=2)
    # (entries of this name only: other tests' and programs' stores come and go meanwhile)
    assert {f for f in shm_entries() - before if name in f} == set()
    with pytest.raises(shmkv.InvalidArgumentError):
        shmkv.create("../evil", layers=1, kv_heads=1, head_dim=2)  # never a path outside /dev/shm


def test_lifecycle_lock_serializes_and_times_out(tmp_path):
    name = unique_name()
    entered = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with _lifecycle_lock.lifecycle(name):
            entered.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert entered.wait(30)
        # filelock is per thread: another thread waits, and gives up at its timeout
        with pytest.raises(shmkv.LockTimeout, match="lifecycle"), _lifecycle_lock.lifecycle(name, timeout=0.2):
            pass
    finally:
        release.set()
        t.join(30)
    with _lifecycle_lock.lifecycle(name, timeout=5), _lifecycle_lock.lifecycle(name, timeout=5):  # re-entrant
        assert os.path.exists(_lifecycle_lock.lifecycle_path(name))
    assert not os.path.exists(_lifecycle_lock.lifecycle_path(name))  # no store of that name: its file goes too


def test_a_ctrl_c_while_waiting_for_the_lifecycle_lock_is_raised_while_waiting():
    """Waiting is polled: a Ctrl-C that arrives (deferred by the lock path) is raised at the next
    poll, with nothing held, not after the timeout."""
    name = unique_name()
    entered, release = threading.Event(), threading.Event()

    def holder() -> None:
        with _lifecycle_lock.lifecycle(name):
            entered.set()
            release.wait(30)

    def ctrl_c_in_the_poll(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "poll" and frame.f_code.co_filename.endswith("lock.py"):
            handler = signal.getsignal(signal.SIGINT)
            assert handler is not signal.default_int_handler  # the lock path's, which defers it
            handler(signal.SIGINT, frame)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert entered.wait(30)
        sys.settrace(ctrl_c_in_the_poll)
        try:
            with pytest.raises(KeyboardInterrupt) as info, _lifecycle_lock.lifecycle(name, timeout=5):
                pass
        finally:
            sys.settrace(None)
        assert info.value.__context__ is None  # not raised after a LockTimeout
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # no lock held any more
    finally:
        release.set()
        t.join(30)
    assert not os.path.exists(_lifecycle_lock.lifecycle_path(name))


def test_gc_orphan_lock_file_is_removed_only_without_a_store(store):
    lock_file = _segment.lock_path(store.name)
    _lifecycle_lock.remove_orphan(store.name, lock_file)  # the store exists: kept
    assert os.path.exists(lock_file)
    name = unique_name()
    stray = _segment.lock_path(name)
    open(stray, "w").close()
    _lifecycle_lock.remove_orphan(name, stray)
    assert not os.path.exists(stray) and not os.path.exists(_lifecycle_lock.lifecycle_path(name))
