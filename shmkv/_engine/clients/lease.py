"""Lease tokens of write handles, and the write handles alive in this process.

A write handle holds its sequence's lease: the row's LEASE_PID (for display),
LEASE_CLIENT (the holding attachment's client key: alive while its byte of the
liveness file is locked, see ``liveness``) and LEASE_TOKEN words. The token tells
this process's handles apart; a lease of one of this process's attachments whose
token has no live handle here belongs to a handle that was dropped without
``release()`` and may be taken again.

A row's lease and its states (as the journal's, ``_engine/locking/journal.py``)::

    none      LEASE_PID 0 (LEASE_CLIENT and LEASE_TOKEN keep the last holder's, for a rollback's
              comparison: ``keeping_release``)
    held      LEASE_PID, LEASE_CLIENT, LEASE_TOKEN: a live write handle's
    orphaned  held, by a client whose byte of the liveness file is free (its process died), or
              by this process under a token no live handle has (dropped without release())

    none --create_sequence, fork, sequence(write=True)     [lock; journaled: Rows.take_lease_words]--> held
    held --release(), finish(), the handle collected, exit [no lock: LEASE_PID 0; release_row]--> none
    held --its holder dies, or drops its handle unreleased---------------------------------------> orphaned
    orphaned --sequence(write=True)                         [lock; journaled take-over]----------> held
    any --free, an eviction, a restore over the row         [lock; journaled]--> the row is gone

Who may take it is one question, asked under the lock: ``Attachment._lease_holder`` (alive: this
process's handle of that token lives, or another client's byte is locked). A release writes one
word without the lock; a rollback of a change that logged the row before the release keeps it
released (``keeping_release``, journal invariant 10).
"""

from __future__ import annotations

import atexit
import os
import random
import weakref
from typing import Any

from shmkv._engine.memory import segment as _segment
from shmkv._engine.table.header import LEASE_PID, LEASE_TOKEN, STATE

# Draws lease tokens: seeded from the OS once per process (a forked child seeds it again, so
# it never draws its parent's tokens). Tokens tell handles apart; nobody needs to guess them.
# (A draw from os.urandom each time cost 1.4 us a create here; this one, 0.1 us.)
_tokens = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _tokens.seed(os.urandom(16)))


def new_token() -> int:
    return _tokens.getrandbits(62) + 1


class LiveWriters:
    """token -> live write handle (a ``Sequence``: whoever needs one checks with isinstance, as
    this module sits below the sequence layer), for every handle holding a lease in this process.

    A handle dropped without ``release()`` gives its lease back (``release_row``, from its weak
    reference's callback), and so does every handle still registered when the interpreter exits.
    One weak reference with a callback a handle: 1.5 us to register and drop one here, where a
    WeakValueDictionary entry and a ``weakref.finalize`` cost 2 us at a create and 1.1 us at a free."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[object]] = {}

    def add(self, token: int, handle: object, row: memoryview, epoch: int) -> None:
        pid = os.getpid()
        refs = self._refs

        def dropped(ref: weakref.ref[object]) -> None:
            if refs.get(token) is ref:
                del refs[token]
                release_row(row, token, pid, epoch)

        refs[token] = weakref.ref(handle, dropped)

    def pop(self, token: int) -> None:
        """Forget ``token``'s handle (its lease is given back, or kept on purpose, by the caller)."""
        self._refs.pop(token, None)

    def values(self) -> list[object]:
        return [h for h in (r() for r in list(self._refs.values())) if h is not None]

    def __contains__(self, token: object) -> bool:
        ref = self._refs.get(token)  # type: ignore[call-overload]
        return ref is not None and ref() is not None

    def release_all(self) -> None:
        """At exit: every lease a live handle of this process holds goes back."""
        for ref in list(self._refs.values()):
            callback = ref.__callback__
            if callback is not None and ref() is not None:
                callback(ref)


live_writers = LiveWriters()
atexit.register(live_writers.release_all)


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


def keeping_release(logged: list[int], row: Any) -> list[int]:
    """``logged`` (a row's words in the undo log) with LEASE_PID 0 when that lease was released
    since (its holder zeroes LEASE_PID without the lock: same state, same token). Every rollback
    keeps a release, also of this process's own change of its own leased row (journal
    invariant 10): a rollback that gave the pid back left the sequence leased to a handle that
    had let it go, until this process exited."""
    if (logged[LEASE_PID] and not row[LEASE_PID] and row[STATE] == logged[STATE]
            and row[LEASE_TOKEN] == logged[LEASE_TOKEN]):
        logged[LEASE_PID] = 0
    return logged
