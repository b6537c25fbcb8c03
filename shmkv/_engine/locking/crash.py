"""Named crash points: where the crash tests kill a process inside a structural operation.

``point(name)`` does nothing unless the environment variable ``SHMKV_CRASH_AT`` named it
when shmkv was imported (``name`` or ``name:k``, the k-th time the point is reached), and
then SIGKILLs the process on the spot, as the OOM killer would. Read once at import: the
hot path pays one call of a no-op function, only inside structural operations.

Every point is listed in ``POINTS``; tests/test_crash.py and tests/test_journal.py kill a
child at each of them and check the store from another process. ``arm(name, exc)`` makes a
point raise ``exc`` in this process instead (tests/test_journal.py: an exception inside a
journaled transaction rolls it back); ``disarm()`` undoes it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

POINTS = (
    "create.row",  # create_sequence: the new row half written
    "create.copied",  # create_sequence(prefix=): the prefix copied in, row not yet switched
    "free.row",  # free / eviction: the row half cleared
    "free.rehomed",  # freeing a row whose index entries stand for copies' (STANDIN): one copy has its own
    "truncate.row",  # truncate: the length changed, the rest not
    "grow.extended",  # growth in place: CAPACITY switched, the unit not finished
    "grow.slid",  # growth by a slide down into free cells before it: copied, the row not switched
    "grow.copied",  # growth by a move: data copied to the new range, the row not switched
    "grow.switched",  # growth: START switched, CAPACITY not
    "copy_prefix.copied",  # copy_prefix into a sequence holding tokens: copied, not switched
    "fork.child",  # fork: the child created, the copy not done
    "remove.copied",  # remove: the rewritten content in place, the row not switched
    "shift_left.copied",
    "compact.copied",  # a sliding window's compaction: the other buffer written
    "set_encoder.written",  # set_encoder: the new encoder written, the parent not switched
    "restore.published",  # restore: some rows published, not all, next id not advanced
    "lease.taken",  # lease take-over (journaled): client key and token written, pid not
    "finish.flagged",
    "share.borrowed",  # a reuse borrows a donor's pages: span recorded, its own pages punched out
    "share.unshared",  # copy-on-write: private copies of what a borrower keeps written, span not shrunk
    "share.released",  # a borrower freed or moved: its span dropped (the last one: its cells free)
    "share.moved",  # a donor below cells it lent (truncate, or its next write): copied to a fresh range, not switched
    "rewind.copied",  # seq.rewind: the new window written into the other buffer, the row not switched
    "rewind.truncated",  # seq.rewind within what the window holds: the length changed, the index not
)

_spec = os.environ.get("SHMKV_CRASH_AT", "")
_name, _, _count = _spec.partition(":")
_left = int(_count or 1)


def _armed(name: str) -> None:
    global _left
    if name == _name:
        _left -= 1
        if _left <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


def _noop(name: str) -> None:
    return None


point: Callable[[str], None] = _armed if _name else _noop


def arm(name: str, exc: BaseException, count: int = 1) -> None:
    """Make point ``name`` raise ``exc`` the ``count``-th time it is reached (this process)."""
    global point
    if name not in POINTS:
        raise ValueError(f"{name!r} is not a crash point (shmkv._engine.locking.crash.POINTS)")
    left = [count]

    def raising(at: str) -> None:
        if at == name:
            left[0] -= 1
            if left[0] == 0:
                raise exc

    point = raising


def disarm() -> None:
    """Points back to what ``SHMKV_CRASH_AT`` made them."""
    global point
    point = _armed if _name else _noop

