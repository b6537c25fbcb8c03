"""``Sequence.wait`` and ``wait_async``: sleeping until a sequence's committed length moves.

How (docs/design.md §7: a wake-up within 3x of a pipe's, at most one idle wake-up
a second):

* The futex word is the low half of the row's LENGTH word (x86-64 is little-endian): a
  commit changes it with the one store that publishes the tokens, so no extra word is kept in
  step. A waiter reads the word, checks the length, and sleeps in ``futex(FUTEX_WAIT)`` on
  the value it read; the kernel sleeps only while the word still holds it, so a commit that
  lands in between is never missed (the call returns at once).
* Waking costs a syscall, so a writer makes it only when somebody sleeps: each row has a
  waiter count (``WAIT_OFF`` in the header, see ``_engine/table/header.py``), which waiters of
  read-write attachments raise and lower atomically (``futex.atomic_add`` on the count's low
  half: the kernel's FUTEX_WAKE_OP, no lock: a waiter woken by a commit takes no lock on its
  way out). ``commit`` reads it after publishing the length and wakes the row when it is
  nonzero; every structural change of a row (truncate, free, copy_prefix into it, a
  take-over, a restore) does the same at the end of its bracket (``Journal.changing``), so
  waiters see ``SequenceNotFound`` as soon as the sequence is freed. No commit makes a
  syscall while nobody waits.
* Read-only attachments cannot write the header (docs/design.md §4): they count their
  sleepers in the liveness file instead (``_engine/clients/row_waiters.py``), atomically too, and a
  commit wakes the row when either count is nonzero. Where they may not write that file
  (or on a store without the counts) they sleep on the same futex word with a timeout that
  doubles from 50 us to 4 ms: woken at once when a counted waiter of the row sleeps too,
  otherwise within 4 ms of the commit.
* Woken, a waiter reads the LENGTH word alone while the row's generation is still the one a
  full (seqlocked) read checked: the length a commit published, with no seqlock retry loop
  or call on the way out.
* A registered waiter sleeps at most ``_CHUNK`` seconds at a time and looks again: a waiter
  left counted by a process that died (the count is then one too high: writers make a
  needless wake-up syscall on that row) costs nothing else, and the one-in-a-billion case
  x86-64's store buffer allows (a commit's read of the count passing its store of the length
  while a waiter registers) costs at most that long. Idle: 1 / ``_CHUNK`` wake-ups a second.
* ``close()`` of the store handle wakes the handle's own sleepers (``StoreClosedError``).
* ``wait_async`` runs the same wait on a thread of its own (the event loop never blocks; a
  pool's few threads would be used up by many waiters) and, when cancelled, wakes the row so
  that thread ends.

Elsewhere than Linux x86-64 (``_futex.AVAILABLE`` False) the wait polls with the same
doubling sleeps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from shmkv._engine.clients import futex as _futex
from shmkv._engine.clients import row_waiters as _row_waiters
from shmkv._engine.checks import count
from shmkv._engine.table.header import GEN, LENGTH, SEQ_WORDS
from shmkv.errors import InvalidArgumentError, StoreClosedError, WaitTimeout

if TYPE_CHECKING:
    from shmkv._engine.port import Port


class SeqReader(Protocol):
    """What waiting needs of a sequence's reader part (``_sequence.reader.SeqReader``)."""

    port: Port
    id: int
    slot: int
    row: memoryview

    def length(self) -> int: ...

_CHUNK = 2.0  # seconds a registered waiter sleeps before it looks again (idle: 0.5 wake-ups/s)
_FIRST_SLEEP = 50e-6  # read-only and fallback waits: sleeps doubling from this
_MAX_SLEEP = 0.004  # ... up to this


class _Cancelled(Exception):
    """wait_async's task was cancelled: its thread stops waiting."""


def _timeout(timeout: object) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise InvalidArgumentError(f"timeout={timeout!r} must be a number of seconds >= 0, or None")
    return None if timeout is None else float(timeout)


def address(r: SeqReader) -> int:
    """The futex word of ``r``'s row in this process: the low half of its LENGTH word."""
    return r.port.length_addr0 + r.slot * 8 * SEQ_WORDS


def _count_word(p: Port, slot: int) -> int:
    """The address of row ``slot``'s shared waiter count, changed atomically between processes:
    the header's (read-write attachments: the low half of the int64 count, which never goes below
    0, so no borrow reaches the high half) or the liveness file's (read-only ones)."""
    return p.ro_waiters.addr0 + 4 * slot if p.readonly else p.waiters_addr0 + 8 * slot


