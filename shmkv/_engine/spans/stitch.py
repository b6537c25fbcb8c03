"""Stitched views: one contiguous numpy array over pages taken from several places of a file
(docs/design.md §11, the mechanism of shared prefix pages).

A sequence that borrows a donor's first cells reads them in place: a process reserves an address
range (``mmap`` PROT_NONE, anonymous, no memory), maps the donor's pages and then its own pages
into it with ``MAP_FIXED | MAP_SHARED`` on the data segment's descriptor, and makes one numpy
array over the whole range. The array reads and writes the segment's bytes like any view of it:
a write through it is seen by every other view of those pages, in every process.

Lifetime: a ``Stitch`` owns its address range. Arrays made over it (``array()``, and every view
or torch tensor made from those) hold it through their ``base`` chain, so the range is unmapped
when the last of them is gone, never under a live view (docs/design.md §4: no segfault). A
``StitchCache`` keeps a process's views by key, bounded (``CACHE_LIMIT``). ``live()``
counts the stitches of this process that are still mapped: what a cache of stitched views keeps
bounded, against the kernel's ``vm.max_map_count`` (65530 by default; a stitch of p pieces costs
at most p of them).

Pieces must start on page boundaries of the file and, but for the last, be whole pages long; the
last is mapped rounded up to a page (the array may end inside it).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from shmkv._engine.locking.forks import renewed
from shmkv.errors import InvalidArgumentError, ShmkvError

PAGE = mmap.PAGESIZE
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value

LIBC = ctypes.CDLL(None, use_errno=True)
libc_mmap = LIBC.mmap
libc_mmap.restype = ctypes.c_void_p
libc_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_munmap = LIBC.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

_count_lock: threading.Lock = renewed(globals(), "_count_lock")  # (free again in a forked child)
_live = 0


class StitchError(ShmkvError, OSError):
    """The kernel refused a stitched mapping (out of address space or of ``vm.max_map_count``)."""


def live() -> int:
    """Stitches of this process still mapped (each unmapped when its last array is gone)."""
    return _live


def _count(d: int) -> None:
    global _live
    with _count_lock:
        _live += d


class Stitch:
    """A reserved address range with file pieces mapped one after another into it.

    ``pieces``: (file offset, bytes) in the order they appear in the range. ``writable``: map
    them PROT_READ | PROT_WRITE (the descriptor must be open for writing), else PROT_READ.
    """

    __slots__ = ("__weakref__", "addr", "nbytes", "readonly")

    def __init__(self, fd: int, pieces: list[tuple[int, int]], writable: bool = True) -> None:
        self.addr = 0  # nothing to unmap until the whole range is mapped
        if not pieces:
            raise InvalidArgumentError("Stitch: pieces=[] is empty; give at least one (offset, bytes) piece")
        try:
            end = os.fstat(fd).st_size
        except OSError as err:
            raise StitchError(err.errno, f"Stitch: descriptor fd={fd} is not an open file: {err.strerror}") from None
        sizes = []
        for i, (off, n) in enumerate(pieces):
            last = i == len(pieces) - 1
            size = -(-n // PAGE) * PAGE
            if off < 0 or off % PAGE or n <= 0 or (not last and n % PAGE) or off + size > -(-end // PAGE) * PAGE:
                raise InvalidArgumentError(
                    f"Stitch: piece {i} (offset={off}, bytes={n}) must start on a page boundary ({PAGE} bytes),"
                    f" be whole pages long but for the last piece, and lie within the file's {end} bytes"
                )
            sizes.append(size)
        self.nbytes = sum(sizes)
        self.readonly = not writable
        addr = libc_mmap(None, self.nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr in (None, MAP_FAILED):
            no = ctypes.get_errno()
            raise StitchError(no, f"Stitch: cannot reserve {self.nbytes} bytes of address space: {os.strerror(no)}")
        prot = PROT_READ | (PROT_WRITE if writable else 0)
        at = addr
        for (off, _), size in zip(pieces, sizes, strict=True):
            got = libc_mmap(at, size, prot, MAP_SHARED | MAP_FIXED, fd, off)
            if got != at:
                no = ctypes.get_errno()
                _munmap(addr, self.nbytes)
                raise StitchError(
                    no, f"Stitch: cannot map {size} bytes at file offset {off}: {os.strerror(no)} (too many "
                    "mappings? see vm.max_map_count; drop stitched views no longer used)"
                )
            at += size
        self.addr = addr
        _count(1)

    def __del__(self) -> None:
        if self.addr:
            _munmap(self.addr, self.nbytes)
            self.addr = 0
            _count(-1)

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, self.readonly), "version": 3}

    def array(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A C-contiguous array of ``dtype`` and ``shape`` from byte ``offset`` of the range; its
        base chain holds this stitch (so it stays mapped while the array lives)."""
        raw = np.asarray(self)  # base: self
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offset < 0 or offset + n > self.nbytes:
            raise InvalidArgumentError(
                f"Stitch.array: {n} bytes from offset {offset} do not fit the {self.nbytes} stitched bytes"
            )
        out: np.ndarray = raw[offset : offset + n].view(dt).reshape(shape)
        return out


# A process holds at most this many cached stitches: with pieces of a span and an own range,
# 2 * 8,192 = 16,384 mappings, a quarter of the kernel's default vm.max_map_count (65,530),
# leaving the rest to the interpreter, its libraries and the store's own segments.
CACHE_LIMIT = 8192


class StitchCache:
    """Stitched views of one process, by key (for a sequence: its row, the row's generation and
    the layer), least recently used dropped first beyond ``limit``.

    The cache holds arrays, not mappings: dropping an entry drops the cache's reference only, so
    a view a caller still holds stays mapped (and readable) until the caller lets it go.
    """

    def __init__(self, limit: int = CACHE_LIMIT) -> None:
        if limit < 1:
            raise InvalidArgumentError(f"StitchCache: limit={limit} must be at least 1")
        self.limit = limit
        self._views: dict[tuple[int, ...], np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._views)

    def get(self, key: tuple[int, ...], build: Callable[[], np.ndarray]) -> np.ndarray:
        """The view cached under ``key``, else ``build()``'s (cached, the oldest dropped past the limit)."""
        with self._lock:
            a = self._views.pop(key, None)
            if a is not None:
                self._views[key] = a  # most recent last
                return a
        a = build()
        with self._lock:
            self._views[key] = a
            while len(self._views) > self.limit:
                del self._views[next(iter(self._views))]
        return a

    def release(self, first: int) -> None:
        """Drop every view whose key starts with ``first`` (a row freed, a handle closed)."""
        with self._lock:
            for k in [k for k in self._views if k[0] == first]:
                del self._views[k]

    def clear(self) -> None:
        with self._lock:
            self._views.clear()
