"""Pages a tmpfs file holds in a byte range, by the cachestat(2) system call (Linux 6.5+), for
``Segment.check_room``'s count of the pages a reservation still needs.

Why not SEEK_HOLE/SEEK_DATA: on tmpfs they report a page that was allocated (posix_fallocate)
but never written as a hole (the kernel's seek looks at whether a page is up to date, and a
fallocated page is not until written or faulted: measured on Linux 6.18, and the code is the
same since tmpfs learnt SEEK_HOLE), and mincore(2) says the same. Such a page is in use all the
same (tmpfs counts it as used, memory as Shmem): counting it as missing counted it twice, and
a reservation over pages another process (or a reservation not yet written) had fallocated
could be refused on a nearly full /dev/shm although it needed nothing. cachestat counts every
page in the file's page cache, written or not, and swapped-out pages as evicted: both are
allocated (tests/test_unallocated.py).

Linux x86-64, arm64 and the other architectures that share the generic numbering (451 for
cachestat); elsewhere, on older kernels or where a seccomp profile refuses it, ``pages`` is
None and the caller walks holes (an overcount of fallocated, unwritten pages: a refusal there
may be early, never late).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import platform
import sys
from typing import Any

__all__ = ["pages"]

_SYS_CACHESTAT = 451  # the same number on every architecture with the unified table (not alpha)
_MACHINES = ("x86_64", "AMD64", "aarch64", "arm64", "riscv64", "ppc64le", "ppc64", "s390x", "loongarch64")
PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


def _syscall() -> Any:
    if sys.platform != "linux" or platform.machine() not in _MACHINES:
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):  # pragma: no cover - a libc without symbols
        return None
    f.restype = ctypes.c_long
    f.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return f


_CALL: list[Any] = [False]  # False: not looked up yet (at the first call, not at import); None: not
# available (or ENOSYS once: not tried again in this process)


def pages(fd: int, offset: int, length: int) -> int | None:
    """Pages of file ``fd`` in ``[offset, offset + length)`` (``length`` > 0) that exist: in
    the page cache (written or only allocated) or swapped out. None when cachestat is not
    available here (see the module docstring)."""
    call = _CALL[0]
    if call is False:
        call = _CALL[0] = _syscall()
    if call is None:
        return None
    rng, st = _Range(offset, length), _Stat()
    if call(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        if ctypes.get_errno() == errno.ENOSYS:  # before 6.5 (or a seccomp profile saying so)
            _CALL[0] = None  # the same at every call: not tried again
        return None  # EPERM (a seccomp profile, a file we may not write), EBADF: this call
    return int(st.nr_cache + st.nr_evicted)
