"""The page mark of a store whose header has none: one written by an older shmkv (review
finding 1f of issue 23).

The page mark (header word ``W_PAGE_MARK``, ``free_ranges.mark_pages``) bounds the cells that
may hold pages of the arrays a span covers; a borrow at or above it skips its punch. Older
shmkv versions left the word reserved, zero: there every borrow would skip its punch (its own
pages held beside the donor's while the span lives), and the first raise of the mark would
come from a write handle's lock-free ``room``. So the first read-write attach of such a store,
which holds the store lock (``Core.register_client``), sets it from what may have pages:

* the live rows' ranges and the spans: the table tells their ends;
* cells of rows freed, moved or rolled back before (pages stay): the table cannot tell where
  they were, the kernel can. ``cachestat`` (Linux 6.5) counts the pages of a byte range of the
  data segment, those allocated by fallocate and never written included (``SEEK_DATA`` and
  ``mincore`` miss those: tmpfs keeps them not up to date until written), so a bisection finds
  the end of the last cell with pages in each array a span covers. Nothing outside the live
  ranges gets pages while the lock is held, so the answer holds;
* where the kernel cannot tell (a kernel before 6.5, a seccomp filter that refuses the call,
  another platform), the arena's whole size: a mark too high only costs punches (every borrow
  punches, as before the mark existed), one too low holds memory twice.

A store with no row ever made live (the births counter at 0) has no pages there: its 0 is right.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import numpy as np

from shmkv._engine import header as _header
from shmkv._engine.free_ranges import mark_pages
from shmkv._engine.header import CAPACITY, SPAN_CELLS, SPAN_PHYS, START, STATE

__all__ = ["pages_in", "settle_mark"]

# cachestat(2): the same number on x86-64 and on the architectures of the generic table
_SYS_CACHESTAT = 451 if sys.platform == "linux" and os.uname().machine in ("x86_64", "aarch64") else -1


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)


def pages_in(fd: int, off: int, n: int) -> int:
    """Pages of the tmpfs file ``fd`` that hold any of bytes [off, off + n) (n > 0): in memory,
    allocated or not yet written, or swapped out. OSError when the kernel cannot tell."""
    if _SYS_CACHESTAT < 0:
        raise OSError(errno.ENOSYS, f"cachestat is not known on {sys.platform} {os.uname().machine}")
    rng, st = _Range(off, n), _Stat()
    if _libc.syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(st),
                     ctypes.c_uint(0)) != 0:
        no = ctypes.get_errno()
        raise OSError(no, f"cachestat: {errno.errorcode.get(no, no)}")
    return int(st.cache + st.evicted)  # (a shmem page in swap counts as evicted)


def _end_of_pages(fd: int, off: int, cb: int, lo: int, hi: int) -> int:
    """The smallest cell c in [lo, hi] such that no page holds bytes of cells [c, hi) of the array
    at ``off`` (``cb`` bytes a cell)."""
    if lo >= hi or not pages_in(fd, off + lo * cb, (hi - lo) * cb):
        return lo
    has, free = lo, hi  # cells from ``has`` on hold pages; from ``free`` on none
    while free - has > 1:
        mid = (has + free) // 2
        if pages_in(fd, off + mid * cb, (hi - mid) * cb):
            has = mid
        else:
            free = mid
    return free


def settle_mark(hdr: memoryview, table: np.ndarray, fd: int, pieces: list[tuple[int, int]], cells: int) -> None:
    """Set a zero page mark from the table and the data segment (lock held; see the module
    docstring). ``table``: the sequence table, ``fd``: the data segment's descriptor,
    ``pieces``: (offset, bytes a cell) of each array a span covers, ``cells``: max_tokens."""
    if hdr[_header.W_PAGE_MARK] or not hdr[_header.W_BIRTHS]:
        return
    mark = 0
    rows = table[table[:, STATE] != 0]
    if len(rows):
        mark = int((rows[:, START] + rows[:, CAPACITY]).max())
        spans = rows[rows[:, SPAN_CELLS] > 0]
        if len(spans):
            mark = max(mark, int((spans[:, SPAN_PHYS] + spans[:, SPAN_CELLS]).max()))
    mark = min(max(mark, 0), cells)  # (a table an overwrite damaged: ``shmkv verify`` tells)
    try:
        for off, cb in pieces:
            mark = _end_of_pages(fd, off, cb, mark, cells)
    except OSError:
        mark = cells
    mark_pages(hdr, mark)
