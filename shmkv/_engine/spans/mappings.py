"""Shared prefix pages, the mapping side (docs/design.md §11): a borrower's first cells are
the donor's pages, remapped in place in every process.

Design (chosen over stitching a view per process, see docs/prefix-cache.md): a sequence that
reuses a cached prefix gets its own full range as before, but its first ``m`` cells (its *span*,
``m`` a multiple of the page unit, its range and the donor's starting on one) of every full
layer's K and V (and int8 scales) are, in every process, a ``mmap(MAP_FIXED | MAP_SHARED)`` of
the data segment at the donor's cells; its own pages there are punched out (they hold no
memory). Every view stays an ordinary slice of the main arrays: ``keys``, ``append``'s views,
``torch_kv``, ``batch_kv`` and ``Batch`` are unchanged, ``np.shares_memory`` holds.

The truth is the table: row words ``SPAN_PHYS``, ``SPAN_CELLS`` (``_engine.table.header``), changed in
journaled transactions like any other word (rolled back with them). A span's physical cells
stay taken while a row borrows them (the free ranges count them, ``Arena``), however many do
(a refcount derived from the table, never stored). What a process has mapped is a pure
function of the table: ``Shares.sync`` re-applies it when the header's span epoch
(``W_SPANS``) differs from the value it applied. The epoch is made odd, by the lock holder,
before the first change of a span-bearing row in a transaction (``Journal._Change``) and
even when the transaction ends (or is rolled back), so:

1. A process re-applies the table before any read of a row's cells (``SeqReader``: the epoch is
   checked before and after the row's seqlocked read) and at every entry of the store lock
   (before a create, a lease, a structural operation writes anything): it never reads, and
   never writes, through a stale alias.
2. A transaction's own process applies its own span changes at once (``Sharing``).
3. Shared cells are never written: a borrower that truncates below its span gets private
   copies first (copy-on-write), one whose range moves (growth, remove, shift_left,
   copy_prefix) or is freed drops its span, and a donor that truncates into lent cells moves,
   or, with no free range, stays and moves before its next write there (``Sharing.settle_span``,
   run at the end of every change of such a row; ``_sequence/room.py``).
4. Cells under a borrower's committed tokens that a process may still map are not reused: a
   process re-maps only at its next read or lock entry, so after a borrower's copy-on-write
   another process's views of its committed cells still show the span's cells. Those stay
   taken (row word ``SPAN_TAKEN``) until the borrower is freed or moves, which is what
   invalidates views (docs/stores.md). The span's cells past a borrower's new length hold no
   committed token of it and are given back: a stale view of them may show another sequence.

The span epoch (header word ``W_SPANS``) and a process's mapping of it, as the journal states its
objects::

    epoch     0 (no span ever: the common case, nothing to do)
              even E --the first change of a span-bearing row in a transaction (spans_odd)--> E+1
              odd E+1 --the transaction ends: commit (_end), rollback (_put_back), or the recovery
                        after its process died (_recover, _spans_current)--> E+2
    applied   a process's ``Shares.applied``: == the epoch --the epoch moves--> stale
              stale --Shares.sync, at its next read of a row's cells or its next lock entry
                      (waiting out an odd epoch)--> == the epoch

Mapping count: a borrower costs about two mappings a shared array (2 x full layers, plus 2 x
layers of int8 scales) in every process attached; ``max_borrowers`` keeps live borrowers within
a quarter of ``vm.max_map_count``; beyond it a reuse copies as before. A process whose own
mappings leave no room for a span it would borrow (the kernel refuses: ENOMEM) copies too
(``Sharing.borrow``, ``drop_refused``); one that cannot map another process's borrower leaves
that row ``unmapped`` here, unreadable (ShareError) until a retry maps it.

A refused span is put back whatever the count: mapping an array's span in the middle of the
data segment's region costs two mappings and the kernel allows it with one free, leaving the
process one over the limit, where it refuses every mmap, the put-back of the arrays mapped
before the refusal too (merging their regions again, which gives mappings back). A process holds
one mapping in reserve for that (``Spare``): unmapped, it brings the process back to the limit,
where the put-back is allowed.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from shmkv._engine.table import header as _header
from shmkv._engine.table.header import SPAN_CELLS, SPAN_PHYS, START, STATE, LIVE
from shmkv._engine.locking.forks import renewed
from shmkv._engine.locking.interrupts import critical
from shmkv._engine.memory.intervals import take_interval
from shmkv._engine.table.seqlock import SMALL_TABLE
from shmkv._engine.spans.stitch import (LIBC, MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_SHARED, PROT_NONE, PROT_READ,
                                        PROT_WRITE, libc_mmap)
from shmkv.errors import ShareError

__all__ = ["ENABLED", "MAP_BUDGET", "SPARE", "Shares", "Spare", "max_borrowers"]

PAGE = mmap.PAGESIZE
_PUNCH = 3  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_fallocate = LIBC.fallocate
_fallocate.restype = ctypes.c_int
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_munmap = LIBC.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

_SPIN = 2000


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


# The mappings live borrowers may cost a process: a quarter of vm.max_map_count (65,530 by
# default), the rest left to the interpreter, its libraries and the segments themselves.
MAP_BUDGET = _max_map_count() // 4


# Reuses borrow when True; False makes them copy as before (a switch for tests and benchmarks:
# the copied reference a borrower is compared with, the baseline a sharing figure is a ratio of).
ENABLED = os.environ.get("SHMKV_SHARE", "1") != "0"


def max_borrowers(arrays: int) -> int:
    """Live borrowers a store allows when a span covers ``arrays`` per-layer arrays (two
    mappings each, in every process); a reuse beyond it copies (all of them when sharing is
    off: ``ENABLED``)."""
    return MAP_BUDGET // max(2 * arrays, 1) if ENABLED else 0


_FIX = ("raise the limit (sysctl -w vm.max_map_count=262144), let this process hold fewer mappings "
        "(drop views, close other stores), or run with SHMKV_SHARE=0 (reuses copy instead of sharing)")


Want = dict[int, tuple[int, int, int]]  # slot -> (start, physical start, cells)
_NO_REFUSAL = ShareError(errno.ENOMEM, os.strerror(errno.ENOMEM))  # ``refused`` until the kernel refuses one

# Every live Shares, so a forked child can replace their locks: a thread of the parent may have
# held one at the fork (inside sync/apply), and the child's copy would stay held by a thread it
# does not have, hanging its first read.
_LIVE: weakref.WeakSet[Shares] = weakref.WeakSet()


class Spare:
    """The mapping a process holds in reserve to put cells' own pages back (see the module
    docstring): one page of anonymous shared memory, PROT_NONE (no memory; never merged with a
    neighbour, so unmapping it gives one mapping back; a forked child inherits it).

    ``put_back`` gives it up for a put-back the kernel refused (ENOMEM) and takes it again once
    that put-back is done, or, if it failed even so, after the next one that succeeds
    (``Shares._map``): a put-back gives two mappings back (or, over the array's own pages, none,
    and then it needed one free), so taking the spare again never takes the process over the
    limit."""

    def __init__(self) -> None:
        self.addr = 0  # (0: none held)
        self.lock = threading.Lock()

    def keep(self) -> None:
        """Map the spare if this process holds none (none if the kernel refuses)."""
        with self.lock:
            self._keep()

    def _keep(self) -> None:
        if not self.addr:
            got = libc_mmap(None, PAGE, PROT_NONE, MAP_SHARED | MAP_ANONYMOUS, -1, 0)
            if got not in (None, MAP_FAILED):
                self.addr = got

    def put_back(self, args: tuple[int, int, int, int, int, int]) -> Any:
        """``libc_mmap(*args)`` (an array's own pages mapped back; the kernel refused it already)
        with the spare unmapped; the spare mapped again if it succeeded. MAP_FAILED (errno ENOMEM
        as the kernel gave it) when this process holds no spare."""
        with self.lock:
            addr, self.addr = self.addr, 0
            if not addr or _munmap(addr, PAGE) != 0:
                self.addr = addr
                return MAP_FAILED
            got = libc_mmap(*args)
            if got not in (None, MAP_FAILED):
                self._keep()
            return got


SPARE = Spare()
renewed(SPARE, "lock")  # (free again in a forked child)


def _after_fork_in_child() -> None:
    for shares in list(_LIVE):
        shares.lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Shares:
    """What one store handle has mapped of the table's spans (see the module docstring).

    ``pieces``: (byte offset of cell 0, bytes a cell) of every array a span covers. Holds a
    view of the data mapping (``anchor``: its addresses stay mapped while this object lives,
    so a remap never lands in unmapped address space) and a descriptor of its own."""

    @critical  # (a Ctrl-C as the descriptor is duplicated, before it is kept, waits)
    def __init__(self, hdr: memoryview, table: np.ndarray, mm: Any, fd: int, pieces: list[tuple[int, int]], *,
                 readonly: bool, reserved: tuple[list[tuple[int, int]], ...], owed: list[tuple[int, int]],
                 base: int) -> None:
        self.hdr, self.table = hdr, table
        self.anchor = np.frombuffer(mm, np.uint8)
        self.base = base  # the address of the mapping's byte 0
        self.fd = os.dup(fd)
        self.pieces = pieces
        self.prot = PROT_READ | (0 if readonly else PROT_WRITE)
        self.reserved, self.owed = reserved, owed
        # the epoch whose table this process has mapped (-1: nothing yet); epoch 0 is a store that
        # never had a span (a span is made in a transaction that first makes the epoch odd), whose
        # table this process has mapped already: an attach's span sync then finds nothing to do
        self.applied = 0 if hdr[_header.W_SPANS] == 0 else -1
        self.cur: Want = {}  # spans mapped here
        # spans wanted and not mapped here (the kernel refused: vm.max_map_count): their rows
        # are unreadable in this process until a retry maps them (readable); ``dirty``: of those,
        # the ones whose cells may show neither their own pages nor the span (a revert failed)
        self.unmapped: Want = {}
        self.dirty: set[int] = set()
        self.refused = _NO_REFUSAL  # the last refusal
        self.lock = threading.RLock()
        _LIVE.add(self)
        SPARE.keep()

    @property
    def on(self) -> bool:
        """Whether this store lends prefix pages at all (``ENABLED``, and arrays to share): a range
        that may lend them starts on a page unit (docs/design.md §11)."""
        return ENABLED and bool(self.pieces)

    def __del__(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)

    # -- the mappings ------------------------------------------------------------------------

    def remap(self, start: int, phys: int, m: int) -> None:
        """Cells [start, start + m) of every shared array show cells [phys, phys + m) (``phys ==
        start``: their own pages again). On a refusal (ShareError) the arrays mapped before it
        are put back to their own pages (``err.clean``: they were; False: they may not be)."""
        if m <= 0:
            return
        with self.lock:
            if self.fd < 0:
                return
            for spans in (*self.reserved, self.owed):  # (first: an exception below forgets nothing)
                take_interval(spans, start, start + m)  # its own pages may be holes now: reserve again
            done = self._map(start, phys, m, self.pieces)
            if done < len(self.pieces):
                no = ctypes.get_errno()
                n = m * self.pieces[done][1]
                clean = phys == start or self._map(start, start, m, self.pieces[:done]) == done
                err = ShareError(no, f"cannot map {n} bytes of shared prefix pages: {os.strerror(no)} (too many "
                                 f"mappings for vm.max_map_count={_max_map_count()}?); {_FIX}")
                err.clean = clean
                raise err

    def _map(self, start: int, phys: int, m: int, pieces: list[tuple[int, int]]) -> int:
        """Map cells [phys, phys + m) at cells [start, start + m) of each of ``pieces``; how many were."""
        for i, (off, cb) in enumerate(pieces):
            addr = self.base + off + start * cb
            args = (addr, m * cb, self.prot, MAP_SHARED | MAP_FIXED, self.fd, off + phys * cb)
            got = libc_mmap(*args)
            if got != addr and phys == start and ctypes.get_errno() == errno.ENOMEM:
                got = SPARE.put_back(args)  # (one over the limit: Spare)
            if got in (None, MAP_FAILED) or got != addr:
                return i
        if phys == start and pieces and not SPARE.addr:
            SPARE.keep()  # (given up for a put-back that failed even so: this one gave mappings back)
        return len(pieces)

    def punch(self, start: int, m: int, *, holes: bool = False) -> None:
        """Give back the memory of cells [start, start + m)'s own pages in every shared array
        (``holes``: there are none, cells above the page mark: nothing to give back)."""
        for spans in (*self.reserved, self.owed):  # (first: an exception below forgets nothing)
            take_interval(spans, start, start + m)
        for off, cb in () if holes else self.pieces:
            if _fallocate(self.fd, _PUNCH, off + start * cb, m * cb) != 0:
                no = ctypes.get_errno()
                raise ShareError(no, f"cannot punch out {m * cb} bytes of a borrower's pages: {os.strerror(no)}")

    def wanted(self, rows: Callable[[int], Any] | None = None) -> Want:
        """The spans of the table (or of ``rows(slot)``, the rows as a rollback leaves them)."""
        t = self.table
        if rows is None:
            # the rows with a span, from one copy of the column (other processes write the table
            # meanwhile, and numpy's nonzero on the live column raises when the count changes between
            # its two passes): a small table's as a list, a large one's by nonzero (no comparison
            # ufunc: cold in a fresh process, and a forked child's first numpy calls copy parent pages)
            col = t[:, SPAN_CELLS]
            idx = [i for i, c in enumerate(col.tolist()) if c] if len(col) <= SMALL_TABLE else col.copy().nonzero()[0]
            return {int(s): (int(t[s, START]), int(t[s, SPAN_PHYS]), int(t[s, SPAN_CELLS])) for s in idx
                    if t[s, STATE] == LIVE and t[s, SPAN_CELLS] > 0}
        out: Want = {}
        for s in range(len(t)):
            r = rows(s)
            if r[STATE] == LIVE and r[SPAN_CELLS] > 0:
                out[s] = (r[START], r[SPAN_PHYS], r[SPAN_CELLS])
        return out

    def apply(self, want: Want) -> None:
        """Map what ``want`` says, undoing what is mapped and no longer wanted. A span the kernel
        refuses (``vm.max_map_count``) leaves its row ``unmapped`` here, not the others.

        Every change of a row's mapping is recorded before the kernel is asked (the row
        ``unmapped`` and ``dirty`` until it is done): an exception between two arrays' mappings
        (a Ctrl-C lands after any C call) leaves a row this process knows may show neither its
        own pages nor the span, put back by the next ``apply`` (the rollback's, or the next
        sync's), never a half-made mapping recorded nowhere."""
        with self.lock:
            cur, un = self.cur, self.unmapped
            for slot, (start, phys, m) in list(cur.items()):
                if want.get(slot) != (start, phys, m):
                    self._unmap(slot)  # (raises only if its own pages cannot come back)
            for slot, (start, phys, m) in list(un.items()):
                if want.get(slot) != (start, phys, m):
                    if slot in self.dirty:
                        self.remap(start, start, m)
                        self.dirty.discard(slot)
                    del un[slot]
            for slot, span in want.items():
                if slot not in cur:
                    self.place(slot, span)

    def _unmap(self, slot: int) -> None:
        """Put ``slot``'s own pages back under its mapped span (lock held; recorded first, see
        ``apply``)."""
        start, _, m = span = self.cur[slot]
        self.unmapped[slot] = span  # (before it leaves cur: an exception between them forgets nothing)
        self.dirty.add(slot)
        del self.cur[slot]
        self.remap(start, start, m)
        del self.unmapped[slot]
        self.dirty.discard(slot)

    def place(self, slot: int, span: tuple[int, int, int]) -> bool:
        """Map ``slot``'s wanted span; if the kernel refuses, leave the row ``unmapped`` (its
        cells here are its own punched pages, holes: never read as the row's) and return False."""
        was_dirty = slot in self.dirty
        self.unmapped[slot] = span  # (recorded first, see apply)
        self.dirty.add(slot)
        try:
            self.remap(*span)
        except ShareError as err:
            if err.clean and not was_dirty:  # every array it mapped is its own pages again
                self.dirty.discard(slot)
            self.refused = err
            return False
        self.cur[slot] = span  # (first: recorded somewhere at every point)
        del self.unmapped[slot]
        self.dirty.discard(slot)
        return True

    def set(self, slot: int, span: tuple[int, int, int] | None) -> None:
        """This process's own change of one row's span (lock held, epoch odd): map it now (a
        refusal raises ShareError: the transaction rolls back)."""
        with self.lock:
            if slot in self.cur:
                self._unmap(slot)
            was = self.unmapped.get(slot)
            if was is not None and slot in self.dirty:
                self.remap(was[0], was[0], was[2])
            self.unmapped.pop(slot, None)
            self.dirty.discard(slot)
            if span is not None and not self.place(slot, span):
                no = self.refused.errno or errno.ENOMEM
                raise ShareError(no, f"this process (pid {os.getpid()}) cannot map a span of {span[2]} shared "
                                 f"prefix cells ({os.strerror(no)}: too many memory mappings for "
                                 f"vm.max_map_count={_max_map_count()}); {_FIX}")

    def drop_refused(self, slot: int) -> bool:
        """Forget the span ``set`` could not map for this process's own change of ``slot`` (the
        change copies it instead: ``Sharing.borrow``). True when the row's cells here show its
        own pages again; False when they may not and cannot be put back now (``dirty``): the
        row then stays ``unmapped`` here, put back by the next ``apply``, and the change fails."""
        with self.lock:
            span = self.unmapped.get(slot)
            if slot in self.dirty:
                if span is None:  # (what set could not put back came before the new span)
                    return False
                try:
                    self.remap(span[0], span[0], span[2])
                except ShareError:
                    return False
                self.dirty.discard(slot)
            self.unmapped.pop(slot, None)
            return True

    # -- reads of rows whose span is not mapped here ------------------------------------------

    def readable(self, slot: int, what: str) -> None:
        """Raise ShareError unless ``slot``'s cells show what the table says in this process (a
        row ``unmapped`` here is mapped again first, if the kernel lets it now). ``what``: the
        sequence, for the message. Callers test ``unmapped`` first (empty: nothing to do)."""
        with self.lock:
            span = self.unmapped.get(slot)
            if span is None or self.place(slot, span):
                return
            err = self.refused
        raise ShareError(
            errno.ENOMEM,
            f"{what} borrows {span[2]} cells of shared prefix pages that this process (pid {os.getpid()}) "
            f"cannot map ({os.strerror(err.errno or errno.ENOMEM)}: it holds too many memory mappings for "
            f"vm.max_map_count={_max_map_count()}); {_FIX}. Its cells were not read; the next read tries again")

    def sources(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Where a copy reads main-arena cells [lo, hi) of the shared arrays in this process:
        (first cell, the cell it is read at, count) pieces in order. Cells of a span not mapped
        here (``unmapped``) are read at their physical cells, which lie in no span (chains
        resolve to them: ``Sharing.lend``), so a copy from a borrower this process cannot map
        never reads holes, nor raises; every other cell is read in place."""
        out: list[tuple[int, int, int]] = []
        for start, phys, m in sorted(self.unmapped.values()):
            a, b = max(lo, start), min(hi, start + m)
            if a < b:
                if lo < a:
                    out.append((lo, lo, a - lo))
                out.append((a, phys + a - start, b - a))
                lo = b
        if lo < hi:
            out.append((lo, lo, hi - lo))
        return out

    # -- following the table -----------------------------------------------------------------

    def sync(self, reading: Callable[[], AbstractContextManager[None]] | None = None,
             settled: Callable[[int], Any] | None = None) -> None:
        """Map the table's spans if the epoch moved since this process last did (waiting out a
        transaction that changes spans: its epoch is odd). ``reading``: the fallback after
        ``_SPIN`` tries (the store lock, whose entry syncs; a read-only attachment's shared
        lock, then ``settled`` rows: a dead writer's transaction as its rollback leaves it)."""
        hdr = self.hdr
        for i in range(_SPIN):  # (the lock only around a re-map: a spinning reader never holds it)
            e = hdr[_header.W_SPANS]
            if e == self.applied:
                return
            if not e & 1:
                with self.lock:
                    self.apply(self.wanted())
                    if hdr[_header.W_SPANS] == e:
                        self.applied = e
                        return
            if reading is None:
                break
            if i > 50:
                time.sleep(0)
        if reading is not None:
            with reading():  # a read-write attachment's lock entry synced; a read-only one:
                if hdr[_header.W_SPANS] != self.applied:
                    with self.lock:
                        self.apply(self.wanted(settled))
                        self.applied = hdr[_header.W_SPANS]

    @critical  # (the descriptor forgotten and closed at once)
    def close(self) -> None:
        with self.lock:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)
