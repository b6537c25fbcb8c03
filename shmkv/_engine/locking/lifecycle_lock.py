"""The lifecycle lock of a store name.

A filelock on a separate file, ``skv_<name>.life``, serializes
the cold paths (create, remove, gc) of one store name, so that gc's "all owners
dead, remove" and remove's unlinking cannot interleave with a create of the
same name. filelock copes with its file being unlinked while held (it checks
the inode's link count after locking), so remove may unlink it last.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import filelock

from shmkv._engine.memory import segment as _segment
from shmkv._engine.locking.interrupts import critical, critical_here, deferred, deliver_deferred, hold, unhold
from shmkv._engine.locking.lock import DEFAULT_TIMEOUT, poll
from shmkv.errors import LockTimeout

LIFECYCLE_SUFFIX = ".life"

_lifecycle_locks: dict[tuple[str, int], filelock.FileLock] = {}


def lifecycle_path(name: str) -> str:
    """The lifecycle lock file of store ``name`` (beside its segments; see the module docstring)."""
    return os.path.join(_segment.SHM_DIR, f"{_segment.PREFIX}{name}{LIFECYCLE_SUFFIX}")


def _lifecycle_lock(path: str, mode: int) -> filelock.FileLock:
    key = (path, os.getpid())
    lock = _lifecycle_locks.get(key)
    if lock is None:
        if len(_lifecycle_locks) > 256:  # drop unheld objects (and any inherited from a parent)
            for k in [k for k, v in _lifecycle_locks.items() if k[1] != key[1] or not v.is_locked]:
                del _lifecycle_locks[k]
        lock = filelock.FileLock(path, mode=mode, timeout=DEFAULT_TIMEOUT)
        _lifecycle_locks[key] = lock
    return lock


class lifecycle:  # (lower case: used as ``with lifecycle(name):``, as it was a function)
    """Serialize create / remove / gc of store ``name`` across processes (re-entrant per thread).

    Its ``__enter__`` and ``__exit__`` are lock-path code (``critical``): a Ctrl-C while the
    lock file is made and locked, or while it is dropped and unlocked, is raised once that is
    done, so a Ctrl-C never leaves the lock held or its file behind; the block itself is
    interrupted as usual. On the way out the file is removed if no store of that name exists
    (a remove, a create that failed): it lives exactly as long as the store.

    When the lock file belongs to another user and its mode shuts us out, the block
    runs without it: what it then does to that user's store meets the same
    permission wall and reports it there (gc skips such stores).
    """

    __slots__ = ("_lock", "mode", "name", "timeout")

    def __init__(self, name: str, timeout: float = DEFAULT_TIMEOUT, *, mode: int = 0o600) -> None:
        _segment.check_name(name)  # the name becomes a path: check it before anything is created
        self.name, self.timeout, self.mode = name, timeout, mode
        self._lock: filelock.FileLock | None = None

    @critical
    def __enter__(self) -> None:
        hold()  # the deferring handler, from here until the main thread holds no lock
        try:
            self._lock = _take_lifecycle(self.name, self.timeout, self.mode)
        except BaseException:
            unhold()
            deliver_deferred()
            raise
        if deferred:  # a Ctrl-C while we took it: give it back (and the file), then raise it
            self.__exit__(None, None, None)

    @critical
    def __exit__(self, *exc: object) -> None:
        lock, self._lock = self._lock, None
        try:
            _drop_lifecycle_file_if_no_store(self.name)
        finally:
            if lock is not None:
                lock.release()
            unhold()
        deliver_deferred()


@critical
def _take_lifecycle(name: str, timeout: float, mode: int) -> filelock.FileLock | None:
    """The lifecycle lock of ``name``, taken (None: its file is another user's and shuts us out).
    Polled, so that a Ctrl-C deferred meanwhile is raised while nothing is held."""
    lock = _lifecycle_lock(lifecycle_path(name), mode)

    def try_once() -> bool:
        try:
            lock.acquire(blocking=False)
            return True
        except filelock.Timeout:
            return False
        except OSError as e:  # the lock file cannot be made: /dev/shm has no byte or inode left
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _segment.shm_full(os.path.basename(lifecycle_path(name)), e) from None
            raise

    def timed_out() -> LockTimeout:
        return LockTimeout(f"store {name!r}: lifecycle lock {lifecycle_path(name)} not acquired within {timeout} s; "
                           "another process is creating or removing that store")

    try:
        if not try_once():
            poll(try_once, time.monotonic() + timeout, timed_out)
    except PermissionError:
        return None
    return lock


F = TypeVar("F", bound=Callable[..., Any])
_NOTHING: Any = object()


def lifecycle_op(*, undo: Callable[[Any], object] | None = None) -> Callable[[F], F]:
    """Decorate a function whose first argument is a store name: it runs under that name's lifecycle
    lock (whose file is removed on the way out if no store of that name exists: see ``lifecycle``).

    ``undo(result)`` runs if the function returned but a Ctrl-C deferred while the lock was given
    up is raised on the way out: the caller gets the KeyboardInterrupt, not the result, so what the
    result holds must not outlive the call (a create's store is removed)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        @critical_here  # a Ctrl-C as fn returns into it waits for the lock's release: the result is kept, undone
        def wrapper(name: str, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(name, str):
                return fn(name, *args, **kwargs)  # the function's own check reports the bad name
            result = _NOTHING
            try:
                with lifecycle(name, mode=kwargs.get("mode", 0o600)):
                    result = fn(name, *args, **kwargs)
            except BaseException:
                if result is not _NOTHING and undo is not None:
                    undo(result)
                raise
            return result

        return wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature; mypy cannot see it

    return decorate


def _has_store(name: str) -> bool:
    return os.path.exists(_segment.shm_path(_segment.header_name(name)))


def _drop_lifecycle_file_if_no_store(name: str) -> None:
    # Called with the lifecycle lock held; filelock sees the unlink (link count 0) and its
    # waiters start over on a new file, so unlinking a held lock file is safe here.
    if not _has_store(name):
        try:
            os.unlink(lifecycle_path(name))
        except (FileNotFoundError, PermissionError):  # gone, or another user's (gc skips those)
            pass


def remove_orphan(name: str, path: str) -> None:
    """gc: remove ``path`` (a data segment or lock file of store ``name``) if the store's header is gone."""
    with lifecycle(name):
        if not _has_store(name):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