def _register(r: SeqReader) -> int:
    """Count this thread as a waiter of the row: the shared count (atomically, no lock) and this
    handle's own. Returns the shared count's address, for ``_unregister``; 0 when none was raised
    (a read-only attachment that may not write its liveness file, or no futex: the waiter then
    polls)."""
    p = r.port
    word = _count_word(p, r.slot) if _futex.AVAILABLE and (not p.readonly or p.ro_waiters.writable) else 0
    with _row_waiters.LOCK:  # (close() takes this handle's counts off the row under it: drop_waiters)
        if p.closed:  # close() began: its drop may be over, a count raised now would stay raised
            raise StoreClosedError(f"store {p.name!r} is closed; sequence {r.id} is unusable")
        if word:
            _futex.atomic_add(word, 1)
        p.waiting[r.slot] = p.waiting.get(r.slot, 0) + 1  # (close() reads it: its drop, its wake-up)
    return word


def _unregister(r: SeqReader, word: int) -> None:
    """Take the thread's count off (``word``: what ``_register`` returned). A woken waiter runs
    this cold, before it returns: the count's address is worked out before it slept."""
    p = r.port
    with _row_waiters.LOCK:
        if p.closed:
            return  # close() took this handle's counts off the row already
        if word:
            _futex.atomic_add(word, -1)
        left = p.waiting.get(r.slot, 0) - 1
        if left > 0:
            p.waiting[r.slot] = left
        else:
            p.waiting.pop(r.slot, None)


def wait(r: SeqReader, length: int | None, timeout: float | None, cancel: threading.Event | None = None) -> int:
    """Sequence.wait (see its docstring and this module's)."""
    target = None if length is None else count("length", length)
    limit = _timeout(timeout)
    t0 = time.monotonic()
    deadline = None if limit is None else t0 + limit
    row = r.row
    seen = row[GEN]
    first = r.length()  # SequenceNotFound, StoreClosedError
    if target is not None and first >= target:
        return first
    if seen & 1 or row[GEN] != seen:
        seen = -1  # the row changed around that read: the first look of the loop is a full one
    addr = address(r)
    counted = _register(r)
    try:
        delay = _FIRST_SLEEP
        while True:
            word = row[LENGTH]  # read before the check: a commit after it changes the word
            # The length as a commit leaves it: the LENGTH word alone when the row's generation,
            # read after it, is still the one a full read (state, id, incarnation) checked: the
            # generation only grows and every structural change moves it (a commit does not), so
            # nothing changed the row in between. A full read otherwise.
            if row[GEN] == seen and not r.port.closed:
                now_len = word
            else:
                seen = row[GEN]
                now_len = r.length()
                if seen & 1 or row[GEN] != seen:
                    seen = -1
            if now_len >= target if target is not None else now_len != first:
                return now_len
            if cancel is not None and cancel.is_set():
                raise _Cancelled
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                want = f"length {target}" if target is not None else f"a change from length {first}"
                raise WaitTimeout(
                    f"wait: sequence {r.id} of store {r.port.name!r} did not reach {want} within "
                    f"timeout={timeout} s (its length is {now_len}); pass a larger timeout= or None"
                )
            left = None if deadline is None else deadline - now
            step = _CHUNK if counted else delay
            step = step if left is None else min(step, left)
            if _futex.AVAILABLE:
                _futex.wait(addr, word, step)
            else:
                time.sleep(step)
            if not counted:
                delay = min(delay * 2, _MAX_SLEEP)
    finally:
        _unregister(r, counted)


def wake_all(r: SeqReader) -> None:
    """Wake every sleeper of ``r``'s row in this machine (they look again)."""
    if _futex.AVAILABLE:
        _futex.wake(address(r))


async def wait_async(r: SeqReader, length: int | None, timeout: float | None) -> int:
    """Sequence.wait_async: wait() on a thread of its own; the event loop never blocks."""
    if length is not None:
        count("length", length)
    _timeout(timeout)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    cancel = threading.Event()

    def done(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            n = wait(r, length, timeout, cancel)
        except _Cancelled:
            return
        except BaseException as e:  # (the task's awaiter gets it)
            try:
                loop.call_soon_threadsafe(done, None, e)
            except RuntimeError:  # the loop is closed: nobody is waiting for it
                pass
            return
        try:
            loop.call_soon_threadsafe(done, n, None)
        except RuntimeError:
            pass

    thread = threading.Thread(target=run, name=f"shmkv-wait-{r.id}", daemon=True)
    thread.start()
    try:
        return await fut
    except asyncio.CancelledError:
        cancel.set()
        wake_all(r)  # the thread looks again, sees the flag, and ends
        raise
