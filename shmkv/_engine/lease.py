"""Lease tokens of write handles, and the write handles alive in this process.

A write handle holds its sequence's lease: the row's LEASE_PID (for display),
LEASE_CLIENT (the holding attachment's client key: alive while its byte of the
liveness file is locked, see ``liveness``) and LEASE_TOKEN words. The token tells
this process's handles apart; a lease of one of this process's attachments whose
token has no live handle here belongs to a handle that was dropped without
``release()`` and may be taken again.
"""

from __future__ import annotations

import os
import secrets
import weakref
from typing import Any

from shmkv._engine import segment as _segment
from shmkv._engine.header import LEASE_PID, LEASE_TOKEN, STATE

# token -> live write handle (a ``Sequence``: whoever needs one checks with isinstance, as this
# module sits below the sequence layer), for every handle holding a lease in this process.
live_writers: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def new_token() -> int:
    return secrets.randbits(62) + 1


def own_token(row: memoryview) -> int:
    """The lease token on ``row`` if a live handle of this process holds it, else 0."""
    if row[LEASE_PID] == os.getpid() and row[LEASE_TOKEN] in live_writers:
        return int(row[LEASE_TOKEN])
    return 0


def release_row(row: memoryview, token: int, pid: int, epoch: int) -> None:
    """Finalizer of a write handle: give the lease back if we still hold it."""
    if os.getpid() == pid and _segment.fork_epoch == epoch:
        try:
            if row[LEASE_TOKEN] == token and row[LEASE_PID] == pid:
                row[LEASE_PID] = 0
        except (ValueError, TypeError):  # released memoryview
            pass


def with_release(logged: list[int], row: Any) -> list[int]:
    """``logged`` (a row's words in the undo log) with LEASE_PID 0 when that lease was released
    since (its holder zeroes LEASE_PID without the lock: same state, same token). Every rollback
    keeps a release, also of this process's own change of its own leased row (journal
    invariant 10): a rollback that gave the pid back left the sequence leased to a handle that
    had let it go, until this process exited."""
    if (logged[LEASE_PID] and not row[LEASE_PID] and row[STATE] == logged[STATE]
            and row[LEASE_TOKEN] == logged[LEASE_TOKEN]):
        logged[LEASE_PID] = 0
    return logged
