"""The room of /dev/shm and memory as this process reads it (``segment.check_room``): a
recent reading granted again to requests of a few MiB, and /proc/meminfo read through a kept descriptor."""

from __future__ import annotations

import os
import threading
import time

from shmkv._engine.locking.forks import renewed
from shmkv._engine.locking.interrupts import critical


class Room:
    """The room as this process last read it, granted again to requests soon after (
    the reading cost about 25 us a call under load, twice a create over a cached prefix): a
    request is granted without a reading while the last one is younger than ``TTL`` seconds
    and what was granted since, the request included, is at most half the room it saw and at
    most ``CAP`` bytes (what several processes granted from their readings at once can take
    beyond a reading stays small: half the room each could together eat the memory margin).
    Else the room is read again. A stale grant is otherwise safe: the check is the early, clear refusal that
    keeps tmpfs from eating the memory margin (tests/test_capacity.py); /dev/shm's own limit
    still refuses at the allocation (posix_fallocate, a write: ENOSPC, CacheFullError, never a
    SIGBUS: tests/test_lazy_pages.py), and another process's allocations show at the next
    reading, at most ``TTL`` later, as they did at the next check before."""

    TTL = 0.05
    CAP = 4 << 20  # (a create over a cached prefix needs far less; an append chunk of more reads)
    __slots__ = ("at", "lock", "room", "spent")

    def __init__(self) -> None:
        self.at, self.room, self.spent = -1.0, 0, 0
        self.lock = threading.Lock()  # (ROOM's: renewed in a forked child)

    def grant(self, need: int) -> bool:
        """Whether ``need`` bytes fit the last reading (counted as spent when they do)."""
        with self.lock:
            spent = self.spent + need
            if 2 * spent > self.room or spent > self.CAP or time.monotonic() - self.at > self.TTL:
                return False
            self.spent = spent
            return True

    def read(self, room: int | None, need: int) -> None:
        """A fresh reading (None: unknown, never granted from), ``need`` about to be spent."""
        self.at, self.room, self.spent = time.monotonic(), -1 if room is None else room, need


ROOM = Room()
renewed(ROOM, "lock")  # (free again in a forked child, before the hook below reads with it)


def _after_fork_in_child() -> None:
    ROOM.read(None, 0)  # the child reads the room itself (it would spend the parent's reading a second time)


os.register_at_fork(after_in_child=_after_fork_in_child)


# /proc/meminfo, kept open: a read at offset 0 renders it afresh (seq_file), and a pread of the
# kept descriptor costs a fifth of an open + read + close (about 10 us a create over a cached
# prefix, which checks the room once). A descriptor closed behind our back, or its
# number reused for another file, shows in what it reads: it is then forgotten (never closed:
# the number may be someone else's now) and opened again.
MEMINFO = [-1]


@critical  # (a Ctrl-C as /proc/meminfo is opened, before the descriptor is kept, waits)
def mem_available() -> int | None:
    """MemAvailable in bytes, or None when the kernel does not say."""
    for _ in range(2):
        fd = MEMINFO[0]
        if fd < 0:
            try:
                fd = os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            MEMINFO[0] = fd
        try:
            data = os.pread(fd, 1024, 0)
        except OSError:
            data = b""
        if data.startswith(b"MemTotal:"):
            i = data.find(b"\nMemAvailable:")
            try:
                return int(data[i + 14 :].split(None, 1)[0]) * 1024 if i >= 0 else None
            except (ValueError, IndexError):
                return None
        MEMINFO[0] = -1
    return None
