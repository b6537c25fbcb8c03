"""The store lock: one lock file beside the segments, one lock object per process.

filelock opens (and, in filelock 4, removes) the lock file on every outermost
acquire: an acquire and release cost about 130-140 us here (measured with
store.transaction() in a loop; keeping the file with preserve_lock_file saves
nothing measurable). That is fine for structural operations and is never paid
on the per-token path; a truncate per speculative-decoding step does pay it.
The object is created lazily in each process (a child after fork gets its own:
an inherited flock would be shared with the parent) and is re-entrant, so a
structural operation may call another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import filelock

from .errors import LockTimeout

POLL_INTERVAL = 0.0005
DEFAULT_TIMEOUT = 30.0

_locks: dict[tuple[str, int], filelock.FileLock] = {}


def _lock_for(path: str) -> filelock.FileLock:
    key = (path, os.getpid())
    lock = _locks.get(key)
    if lock is None:
        if len(_locks) > 256:  # drop objects inherited from parents
            for k in [k for k in _locks if k[1] != key[1]]:
                del _locks[k]
        lock = filelock.FileLock(path, mode=0o600, timeout=DEFAULT_TIMEOUT)
        _locks[key] = lock
    return lock


@contextmanager
def held(path: str, name: str, timeout: float = DEFAULT_TIMEOUT) -> Iterator[None]:
    """Hold the store lock at ``path`` for the duration of the block."""
    lock = _lock_for(path)
    try:
        lock.acquire(timeout=timeout, poll_interval=POLL_INTERVAL)
    except filelock.Timeout:
        raise LockTimeout(
            f"store {name!r}: lock {path} not acquired within {timeout} s; another process holds it "
            "(raise lock_timeout= on create/attach if structural operations are long)"
        ) from None
    try:
        yield
    finally:
        lock.release()
