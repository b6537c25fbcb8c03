"""THE journal of a store: the one way into the store lock, journaled transactions, the undo
log and crash recovery. Nothing else takes the structural lock or changes a row's seqlock
generation outside these brackets (tests/test_journal.py::test_only_the_journal_takes_the_store_lock
checks the first).

A process may die at any instruction (SIGKILL, OOM, a segfault) or raise any exception
(KeyboardInterrupt, CacheFullError, a bug) inside a structural operation. The protocol
below makes every such end leave the store exactly as before the operation, for every
process, whatever it does next (tests/test_journal.py runs every crash point against every
first lock holder, and every crash point armed to raise instead).

The objects and their states (as SQLite's pager.c states its own)::

    lock      free --locked()--> held --release--> free
              (locked() is the one way in: it rolls back a dead holder's transaction first)
    txn       none --transaction()/changing()--> open --end: commit | exception: rollback--> none
    row       even GEN --changing(row)--> odd GEN, logged --txn end--> even GEN, out of the log

Invariants (each names the function that keeps it):

1.  Data is never written over committed cells that a row points to: new content goes to
    cells no row points to (a fresh range; the other window buffer, see ``header.py`` WBUF; a
    range freed earlier in the same transaction is never reused by it), and rows are switched
    to it at the end (``arena.py``, ``_sequence/structural.py``, ``_snapshot``: their callers keep it).
2.  Before any word of a row changes, the row's words (and, when it changes, its meta
    record) are in the undo log and the log's count, one word, is published after the entry
    (``_log_row``, ``log_meta``). ``changing(row)`` logs the row before it makes its
    generation odd.
3.  A row changed by an open transaction keeps an odd generation until the outermost
    transaction ends (``_Change.__enter__`` makes it odd once, ``_end`` makes every logged
    row even): readers and saves see "changing" and never capture part of a transaction;
    an odd generation therefore always has its row in the log (count > 0).
4.  A transaction ends by committing (count to 0 after the rows are even: ``_end``), or, if
    an exception of any kind leaves it, by rolling back its own entries first and then
    re-raising (``_rollback``): the store is as before the operation.
5.  Whoever takes the lock through ``locked()`` and finds a non-zero count, or a
    transaction of its own left open, rolls the logged rows back (``_recover``): every
    row as it was, with an even generation above any it had, so handles reload; odd
    generations without an entry are made even too. With the lock held, the count's
    owner is dead or is this process. Cold entries (attach, restore, a locked save,
    ``shmkv verify --repair``) scan for odd generations whatever the count says.
6.  Frees inside a transaction (evictions to make room) are complete on their own: their
    rows leave the log when done (``forget``), even again, so neither a rollback nor a
    recovery resurrects a row whose cells were then reused.
7.  Readers that cannot roll back (read-only attachments) read a logged row as the rollback
    would leave it (``settled_row``), under a shared lock that excludes live writers.
8.  A row made live gets a new incarnation in its generation's bits 40.. (``new_incarnation``,
    from a header clock): handles remember it, so a handle on a freed sequence never reads
    another one that a restore gave the same id (``SeqReader.live`` checks it).
9.  Lock acquire and release are safe against an exception at any bytecode: the lock
    path is ``interrupts.critical`` and a Ctrl-C there is raised at the next safe point
    (``lock.py``'s module docstring).
10. A change of another writer's row (``changing(row, foreign=True)``: a borrow marking its
    donor LENT; a donor never changes its borrowers' rows) never
    changes the words its lease holder writes without the lock (``LOCK_FREE``: LENGTH, published by a commit;
    LEASE_PID, zeroed by a release), and neither does putting it back: the holder writes
    them even while the row is odd (``writer.kept``), so a rollback restoring the logged
    words would undo a commit that returned, or give back a lease that was released
    (``_put_back``, ``settled_row`` skip them for such entries; any rollback keeps a release:
    ``lease.keeping_release``).

Token ids, positions and hashes go with the cells (1). Counters (hits, evictions), the
recency clock, the next id and the prefix index are not rolled back: statistics, ids
never reused, and hints that lookups verify. Named crash points (``_crash.point``) let the
tests kill (or interrupt) a process at every step of every operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shmkv._engine.clients import futex as _futex
from shmkv._engine.table import header as _header
from shmkv._engine.table.header import (CAPACITY, FLAGS, GEN, LEASE_PID, LENGTH, LENT, SEQ_WORDS, SPAN_TAKEN, START,
                                        STATE)
from shmkv._engine.locking.interrupts import critical
from shmkv._engine.clients.lease import keeping_release
from shmkv._engine.locking.lock import StoreLock
from shmkv._engine.table.seqlock import odd_rows

if TYPE_CHECKING:
    from collections.abc import Callable

    from shmkv._engine.placement.free_ranges import FreeRanges
    from shmkv._engine.table.header import Layout
    from shmkv._engine.memory.intervals import Record
    from shmkv._engine.clients.row_waiters import RowWaiters
    from shmkv._engine.spans.mappings import Shares

_SLOT_MASK = (1 << 32) - 1  # undo entry word 0: the slot, and
_META_LOGGED = 1 << 32  # ... this bit when the entry holds the meta record too
_LENGTH_KEPT = 1 << 33  # ... this bit when the row is another writer's: LOCK_FREE words never put back (10)
# the row words a lease holder writes without the store lock (invariant 10): the committed length
# (writer.commit) and, set to 0, the lease's pid (a release, a write handle's finalizer: lease.py)
LOCK_FREE = (LENGTH, LEASE_PID)
_KEEP_OWN, _KEEP_FOREIGN = frozenset((GEN,)), frozenset((GEN, *LOCK_FREE))
INCARNATION_SHIFT = 40  # GEN bits 40..: the row's incarnation (invariant 8)
_W_SPANS = _header.W_SPANS  # (a module constant: read on every lock entry and transaction end)


def incarnation(gen: int) -> int:
    """The incarnation part of a generation word."""
    return gen >> INCARNATION_SHIFT


class Journal:
    """The journal of a store handle, a part the engine holds (see the module docstring).

    Per process: ``depth`` (open transaction brackets) and ``_logged`` (slots this process's
    open transaction logged and made odd); they change only with the lock held. What it
    works on is passed in: the engine's mappings, its lock, its rows, and the parts whose
    per-process state a transaction keeps current (the free-range cache, the span mappings,
    the reservation record); ``settle_span`` is the sharing part's hook, run at the end of
    every change of a row that borrows or lends (``_engine/spans/lending.py``)."""

    def __init__(self, *, readonly: bool, lock_timeout: float, layout: Layout, hdr: memoryview,
                 table_np: np.ndarray, undo_np: np.ndarray, undo: Any, meta_w: np.ndarray, meta_mv: Any,
                 lock: StoreLock, row: Callable[[int], memoryview], row_slot: dict[int, int],
                 slot_hint: dict[int, int], here: list[int], free: FreeRanges, waiters: memoryview,
                 ro_waiters: RowWaiters, length_addr0: int, shares: Shares, record: Record,
                 check_open: Callable[[], None], check_writable: Callable[[], None],
                 settle_span: Callable[[int, memoryview, tuple[int, int, int], int], None]) -> None:
        self.readonly, self.lock_timeout, self.layout = readonly, lock_timeout, layout
        self.hdr, self.table_np = hdr, table_np
        self._undo_np, self._undo, self._meta_w, self._meta_mv = undo_np, undo, meta_w, meta_mv
        self._lock = lock
        self.row = row  # the engine's rows (one memoryview a slot: ``_row_slot`` names them)
        self._row_slot, self._slot_hint = row_slot, slot_hint
        self.here = here  # this process's non-foreign changes per row (_engine/locking/own_changes.py)
        self._free = free  # this process's free ranges (_engine/placement/free_ranges.py): kept by changing
        self.waiters = waiters  # Sequence.wait's sleepers per row (woken when a transaction ends)
        self.ro_waiters = ro_waiters  # ... of read-only attachments
        self.length_addr0 = length_addr0
        self.shares = shares  # what this process has mapped of the table's spans (_engine/spans/mappings.py)
        self._record = record  # this process's reservation record: its span epoch kept in step (pages.py)
        self.check_open, self.check_writable = check_open, check_writable
        self._settle_span = settle_span
        self.depth = 0
        self._logged: dict[int, memoryview] = {}

    def _spans_current(self, depth: int) -> None:
        """At a lock entry (lock held): map the table's spans as they are now."""
        hdr = self.hdr
        if depth == 1 and not self.depth and hdr[_W_SPANS] & 1 and not hdr[_header.W_UNDO_COUNT]:
            # odd with nothing in the log: a dead holder's frees inside a larger transaction left
            # the log (invariant 6) with the spans they changed complete; the change is over
            hdr[_W_SPANS] += 1
        self.shares.sync()

    def spans_odd(self) -> None:
        """A transaction is about to change spans (lock held): the span epoch odd until it ends,
        so every other process re-maps after it (``_engine/spans/mappings.py``); this one is current."""
        hdr = self.hdr
        e = hdr[_W_SPANS]
        if not e & 1:
            hdr[_W_SPANS] = e + 1
            self.shares.applied = e + 1
            record = self._record
            if record.at == e:  # this process's own punches keep its record exact (Pages.record)
                record.at = e + 1
        self._free.tag = -1  # spans hold cells: the gaps are derived again
        hdr[_header.W_ALLOCS] += 1

    # -- the one way in ------------------------------------------------------------------

    def locked(self, scan: bool = False) -> _Entered:
        """The store lock, the one way into it for anything that changes or captures structure
        (a context manager). The outermost entry first rolls back what a dead holder left
        (invariant 5); ``scan``: also repair odd generations the count does not cover."""
        return _Entered(self, scan)

    def reading(self) -> _Reading:
        """What a reader that must wait out a structural change holds: the store lock through
        ``locked`` on a read-write attachment (which also recovers), a shared lock on a
        read-only one (no write access needed; LockTimeout after lock_timeout). Rows are then
        read with ``settled_row`` (invariant 7)."""
        return _Reading(self)

    def settled_row(self, slot: int) -> list[int]:
        """Row ``slot``'s words as a rollback would leave them (under ``reading``): the logged
        words while a dead process's transaction is in the log; the row itself otherwise, and
        while this process's own transaction is open."""
        if not self.depth:
            for i in range(self.hdr[_header.W_UNDO_COUNT]):
                if self._undo_np[i, 0] & _SLOT_MASK == slot:
                    logged: list[int] = self._undo_np[i, 1 : 1 + SEQ_WORDS].tolist()
                    if self._undo_np[i, 0] & _LENGTH_KEPT:  # (invariant 10)
                        for w in LOCK_FREE:
                            logged[w] = int(self.table_np[slot, w])
                    return keeping_release(logged, self.table_np[slot])
        words: list[int] = self.table_np[slot].tolist()
        return words

    def settled_meta(self, slot: int) -> np.ndarray:
        """Row ``slot``'s meta record (bytes) as a rollback would leave it (see settled_row)."""
        for i in range(self.hdr[_header.W_UNDO_COUNT]):
            e = self._undo_np[i]
            if e[0] & _SLOT_MASK == slot and e[0] & _META_LOGGED:
                logged: np.ndarray = e[1 + SEQ_WORDS :].view(np.uint8)
                return logged
        record: np.ndarray = self._meta_w[slot].view(np.uint8)
        return record

    # -- journaled transactions ------------------------------------------------------------

    def transaction(self) -> _Txn:
        """A journaled transaction (lock held): every row changed inside it commits together,
        or rolls back together on an exception or after a crash."""
        return _Txn(self)

    def changing(self, row: memoryview, foreign: bool = False) -> _Change:
        """Change ``row`` (lock held): it is logged and its generation made odd, once per
        transaction, and it joins the open transaction (a transaction of its own if none).
        ``foreign``: the row is another writer's and the change leaves its ``LOCK_FREE`` words
        (LENGTH, LEASE_PID) alone; a rollback then leaves them too (invariant 10)."""
        return _Change(self, row, foreign)

    def _log_row(self, slot: int, row: memoryview, foreign: bool = False) -> None:
        """Append row ``slot``'s words to the undo log (invariant 2)."""
        hdr = self.hdr
        k = hdr[_header.W_UNDO_COUNT]
        entry = self._undo[k]  # memoryview copies: a few hundred ns, on the speculative-decoding path
        entry[0] = slot | _LENGTH_KEPT if foreign else slot
        entry[1 : 1 + SEQ_WORDS] = row
        # the meta record is logged only by what changes it (_log_meta): most operations do not
        if k == 0:  # who: for `shmkv verify`'s report (recovery itself needs no pid: it holds the lock)
            hdr[_header.W_UNDO_PID] = self._lock.pid  # (the lock is held: this process's pid, no system call)
        hdr[_header.W_UNDO_COUNT] = k + 1  # published after the entry

    def _own_length(self, slot: int) -> None:
        """Row ``slot``, logged earlier in this transaction as another writer's (``foreign``), is
        now changed as a whole: its entry puts its ``LOCK_FREE`` words back too."""
        for i in range(self.hdr[_header.W_UNDO_COUNT]):
            e = self._undo_np[i]
            if e[0] & _SLOT_MASK == slot:
                e[0] &= ~_LENGTH_KEPT
                return

    def log_meta(self, slot: int) -> None:
        """Add the meta record of ``slot`` (logged by changing) to its undo entry, once."""
        for i in range(self.hdr[_header.W_UNDO_COUNT]):
            e = self._undo[i]
            if e[0] & _SLOT_MASK == slot:
                if not e[0] & _META_LOGGED:
                    e[1 + SEQ_WORDS :] = self._meta_mv[slot]
                    e[0] |= _META_LOGGED
                return

    def forget(self, *slots: int) -> None:
        """A free inside a larger transaction is complete: its rows leave the log, their
        generation even again (invariant 6)."""
        hdr = self.hdr
        for slot in slots:
            row = self._logged.pop(slot, None)
            if row is None:
                continue
            row[GEN] += 1
            self._wake(slot)
            k = hdr[_header.W_UNDO_COUNT]
            i = next(i for i in range(k) if self._undo_np[i, 0] & _SLOT_MASK == slot)
            if i != k - 1:
                self._undo_np[i] = self._undo_np[k - 1]  # the last entry moves into the gap first
            hdr[_header.W_UNDO_COUNT] = k - 1

    def _wake(self, slot: int) -> None:
        """Wake whoever sleeps in Sequence.wait on row ``slot`` (its generation moved)."""
        if self.waiters[slot] or self.ro_waiters.counts[slot]:
            _futex.wake(self.length_addr0 + slot * 8 * SEQ_WORDS)

    @critical
    def _end(self) -> None:
        """Commit the outermost transaction: its rows even, then the log empty (invariants 3, 4)."""
        for row in self._logged.values():
            row[GEN] += 1
        hdr = self.hdr
        hdr[_header.W_GENERATION] += 1
        e = hdr[_W_SPANS]
        if e & 1:  # spans changed: even again, after the rows (a reader that saw them sees it moved)
            hdr[_W_SPANS] = e + 1
            self.shares.applied = e + 1
            record = self._record
            if record.at == e:  # (see spans_odd)
                record.at = e + 1
        hdr[_header.W_UNDO_COUNT] = 0
        waiters, ro = self.waiters, self.ro_waiters.counts
        for slot in self._logged:
            if waiters[slot] or ro[slot]:  # (_wake's test, inlined: once a structural operation)
                self._wake(slot)
        self._logged.clear()

    @critical
    def _rollback(self) -> None:
        """An exception leaves the outermost transaction: put its rows back (invariant 4)."""
        self._put_back()
        self._logged.clear()

    @critical
    def _put_back(self) -> int:
        """Every logged row as it was, with an even generation above any it had; then the log
        empty. Returns the rows put back."""
        hdr = self.hdr
        k = hdr[_header.W_UNDO_COUNT]
        t = self.table_np
        for i in range(k):
            entry = self._undo_np[i]
            slot, has_meta = int(entry[0]) & _SLOT_MASK, bool(int(entry[0]) & _META_LOGGED)
            keep = _KEEP_FOREIGN if int(entry[0]) & _LENGTH_KEPT else _KEEP_OWN  # (invariant 10)
            if not 0 <= slot < self.layout.max_seqs:
                continue
            gen = max(int(entry[1 + GEN]), int(t[slot, GEN])) | 1
            row = self.row(slot)
            row[GEN] = gen  # odd while it is put back
            words = keeping_release(entry[1 : 1 + SEQ_WORDS].tolist(), row)
            for w, v in enumerate(words):
                if w not in keep:
                    row[w] = v
            if has_meta:
                self._meta_w[slot] = entry[1 + SEQ_WORDS :]
            row[GEN] = gen + 1
            self._wake(slot)
        if hdr[_header.W_SPANS] & 1:  # spans rolled back: every process (this one too) re-maps
            hdr[_header.W_SPANS] += 1
        hdr[_header.W_UNDO_COUNT] = 0
        hdr[_header.W_GENERATION] += 1
        self._free.unknown(hdr)  # ranges and states changed back: the free-range cache is stale
        self._slot_hint.clear()
        self.shares.sync()
        return int(k)

    @critical
    def _recover(self, scan: bool = True) -> int:
        """Roll back the transaction a dead process (or this one, interrupted) left (lock held);
        make odd generations even (invariant 5). Returns the rows put back."""
        self.depth = 0
        self._logged.clear()
        hdr = self.hdr
        k = hdr[_header.W_UNDO_COUNT]
        if k:
            self._put_back()
        odd = odd_rows(self.table_np[:, GEN]) if scan or k else []
        for slot in odd:
            self.row(slot)[GEN] += 1  # a bracket left open with no entry (a store of an older shmkv)
            self._wake(slot)
        if odd:
            self._free.unknown(hdr)
        if hdr[_header.W_SPANS] & 1:
            hdr[_header.W_SPANS] += 1
        if k or len(odd):
            hdr[_header.W_RECOVERIES] += 1
            hdr[_header.W_GENERATION] += 1
        return int(k)

    def new_incarnation(self, row: memoryview) -> None:
        """Give ``row`` (changing: odd) a new incarnation (invariant 8)."""
        hdr = self.hdr
        hdr[_header.W_BIRTHS] += 1
        row[GEN] = (hdr[_header.W_BIRTHS] << INCARNATION_SHIFT) | 1


