"""The store's two locks: a structural lock that costs microseconds, a lifecycle lock for cold paths.

Structural lock (docs/design.md §3): ``fcntl.flock`` on the store's lock file
(``skv_<name>.lock`` beside the segments), through a descriptor that each
attachment opens once and keeps, behind a ``threading.RLock`` per process.
An acquire and release cost a few microseconds (two flock system calls and the
RLock); filelock, which re-opens its file and runs about 480 Python calls per
acquire, cost 130-160 us here, and a speculative-decoding step truncates (takes
this lock) once per token.

Why the RLock:

* A flock belongs to an open file description, not to a process or a thread.
  Two descriptors opened by one process conflict like two processes would (a
  thread re-entering through a second attachment would deadlock itself), and
  one descriptor used by two threads excludes nothing. So each process keeps,
  per lock file (keyed by device and inode), one RLock shared by all its
  attachments of that store: it orders the process's threads and makes the
  lock re-entrant; only the outermost acquire takes the flock, which excludes
  other processes.
* The kernel drops a flock when the last descriptor of its open file
  description closes, so a holder killed by SIGKILL releases the lock
  (tests/test_lock.py::test_sigkilled_holder_releases_the_lock). A forked child
  shares the parent's open file description: it would hold the parent's lock
  without excluding the parent, and keep a dead parent's lock alive. So the
  child closes every inherited descriptor right after fork (``register_at_fork``),
  starts with fresh RLocks (the parent's may be held by a thread the child does
  not have), and each lock re-opens its file on first use in the new process
  (``_forget_inherited``, run in the child at the fork, leaves it no pid).

Readers of a read-only attachment open the file read-only and may take
``LOCK_SH`` (``held(shared=True)``): flock needs no write access. A timeout is
honoured by polling ``LOCK_NB`` with short sleeps (flock has no timeout); no
timeout (``None`` or negative) blocks in the kernel.

The lock file is created with the store and removed only after its segments
(``store._removal.remove_names``): never while they exist, or a waiter on the old inode
and a newcomer on a new one would both "hold" it.

Ctrl-C on the lock path is deferred out of it: see ``interrupts``.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable

from shmkv._engine.locking.forks import renewed
from shmkv._engine.locking.interrupts import critical, deferred, deliver_deferred, hold, unhold
from shmkv.errors import LockTimeout, StoreClosedError, StoreNotFound

DEFAULT_TIMEOUT = 30.0
_POLL_FIRST, _POLL_MAX = 50e-6, 2e-3  # flock has no timeout: poll LOCK_NB, backing off to 2 ms


@critical
def poll(try_once: Callable[[], bool], deadline: float | None, timed_out: Callable[[], BaseException]) -> None:
    """Call ``try_once`` until it returns True, sleeping between tries from 50 us, doubling up to
    2 ms; raise ``timed_out()`` past ``deadline`` (None: never). Nothing is held between tries, so
    a Ctrl-C deferred meanwhile is raised there. The caller made its own first try."""
    delay = _POLL_FIRST
    while True:
        left = _POLL_MAX if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise timed_out()
        time.sleep(min(delay, left))
        deliver_deferred()
        delay = min(2 * delay, _POLL_MAX)
        if try_once():
            return


def _deadline(timeout: float | None) -> float | None:
    """When a wait of ``timeout`` s that starts now ends (None: never)."""
    return None if timeout is None or timeout < 0 else time.monotonic() + timeout


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class _ProcessState:
    """What one process knows about one lock file: its RLock and who holds the flock."""

    __slots__ = ("__weakref__", "close_after", "depth", "fd", "mode", "rlock")

    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self.depth = 0  # re-entrant holds by the RLock's owner (changed only under the RLock)
        self.fd = -1  # the descriptor that holds the flock while depth > 0
        self.mode = 0  # fcntl.LOCK_EX or fcntl.LOCK_SH while depth > 0
        self.close_after: list[int] = []  # descriptors closed while holding: closed at the last release


# (st_dev, st_ino) -> state; an entry lives while an open StoreLock of that file does.
_states: weakref.WeakValueDictionary[tuple[int, int], _ProcessState] = weakref.WeakValueDictionary()
_states_guard: threading.Lock = renewed(globals(), "_states_guard")  # (free again in a forked child)
_open_locks: weakref.WeakSet[StoreLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The child must not share the parent's open file descriptions (see the module docstring).
    for lk in list(_open_locks):
        lk._forget_inherited()
    _states.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _open_lock_file(path: str, readonly: bool, mode: int | Callable[[], int | None] | None) -> int:
    """Open (creating it if missing) the lock file at ``path``; O_CLOEXEC, never through a symlink.

    An existing file is opened without O_CREAT: in a sticky directory such as /dev/shm,
    ``fs.protected_regular`` refuses O_CREAT on another user's file even when its mode allows.
    ``mode`` (or a function giving it, asked only when the file is created) is the new file's.
    """
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC | os.O_NOFOLLOW
    while True:
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        if callable(mode):
            mode = mode()
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600 if mode is None else mode)
        except FileExistsError:
            continue  # created meanwhile by another process: open it
        if mode is not None:
            try:
                os.fchmod(fd, mode)  # the umask must not narrow a group store's lock file
            except OSError:
                pass
        return fd


def _segment_mode(path: str) -> int | None:
    """Permission bits of the store's header segment beside ``path`` (its lock file takes the same)."""
    header = path[: -len(".lock")] + ".h" if path.endswith(".lock") else None
    if header is None:
        return None
    try:
        return stat.S_IMODE(os.stat(header).st_mode)
    except OSError:
        return None


