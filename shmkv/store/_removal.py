"""Removing a store, and only the store we know: its names unlinked (segments, then the lock
and liveness files), a store's identity word read without attaching, removal only while a name
still holds the identity a handle saw (ARCHITECTURE.md invariant 11), and the creator's removal
at interpreter or multiprocessing-child exit."""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from shmkv._engine.clients import liveness as _liveness
from shmkv._engine.locking import lifecycle_lock as _lifecycle_lock
from shmkv._engine.memory import segment as _segment
from shmkv._engine.table import unattached as _unattached
from shmkv._engine.locking.interrupts import critical, shielding
from shmkv._engine.memory.segment import Segment
from shmkv.errors import AccessDeniedError, StoreNotFound

T = TypeVar("T")

__all__ = ["exit_removals", "origin", "read_identity", "remove_at_process_exit", "remove_if_same", "remove_names",
           "remove_then_forget"]


@_lifecycle_lock.lifecycle_op()
@critical
def remove_names(name: str) -> bool:
    """Unlink the segments, then the lock and liveness files (never those while a segment exists).

    Lock-path code (``critical``): a Ctrl-C meanwhile is raised once every name is gone, so the
    store is never left half removed (a header gone, its data segment and lock file still there,
    which nothing would ever remove)."""
    found = _segment.unlink(_segment.header_name(name))
    found = _segment.unlink(_segment.data_name(name)) or found
    for path, what in ((_segment.lock_path(name), "lock file"), (_liveness.live_path(name), "liveness file")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except PermissionError:
            raise _segment.denied(os.path.basename(path), what) from None
    return found


@shielding()  # (a Ctrl-C as the header is opened or closed: raised once it is closed)
def _in_header(name: str, read: Callable[[np.ndarray], T | None]) -> T | None:
    """``read`` of ``name``'s header's fixed words, None when there is no header, it is not ours
    to read or too small (``read`` answers None for a header without the shmkv magic)."""
    try:
        hseg = Segment.open(_segment.header_name(name), readonly=True)
    except (StoreNotFound, AccessDeniedError):
        return None
    try:
        words = _unattached.fixed_words(hseg)
        out = None if words is None else read(words)
        del words
        return out
    finally:
        hseg.close()


def origin(name: str) -> _unattached.Origin | None:
    """Where store ``name`` comes from (session tag, identity, creator) if its header has the
    shmkv magic, else None (no header, not ours to read, too small, or not a shmkv header)."""
    return _in_header(name, _unattached.origin_of)


def read_identity(name: str) -> int | None:
    """The store identity in ``name``'s header, None when there is no readable shmkv header."""
    return _in_header(name, _unattached.identity_of)


def remove_if_same(name: str, identity: int) -> bool:
    """Remove store ``name`` only if its header still holds ``identity`` (it is the store we know)."""
    if identity and read_identity(name) == identity:
        return remove_names(name)
    return False


# (name, identity) -> (pid, fork epoch) of the non-persistent stores this process created
# and has not closed: removed at interpreter exit, by the creating process only (a forked
# child that exits must not remove them), and only if their identity is unchanged.
exit_removals: dict[tuple[str, int], tuple[int, int]] = {}


def remove_then_forget(name: str, identity: int) -> None:
    """Remove store ``name`` if it still holds ``identity``; then, not before, this process's exit has
    nothing left to remove for it (a Ctrl-C until then leaves the removal to the exit)."""
    remove_if_same(name, identity)
    exit_removals.pop((name, identity), None)


@atexit.register
def _remove_at_exit() -> None:
    for (name, identity), (pid, epoch) in list(exit_removals.items()):
        if pid == os.getpid() and epoch == _segment.fork_epoch:
            try:
                remove_if_same(name, identity)
            except Exception:  # exiting: nothing left to report to
                pass
    exit_removals.clear()


_mp_exit_pid = 0


def remove_at_process_exit(name: str, identity: int) -> None:
    """Register a created store for removal when this process exits.

    atexit covers a normal interpreter exit; multiprocessing's fork and forkserver
    children end with os._exit and run only multiprocessing's own exit finalizers,
    so the removal is registered there too (once per process; it runs once).
    """
    global _mp_exit_pid
    exit_removals[(name, identity)] = (os.getpid(), _segment.fork_epoch)
    if _mp_exit_pid != os.getpid():
        from multiprocessing import util

        util.Finalize(None, _remove_at_exit, exitpriority=0)
        _mp_exit_pid = os.getpid()