class _Entered:
    """``Journal.locked()``: the one way into the store lock (a class, not a generator: see
    ``lock.py``'s note on Ctrl-C)."""

    __slots__ = ("j", "scan")

    def __init__(self, j: Journal, scan: bool) -> None:
        self.j, self.scan = j, scan

    @critical
    def __enter__(self) -> None:
        j = self.j
        j.check_writable()
        lock = j._lock
        depth = lock.acquire(j.lock_timeout)  # (lock.depth would ask getpid again: ~0.3 us)
        if depth == 1 and (self.scan or j.hdr[_header.W_UNDO_COUNT] or j.depth):
            try:
                j._recover(self.scan)
            except BaseException:
                lock.release()
                raise
        if j.hdr[_W_SPANS] != j.shares.applied:  # before anything is written (_engine/spans/mappings.py, 1)
            try:
                j._spans_current(depth)
            except BaseException:
                lock.release()
                raise

    @critical
    def __exit__(self, *exc: object) -> None:
        self.j._lock.release()


class _Reading:
    """``Journal.reading()``."""

    __slots__ = ("entered", "j")

    def __init__(self, j: Journal) -> None:
        self.j = j
        self.entered: _Entered | None = None

    @critical
    def __enter__(self) -> None:
        j = self.j
        j.check_open()
        if not j.readonly:
            self.entered = _Entered(j, False)
            self.entered.__enter__()
        else:
            j._lock.acquire(j.lock_timeout, shared=True)

    @critical
    def __exit__(self, *exc: object) -> None:
        self.j._lock.release()