class StoreLock:
    """The structural lock of one store, as one attachment holds it (see the module docstring).

    ``held(timeout)`` is a re-entrant context manager; ``held(timeout, shared=True)``
    takes ``LOCK_SH`` (enough for a reader that waits out a structural change).
    ``close()`` closes the descriptor (a lock still held is released first).
    """

    def __init__(self, path: str, name: str, *, readonly: bool = False) -> None:
        self.path = path
        self.name = name
        self.readonly = readonly
        self._fd = -1
        self._pid = 0
        self._state: _ProcessState | None = None
        self._closed = False
        self._open()
        _open_locks.add(self)

    @critical  # (a Ctrl-C as the open returns, before the descriptor is kept, waits)
    def _open(self) -> None:
        # The file has the segments' mode: whoever could open them can open it.
        fd = _open_lock_file(self.path, self.readonly, self._mode_to_create)  # (stat only to create)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with _states_guard:  # two threads attaching at once must share one state, not make two
            state = _states.get(key)
            if state is None:
                state = _states[key] = _ProcessState()
        self._fd, self._pid, self._state = fd, os.getpid(), state

    def _mode_to_create(self) -> int | None:
        """The mode of a lock file made anew (it was missing): the header segment's. A store whose
        header is gone was removed, with its lock file: a new file would outlive it, unlisted
        (a forked child's first use of an inherited handle after the creator removed the store)."""
        if not self.path.endswith(".lock"):
            return None
        mode = _segment_mode(self.path)
        if mode is None and not os.path.exists(self.path[: -len(".lock")] + ".h"):
            raise StoreNotFound(f"store {self.name!r} was removed (its header and lock file are gone): "
                                f"`shmkv ls` lists the stores; attach to one that exists")
        return mode

    def _forget_inherited(self) -> None:
        """In a forked child: drop the parent's descriptor (without touching its lock) and state."""
        if self._fd >= 0 and not self._closed:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._pid, self._state = -1, 0, None

    def _timeout_error(self, timeout: float | None) -> LockTimeout:
        return LockTimeout(
            f"store {self.name!r}: lock {self.path} not acquired within {timeout} s; another process "
            "holds it (raise lock_timeout= on create/attach if structural operations are long)"
        )

    @critical
    def acquire(self, timeout: float | None = DEFAULT_TIMEOUT, *, shared: bool = False) -> int:
        """Take the lock (re-entrant); raise LockTimeout after ``timeout`` s (None or < 0: wait).

        Returns with the lock held (the holds this process now has: 1 for the outermost, what
        ``depth`` would say, without its fork check), or raises with it not held (a Ctrl-C
        included: see the module docstring)."""
        hold()  # the deferring handler, from here until the main thread holds no lock (unhold)
        if self._closed:
            unhold()
            raise StoreClosedError(f"store {self.name!r} is closed: attach again with shmkv.attach({self.name!r})")
        if not self._pid:  # first use in a forked child (_forget_inherited zeroed it at the fork:
            try:           # no getpid system call a hold)
                self._open()
            except BaseException:
                unhold()
                raise
        state = self._state
        assert state is not None
        deadline = None  # worked out when something has to be waited for
        if not state.rlock.acquire(False):
            deadline = _deadline(timeout)
            if not state.rlock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
                unhold()
                deliver_deferred()  # a Ctrl-C while waiting wins over the timeout
                raise self._timeout_error(timeout)
        op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        outer = state.depth == 0
        try:
            if self._closed:  # closed by another thread while this one waited (see quiesce)
                raise StoreClosedError(f"store {self.name!r} is closed: attach again with "
                                       f"shmkv.attach({self.name!r})")
            if outer:
                # recorded before the system call: whatever stops us after it, the descriptor
                # to unlock is known (an unlock of a flock not taken is harmless)
                state.fd, state.mode = self._fd, op
                try:
                    fcntl.flock(self._fd, op | fcntl.LOCK_NB)
                except BlockingIOError:
                    self._wait_flock(self._fd, op, deadline, timeout)
            elif op == fcntl.LOCK_EX and state.mode == fcntl.LOCK_SH:
                # An exclusive section inside a shared one: flock converts, not atomically (another
                # process may take the lock in between): the outer shared section must re-check.
                if not _try_flock(state.fd, op):
                    self._wait_flock(state.fd, op, deadline, timeout)
                state.mode = op
        except BaseException:
            if outer and state.fd >= 0:  # -1: closed by another thread before anything was taken
                try:
                    fcntl.flock(state.fd, fcntl.LOCK_UN)
                except OSError:
                    pass
                state.fd = -1
            state.rlock.release()
            unhold()
            deliver_deferred()  # nothing held now: a Ctrl-C deferred meanwhile is raised (chained)
            raise
        state.depth += 1
        if deferred:  # a Ctrl-C while we took it: give it back, then raise it
            self.release()
        return state.depth

    @critical
    def _wait_flock(self, fd: int, op: int, deadline: float | None, timeout: float | None) -> None:
        """Wait for the flock a non-blocking try was just refused. ``deadline`` is the thread
        lock's, when the caller waited for that one; None when it did not, and the wait starts
        here (or when the wait has no end: ``_deadline(timeout)`` is None again then)."""
        if deadline is None:
            deadline = _deadline(timeout)
        # Polled, also without a timeout (flock blocking in the kernel would retry after a
        # deferred Ctrl-C and never raise it): at most 2 ms late.
        poll(lambda: _try_flock(fd, op), deadline, lambda: self._timeout_error(timeout))

    @critical
    def release(self) -> None:
        """Give up one hold; the last one releases the flock. Only the holding thread may call it.

        A Ctrl-C deferred while the lock path ran is raised here, once the hold is given up."""
        state = self._state
        if state is None or state.depth == 0:
            raise RuntimeError(f"the lock of store {self.name!r} is not held")
        if state.depth == 1:
            # Check ownership before changing anything: RLock.release raises for a foreign thread.
            if not state.rlock._is_owned():  # type: ignore[attr-defined]  # RLock's owner check, not public
                raise RuntimeError(f"the lock of store {self.name!r} is held by another thread")
            try:
                fcntl.flock(state.fd, fcntl.LOCK_UN)
            finally:
                state.depth = 0
                state.fd = -1
                if state.close_after:
                    pending, state.close_after = state.close_after, []
                    for fd in pending:
                        os.close(fd)
                state.rlock.release()
                unhold()
        else:
            state.rlock.release()  # raises (RuntimeError) if this thread does not hold it
            state.depth -= 1
            unhold()
        if deferred:
            deliver_deferred()

    def owned(self) -> bool:
        """Whether the calling thread holds the lock."""
        state = self._state
        return (state is not None and self._pid == os.getpid() and state.depth > 0
                and bool(state.rlock._is_owned()))  # type: ignore[attr-defined]  # RLock's owner check

    @property
    def pid(self) -> int:
        """The process this lock was opened in; while the lock is held, the calling one (acquire
        opens it again in a forked child): no getpid system call on the structural path."""
        return self._pid

    @property
    def depth(self) -> int:
        """Holds of this process (0: not held); meaningful to the thread that holds the lock."""
        state = self._state
        return state.depth if state is not None and self._pid == os.getpid() else 0

    def quiesce(self, timeout: float | None) -> bool:
        """Wait (up to ``timeout`` s; None or < 0: for good) until no other thread of this process
        holds the lock, and keep them out (the RLock alone, no flock: another process's hold does not
        matter) until :meth:`unquiesce`. Store.close() runs under it, so it never tears a handle down
        under a thread's structural operation; a thread that then takes the lock of this closed
        attachment gets StoreClosedError. False (nothing held) if the wait timed out, or in a forked
        child that never used the lock (no other thread of this process holds it then)."""
        state = self._state
        if state is None or self._pid != os.getpid():
            return False
        return state.rlock.acquire(timeout=-1 if timeout is None or timeout < 0 else timeout)

    def unquiesce(self) -> None:
        """End :meth:`quiesce` (after it returned True)."""
        state = self._state
        if state is not None:
            state.rlock.release()

    def held(self, timeout: float | None = DEFAULT_TIMEOUT, *, shared: bool = False) -> _Held:
        """Hold the lock for the duration of a ``with`` block (re-entrant)."""
        return _Held(self, timeout, shared)

    @property
    def is_held(self) -> bool:
        """Whether this process holds the lock (through any of its attachments of the store)."""
        state = self._state
        return state is not None and self._pid == os.getpid() and state.depth > 0

    @critical  # (the descriptor forgotten and closed at once)
    def close(self) -> None:
        """Close this attachment's descriptor (if it holds the lock now, at the last release)."""
        if self._closed:
            return
        self._closed = True
        _open_locks.discard(self)
        state, fd = self._state, self._fd
        self._fd = -1
        if fd < 0 or self._pid != os.getpid():
            return
        if state is not None and state.depth > 0 and state.fd == fd:
            state.close_after.append(fd)
        else:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<shmkv StoreLock {self.path} {'held' if self.is_held else 'free'}{' closed' if self._closed else ''}>"


class _Held:
    """``with lock.held(timeout):`` (a class: a generator context manager costs microseconds here)."""

    __slots__ = ("lock", "shared", "timeout")

    def __init__(self, lock: StoreLock, timeout: float | None, shared: bool) -> None:
        self.lock, self.timeout, self.shared = lock, timeout, shared

    @critical
    def __enter__(self) -> None:
        self.lock.acquire(self.timeout, shared=self.shared)

    @critical
    def __exit__(self, *exc: object) -> None:
        self.lock.release()
