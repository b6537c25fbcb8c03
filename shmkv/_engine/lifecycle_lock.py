"""The lifecycle lock of a store name.

A filelock on a separate file, ``skv_<name>.life``, serializes
the cold paths (create, remove, gc) of one store name, so that gc's "all owners
dead, remove" and remove's unlinking cannot interleave with a create of the
same name. filelock copes with its file being unlinked while held (it checks
the inode's link count after locking), so remove may unlink it last.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import filelock

from shmkv._engine import segment as _segment
from shmkv._engine.lock import DEFAULT_TIMEOUT
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


@contextmanager
def lifecycle(name: str, timeout: float = DEFAULT_TIMEOUT, *, mode: int = 0o600) -> Iterator[None]:
    """Serialize create / remove / gc of store ``name`` across processes (re-entrant per thread).

    When the lock file belongs to another user and its mode shuts us out, the block
    runs without it: what it then does to that user's store meets the same
    permission wall and reports it there (gc skips such stores).
    """
    _segment.check_name(name)  # the name becomes a path: check it before anything is created
    lock = _lifecycle_lock(lifecycle_path(name), mode)
    try:
        lock.acquire(timeout=timeout, poll_interval=0.0005)
    except filelock.Timeout:
        raise LockTimeout(
            f"store {name!r}: lifecycle lock {lifecycle_path(name)} not acquired within {timeout} s; "
            "another process is creating or removing that store"
        ) from None
    except PermissionError:
        yield
        return
    except OSError as e:  # the lock file cannot be made: /dev/shm has no byte or inode left
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _segment.shm_full(os.path.basename(lifecycle_path(name)), e) from None
        raise
    try:
        yield
    finally:
        lock.release()


F = TypeVar("F", bound=Callable[..., Any])


def lifecycle_op(fn: F) -> F:
    """Decorate a function whose first argument is a store name: it runs under that name's lifecycle lock.

    If no store of that name exists afterwards (removed, or a create that failed), the
    lifecycle lock file is removed too: it lives exactly as long as the store.
    """
    import functools

    @functools.wraps(fn)
    def wrapper(name: str, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(name, str):
            return fn(name, *args, **kwargs)  # the function's own check reports the bad name
        with lifecycle(name, mode=kwargs.get("mode", 0o600)):
            try:
                return fn(name, *args, **kwargs)
            finally:
                _drop_lifecycle_file_if_no_store(name)

    return wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature; mypy cannot see it


def _drop_lifecycle_file_if_no_store(name: str) -> None:
    # Called with the lifecycle lock held; filelock sees the unlink (link count 0) and its
    # waiters start over on a new file, so unlinking a held lock file is safe here.
    if not os.path.exists(_segment.shm_path(_segment.header_name(name))):
        try:
            os.unlink(lifecycle_path(name))
        except (FileNotFoundError, PermissionError):  # gone, or another user's (gc skips those)
            pass


def remove_orphan(name: str, path: str) -> None:
    """gc: remove ``path`` (a data segment or lock file of store ``name``) if the store's header is gone."""
    with lifecycle(name):
        if not os.path.exists(_segment.shm_path(_segment.header_name(name))):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            _drop_lifecycle_file_if_no_store(name)