class _Txn:
    """``Journal.transaction()``: a journaled transaction around several row changes."""

    __slots__ = ("j",)

    def __init__(self, j: Journal) -> None:
        self.j = j

    @critical
    def __enter__(self) -> None:
        self.j.depth += 1

    @critical
    def __exit__(self, exc_type: object, *exc: object) -> None:
        j = self.j
        j.depth -= 1
        if j.depth == 0:
            if exc_type is None:
                j._end()
            else:
                j._rollback()


class _Change:
    """``Journal.changing(row)``: one row's change inside the open transaction (or its own).
    It also keeps this process's free-range cache (``_engine/placement/free_ranges.py``: the row's range
    and state before its outermost bracket, compared at its end; inlined, on the truncate path)."""

    __slots__ = ("foreign", "j", "outer", "row", "slot", "was", "was_len")

    def __init__(self, j: Journal, row: memoryview, foreign: bool = False) -> None:
        self.j, self.row, self.outer, self.foreign = j, row, False, foreign

    @critical
    def __enter__(self) -> None:
        j, row = self.j, self.row
        j.depth += 1  # first: whatever happens next, __exit__ or a recovery ends the transaction
        slot = j._row_slot[id(row)]
        if slot not in j._logged:
            try:
                j._log_row(slot, row, self.foreign)
            except BaseException:
                self.__exit__(BaseException)
                raise
            j._logged[slot] = row
            row[GEN] += 1  # odd: readers wait (invariant 3)
        elif not self.foreign and j.hdr[_W_SPANS] & 1:  # (a foreign change made the span epoch odd)
            j._own_length(slot)
        if not self.foreign:
            j.here[slot] += 1
        if j.hdr[_W_SPANS]:  # (0: no span ever in this store, so no row borrows or lends: the common case)
            if row[SPAN_TAKEN]:  # a borrower: its span, or what it keeps taken, may change (_engine/spans/lending.py)
                j.spans_odd()
            elif row[FLAGS] & LENT:
                j._free.tag = -1
        self.slot = slot
        self.outer = j._free.brackets.setdefault(slot, was := (row[STATE], row[START], row[CAPACITY])) is was
        self.was, self.was_len = was, row[LENGTH]

    @critical
    def __exit__(self, exc_type: object, *exc: object) -> None:
        j, row = self.j, self.row
        err = None
        if self.outer:
            if exc_type is None and j.hdr[_W_SPANS] and (row[SPAN_TAKEN] or row[FLAGS] & LENT):
                try:
                    j._settle_span(self.slot, row, self.was, self.was_len)  # shared cells stay unwritten
                except BaseException as e:  # the bracket still ends (rolled back), then it propagates
                    err, exc_type = e, type(e)
            if j._free.brackets.pop(self.slot) != (row[STATE], row[START], row[CAPACITY]):
                j._free.changed(self.was, row, j.hdr)
        j.depth -= 1
        if j.depth == 0:
            if exc_type is None:
                j._end()
            else:
                j._rollback()
        if err is not None:
            raise err
