"""Linux futex(2) on shared memory, through ctypes: how ``Sequence.wait`` sleeps until a commit.

A futex word is any aligned 32-bit word of a shared mapping. ``wait(addr, expected, timeout)``
sleeps while the word still holds ``expected`` (the kernel compares and sleeps atomically, so
a change made between the caller's read and the call is never missed: the call returns at
once); ``wake(addr)`` wakes every sleeper on the word. The private flag is not used: the
memory is shared between processes, and a private futex is keyed by the process's own
address space. Shared futexes are keyed by the mapped file and offset, so processes that map
the segment at different addresses (fork, spawn, forkserver, other programs) meet on the
same word.

Supported where shmkv is (Linux x86-64, docs/design.md §3); elsewhere ``AVAILABLE`` is
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
    # The calls on a wake-up's path (a commit's wake, a waiter's count taken off) go through a
    # second pointer to the same function without argtypes, given ctypes objects made once: no
    # argument conversion (seven from_param calls), which after the caller slept is tens of
    # microseconds of cold interpreter and libffi code (tools/bench.py wait).
    _fast = _LIBC["syscall"]
    _fast.restype = ctypes.c_long
    _C_NR = ctypes.c_long(_SYS_FUTEX)
    _C_WAKE = ctypes.c_long(1)  # FUTEX_WAKE
    _C_WAKE_OP = ctypes.c_long(5)  # FUTEX_WAKE_OP
    _C_ALL = ctypes.c_long(_INT_MAX)
    _C_ZERO = ctypes.c_long(0)


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


_ADDRS: dict[int, ctypes.c_long] = {}  # futex words' addresses as ctypes objects, made once each


def _c_addr(addr: int) -> ctypes.c_long:
    a = _ADDRS.get(addr)
    if a is None:
        if len(_ADDRS) > 4096:  # stores come and go: keep the recent ones
            _ADDRS.clear()
        a = _ADDRS[addr] = ctypes.c_long(addr)
    return a


def wake(addr: int) -> int:
    """Wake every sleeper on the word at ``addr``; returns how many were woken."""
    r: int = _fast(_C_NR, _c_addr(addr), _C_WAKE, _C_ALL, None, None, _C_ZERO)
    return r if r > 0 else 0


FUTEX_WAKE_OP = 5
_FUTEX_OP_ADD = 1
_OPS = {d: ctypes.c_long(_FUTEX_OP_ADD << 28 | (d & 0xFFF) << 12) for d in (1, -1)}  # a waiter's count up, down


def atomic_add(addr: int, delta: int) -> None:
    """Add ``delta`` (-2048..2047) to the 32-bit word at ``addr`` atomically, between processes.

    Python has no atomic read-modify-write on shared memory; the kernel's ``FUTEX_WAKE_OP``
    has one: it applies an operation to its second word atomically and then wakes sleepers on
    either word (none here: both wake counts are 0). The word must be in a mapping opened for
    writing."""
    op = _OPS.get(delta)
    if op is None:
        op = ctypes.c_long(_FUTEX_OP_ADD << 28 | (delta & 0xFFF) << 12)  # FUTEX_OP_ADD, oparg (12 bits, signed)
    a = _c_addr(addr)
    r = _fast(_C_NR, a, _C_WAKE_OP, _C_ZERO, None, a, op)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"futex wake-op: {os.strerror(e)}")
