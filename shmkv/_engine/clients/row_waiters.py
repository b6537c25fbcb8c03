"""Read-only attachments' sleepers in ``Sequence.wait``, counted where they can write.

A commit wakes a row's sleepers only when some are counted (no syscall otherwise:
``_sequence/waiting.py``). Read-write waiters count themselves in the header (``WAIT_OFF``),
atomically; a read-only attachment maps the header read-only and cannot. So the
liveness file (``skv_<name>.live``, see ``_engine/clients/liveness.py``), whose bytes are otherwise only
lock targets, holds in its content one 32-bit count per table row of read-only sleepers:

    offset 4 * row     int32    read-only attachments' threads sleeping on the row

A read-only waiter opens the file for writing (it has the segments' mode: the store's owner,
and its group when the store was created with ``mode=0o660``, may), maps the counts shared
and raises and lowers its row's count with an atomic add (``futex.atomic_add``: no lock is
involved, the store lock stays the writers'). Every attachment maps the counts (read-only
when it may not write the file), and a commit or a structural change wakes the row when
either count is nonzero.

The file is sized by ``create`` (zeroed: a leftover of ours may hold old counts) and removed
with the store, as before (``shmkv rm``, gc, ``shmkv ls``/``doctor`` know the liveness file).
A store whose file has no counts (made by an older shmkv) or a reader who may not write the
file: read-only waiters poll with sleeps growing to 4 ms, as they once all did. A waiter
that dies while counted leaves the count one too high: writers then make a needless
wake-up syscall on that row (the row's next sleepers are not delayed).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from shmkv._engine.clients import futex as _futex
from shmkv._engine.clients import liveness as _liveness
from shmkv._engine.locking.forks import renewed
from shmkv._engine.locking.interrupts import critical

_PAGE = mmap.PAGESIZE
# this process's changes of read-only counts, and of a handle's ``waiting`` with them, against a
# close() in another thread (``_sequence/waiting.py``, ``RowWaiters.drop``)
LOCK: threading.Lock = renewed(globals(), "LOCK")  # (free again in a forked child)


def file_bytes(rows: int) -> int:
    """The liveness file's size with the counts of ``rows`` table rows (whole pages)."""
    return -(-4 * rows // _PAGE) * _PAGE


def prepare(fd: int, rows: int) -> None:
    """A new store's counts, all zero, in its liveness file (descriptor ``fd``, read-write)."""
    os.ftruncate(fd, 0)
    os.ftruncate(fd, file_bytes(rows))


class RowWaiters:
    """One attachment's map of store ``name``'s read-only waiter counts (see the module docstring).

    ``counts[row]``: the count (an int32 memoryview: what writers read on commit);
    ``writable``: whether this attachment may change them (``add``)."""

    # (no __slots__: close() finds the counts' mapping through the instance dict and drops it)

    @critical  # (a Ctrl-C as the file is opened, before it is mapped and closed, waits)
    def __init__(self, name: str, rows: int) -> None:
        self.writable = False
        self.addr0 = 0
        mm = None
        for flags, prot in ((os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE), (os.O_RDONLY, mmap.PROT_READ)):
            try:
                fd = os.open(_liveness.live_path(name), flags | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:  # (mmap refuses a file shorter than the map: ValueError)
                mm = mmap.mmap(fd, file_bytes(rows), mmap.MAP_SHARED, prot)
            except (OSError, ValueError):
                mm = None
            finally:
                os.close(fd)  # (the mapping keeps the file)
            if mm is not None:
                self.writable = bool(prot & mmap.PROT_WRITE) and _futex.AVAILABLE
                break
            if flags == os.O_RDWR:
                break  # opened, but no counts in it: a store of an older shmkv
        if mm is None:  # nothing to count in: nobody is counted, read-only waiters poll
            self.counts = memoryview(bytearray(4 * rows)).cast("i")
            return
        self.counts = memoryview(mm).cast("i")
        if self.writable:
            self.addr0 = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def add(self, row: int, delta: int) -> None:
        """Change row ``row``'s count by ``delta``, atomically between processes (``writable``)."""
        _futex.atomic_add(self.addr0 + 4 * row, delta)

    def drop(self, waiting: dict[int, int]) -> None:
        """close() of a read-only attachment (closed already): its sleepers (``waiting``: row ->
        threads) off the counts; they end with StoreClosedError without touching the store
        again (a sleeper that looked before holds ``LOCK`` while it takes its own count off)."""
        with LOCK:
            for row, n in waiting.items():
                self.add(row, -n)
