"""Linux futex(2) on shared memory, through ctypes: how ``Sequence.wait`` sleeps until a commit.

A futex word is any aligned 32-bit word of a shared mapping. ``wait(addr, expected, timeout)``
sleeps while the word still holds ``expected`` (the kernel compares and sleeps atomically, so
a change made between the caller's read and the call is never missed: the call returns at
once); ``wake(addr)`` wakes every sleeper on the word. The private flag is not used: the
memory is shared between processes, and a private futex is keyed by the process's own
address space. Shared futexes are keyed by the mapped file and offset, so processes that map
the segment at different addresses (fork, spawn, forkserver, other programs) meet on the
same word.

Supported where shmkv is (Linux x86-64, DESIGN.md section 3); elsewhere ``AVAILABLE`` is
False and ``Sequence.wait`` polls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

FUTEX_WAIT = 0
FUTEX_WAKE = 1
_SYS_FUTEX = 202  # x86-64
_INT_MAX = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)  # CDLL: the call releases the GIL
    except OSError:  # pragma: no cover - a libc without symbols
        return None


_LIBC = _libc()
AVAILABLE = _LIBC is not None and os.environ.get("SHMKV_NO_FUTEX", "") == ""
if _LIBC is not None:
    _syscall = _LIBC.syscall
    _syscall.restype = ctypes.c_long
    _syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def wait(addr: int, expected: int, timeout: float | None) -> bool:
    """Sleep while the 32-bit word at ``addr`` holds ``expected`` (its low 32 bits), at most
    ``timeout`` seconds (None: no limit). Returns False on a timeout, True otherwise (woken,
    the word differed already, or a signal: the caller looks again in every case)."""
    ts = None
    if timeout is not None:
        t = max(timeout, 0.0)
        ts = _Timespec(int(t), int((t - int(t)) * 1e9))
    v = expected & 0xFFFFFFFF
    v = v - (1 << 32) if v & 0x80000000 else v  # the word's bits as the C int the call takes
    r = _syscall(_SYS_FUTEX, addr, FUTEX_WAIT, v, ctypes.byref(ts) if ts is not None else None, None, 0)
    if r == 0:
        return True
    e = ctypes.get_errno()
    if e == errno.ETIMEDOUT:
        return False
    if e in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(e, f"futex wait: {os.strerror(e)}")  # pragma: no cover - EFAULT, EINVAL: a bug


def wake(addr: int) -> int:
    """Wake every sleeper on the word at ``addr``; returns how many were woken."""
    r = _syscall(_SYS_FUTEX, addr, FUTEX_WAKE, _INT_MAX, None, None, 0)
    return max(int(r), 0)


FUTEX_WAKE_OP = 5
_FUTEX_OP_ADD = 1


def atomic_add(addr: int, delta: int) -> None:
    """Add ``delta`` (-2048..2047) to the 32-bit word at ``addr`` atomically, between processes.

    Python has no atomic read-modify-write on shared memory; the kernel's ``FUTEX_WAKE_OP``
    has one: it applies an operation to its second word atomically and then wakes sleepers on
    either word (none here: both wake counts are 0). The word must be in a mapping opened for
    writing."""
    op = _FUTEX_OP_ADD << 28 | (delta & 0xFFF) << 12  # FUTEX_OP_ADD, oparg (12 bits, signed)
    r = _syscall(_SYS_FUTEX, addr, FUTEX_WAKE_OP, 0, None, addr, op)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"futex wake-op: {os.strerror(e)}")
