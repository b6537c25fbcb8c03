"""POSIX shared-memory segments, mapped without Python's resource tracker.

``multiprocessing.shared_memory.SharedMemory`` on Python < 3.13 registers every
segment it opens with the resource tracker, which unlinks it when the *opening*
process exits, so an inspector that attaches and exits would delete the store.
We therefore open segments ourselves (``_posixshmem`` is the same C module
SharedMemory uses) and decide removal explicitly: the creator, ``remove`` and
``gc`` unlink; nobody else does. See tests/test_lifecycle.py.

Views are ``np.frombuffer`` arrays over an ``mmap`` object. While any such
view exists, the ``mmap`` cannot be closed (``BufferError``), so a view never
outlives its mapping: :meth:`Segment.close` drops our reference and the pages
stay mapped until the last view is garbage collected. Nothing can dangle.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import errno
import mmap
import os
import stat
import sys

import numpy as np
from numpy.typing import DTypeLike

from shmkv._engine.locking.interrupts import critical
from shmkv._engine.memory import cachestat as _cachestat
from shmkv._engine.memory.shm_room import MEMINFO, ROOM, Room, mem_available  # noqa: F401  (tests reach them here)
from shmkv.errors import (
    AccessDeniedError,
    CacheFullError,
    CorruptStoreError,
    InvalidArgumentError,
    SnapshotError,
    StoreClosedError,
    StoreExistsError,
    StoreNotFound,
)

SHM_DIR = "/dev/shm"
PREFIX = "skv_"
NAME_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"  # 1 to 24 of them
# errors of a write or an allocation that mean "/dev/shm (or memory) is full"
_FULL = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT)
# Linux only; the value of MADV_POPULATE_WRITE (5.14+), absent from Python 3.11's mmap.
_MADV_POPULATE_WRITE = 23

# Bumped in every child after os.fork(): handles compare it to notice that they
# were inherited and must not act as the parent (leases, locks, creator cleanup).
fork_epoch = 0


def _after_fork() -> None:
    global fork_epoch
    fork_epoch += 1


os.register_at_fork(after_in_child=_after_fork)


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid store name, else raise InvalidArgumentError."""
    # (str methods, not a regular expression: nothing but C code on attach's first line)
    if not isinstance(name, str) or not 1 <= len(name) <= 24 or name.strip(NAME_CHARS):
        raise InvalidArgumentError(
            f"bad store name {name!r}: use 1 to 24 characters from [A-Za-z0-9_-] "
            "(macOS limits a whole segment name to 30 characters)"
        )
    return name


def header_name(name: str) -> str:
    return f"{PREFIX}{name}.h"


def data_name(name: str) -> str:
    return f"{PREFIX}{name}.d"


def lock_path(name: str) -> str:
    return f"{SHM_DIR}/{PREFIX}{name}.lock"


def shm_path(segment: str) -> str:
    return os.path.join(SHM_DIR, segment)


def _owner(path: str) -> str:
    """'uid U, mode 0oM' of a file, for error messages."""
    try:
        st = os.stat(path)
    except OSError:
        return "owner unknown"
    return f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):#o}"


def denied(name: str, what: str) -> AccessDeniedError:
    """The error for a segment or lock file whose owner or mode keeps us out."""
    return AccessDeniedError(
        f"{what} {name!r} is not accessible to uid {os.geteuid()} ({_owner(shm_path(name))}): it belongs to "
        "another user; ask its creator to share it (create(..., mode=0o660) and a common group) or use another name"
    )


def os_error(e: OSError, name: str, size: int | None = None) -> Exception:
    """A ShmkvError for an OSError from shm_open, ftruncate or mmap, or ``e`` itself if none fits."""
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return CacheFullError(
            f"cannot open segment {name!r}: {os.strerror(e.errno)} (each store keeps 2 descriptors open): "
            "close stores you no longer use, or raise the limit (`ulimit -n`)"
        )
    if e.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG, errno.EOVERFLOW, errno.EINVAL) and size is not None:
        return CacheFullError(
            f"cannot map segment {name!r} of {size} bytes ({os.strerror(e.errno)}): "
            "lower max_tokens=, max_seqs= or the layout, or enlarge /dev/shm (in a container: "
            "`docker run --shm-size=...`; `shmkv doctor` shows the room)"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return denied(name, "segment")
    return shm_full(name, e) if e.errno in _FULL else e  # (full: no byte, or no inode, for a new file)


def shm_full(name: str, e: OSError) -> CacheFullError:  # no room in /dev/shm for a store's file
    return CacheFullError(f"cannot create {name!r} in {SHM_DIR}: {os.strerror(e.errno or 0)} (no bytes or no inodes "
                          "left): remove stores you no longer use (`shmkv ls`, `shmkv gc`), or enlarge /dev/shm "
                          "(mount -o remount,size=...,nr_inodes=... /dev/shm)")


class Segment:
    """One mapped POSIX shared-memory segment.

    ``close()`` unmaps when no numpy view is left, and otherwise leaves the
    mapping to the views (it is unmapped when the last one is collected).
    ``unlink()`` removes the name; mapped pages stay valid for whoever maps them.
    """

    __slots__ = ("_fd", "_send", "mm", "name", "readonly", "size")

    def __init__(self, name: str, size: int, readonly: bool, mm: mmap.mmap, fd: int) -> None:
        self.name = name
        self.size = size
        self.readonly = readonly
        self.mm: mmap.mmap | None = mm
        self._fd = fd
        self._send = (-1, 0)  # copy_in's own descriptor of the segment, and the pid that opened it

    @classmethod
    @critical  # (under the lifecycle lock) a Ctrl-C as shm_open returns, before fd is kept, waits for its release
    def create(cls, name: str, size: int, mode: int = 0o600) -> Segment:
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=mode)
        except FileExistsError:
            raise StoreExistsError(
                f"shared-memory segment {name!r} exists already: attach to it, "
                "or remove it with shmkv.remove() / `shmkv rm`"
            ) from None
        except OSError as e:
            raise os_error(e, name) from None
        try:
            os.fchmod(fd, mode)  # shm_open's mode is filtered by the umask
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            return cls(name, size, False, mm, fd)  # (inside: a Ctrl-C at its entry leaves nothing)
        except BaseException as e:
            os.close(fd)
            _unlink_quietly(name)
            if isinstance(e, OSError):
                raise os_error(e, name, size) from None
            raise

    @classmethod
    @critical  # (a Ctrl-C as shm_open returns, before the segment keeps the descriptor, waits)
    def open(cls, name: str, readonly: bool) -> Segment:
        flags = os.O_RDONLY if readonly else os.O_RDWR
        try:
            fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        except FileNotFoundError:
            raise StoreNotFound(f"no shared-memory segment {name!r}: is the store created?") from None
        except OSError as e:
            raise os_error(e, name) from None
        try:
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            try:  # length 0: the whole segment, whose size mmap asks the kernel (one fstat, not two)
                mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, prot)
            except ValueError:  # (mmap refuses an empty file)
                raise StoreNotFound(f"segment {name!r} is empty (being created, or a leftover)") from None
            return cls(name, len(mm), readonly, mm, fd)
        except BaseException as e:
            size = None
            try:
                if isinstance(e, OSError):
                    size = os.fstat(fd).st_size  # (for the message)
            except OSError:
                pass
            finally:
                os.close(fd)
            if isinstance(e, OSError):
                raise os_error(e, name, size) from None
            raise

    def reserve(self, ranges: list[tuple[int, int]], populate: bool = True) -> None:
        """Allocate the pages of every ``(offset, length)`` range now, or raise CacheFullError.

        tmpfs allocates pages on first touch; a touch when /dev/shm is full is a
        SIGBUS that kills the process. posix_fallocate turns that into ENOSPC
        here. ``populate`` then pre-faults the pages into our page table (zeroing
        them), so the first write through the mapping runs at full speed; without
        it the pages stay allocated but unzeroed, which is what a range about to be
        filled through the descriptor (:meth:`write`, :meth:`copy_in`) wants.
        """
        if self.readonly:
            return
        spans = self.check_room(ranges)
        for begin, end in spans:
            try:
                os.posix_fallocate(self._fd, begin, end - begin)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise self._io_error(e, "reserve pages of", end - begin) from None
        if populate:
            self._populate(spans)

    def check_room(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """CacheFullError unless /dev/shm and memory have room for the missing pages of the
        ranges; returns their page-aligned spans. (What :meth:`reserve` checks first, and a
        range filled straight through :meth:`write` or :meth:`copy_in` checks instead.)"""
        spans = self._spans(ranges)
        if not spans:
            return spans
        # tmpfs fallocate (or a write) takes pages one by one until memory runs out: on a
        # machine whose /dev/shm is as large as RAM that summons the OOM killer
        # before ENOSPC. So refuse up front what cannot fit. See
        # tests/test_capacity.py::test_store_larger_than_dev_shm_fails_cleanly_when_written.
        need = sum(e - b for b, e in spans)
        if ROOM.grant(need):
            return spans
        room = _room_bytes()
        ROOM.read(room, need)
        # the exact count of pages still missing (cachestat, or a SEEK_HOLE walk, slow over
        # long allocated stretches) only matters when the spans could exceed the room
        if room is not None and need > room:
            missing = sum(self._unallocated(b, e) for b, e in spans)
            if missing > room:
                raise CacheFullError(
                    f"/dev/shm or memory has room for {room} more bytes, segment {self.name!r} needs "
                    f"{missing}: free sequences, lower the capacity, or enlarge /dev/shm (in a container: "
                    "`docker run --shm-size=...`; `shmkv doctor` shows the room)"
                )
        return spans

    def populate(self, ranges: list[tuple[int, int]]) -> None:
        """Pre-fault the (already reserved) pages of every ``(offset, length)`` range into our
        page table, for writes through the mapping."""
        if not self.readonly:
            self._populate(self._spans(ranges))

    def _spans(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The page-aligned ``(begin, end)`` spans of the non-empty ranges."""
        page = mmap.PAGESIZE
        return [(offset - offset % page, min(self.size, -(-(offset + length) // page) * page))
                for offset, length in ranges if length > 0]

    def _populate(self, spans: list[tuple[int, int]]) -> None:
        if sys.platform.startswith("linux") and self.mm is not None:
            for begin, end in spans:
                try:
                    self.mm.madvise(_MADV_POPULATE_WRITE, begin, end - begin)
                except OSError:
                    return  # older kernel: first touch stays lazy, the fallocate still guards SIGBUS

    def _io_error(self, e: OSError, what: str, nbytes: int) -> Exception:
        """The error of the tree for an OSError of an allocation or a write, naming the fix."""
        why = os.strerror(e.errno or 0)
        if e.errno in _FULL:
            return self._full(nbytes, e)
        if e.errno == errno.EBADF:
            return StoreClosedError(f"cannot {what} segment {self.name!r} ({why}): its store was closed; "
                                    "attach again with shmkv.attach()")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return AccessDeniedError(f"cannot {what} segment {self.name!r} ({why}): attach read-write, as a user "
                                     "the segment's mode lets write (create(..., mode=0o660) shares it with a group)")
        return CorruptStoreError(
            f"cannot {what} segment {self.name!r} ({why}, errno {e.errno}): the shared memory (or the file "
            "copied from) failed; save what you can read (`shmkv save`) and create the store anew")

    def _full(self, nbytes: int, e: OSError) -> CacheFullError:
        return CacheFullError(
            f"/dev/shm cannot hold {nbytes} more bytes for segment {self.name!r} "
            f"({os.strerror(e.errno or 0)}): free sequences, lower the capacity, or enlarge /dev/shm "
            "(in a container: `docker run --shm-size=...`; `shmkv doctor` shows the room)"
        )

    def write(self, offset: int, data: memoryview) -> None:
        """Write ``data`` (bytes-like, C-contiguous) at ``offset`` through the descriptor.

        Into pages that are new to the range (holes, or fallocated and never touched) tmpfs
        copies without zeroing first and without faulting them into our page table: a fresh
        range filled this way costs about one copy (what ``os.pwrite`` into a new /dev/shm file
        costs), where zeroing, mapping and a memcpy cost twice that. A full /dev/shm is
        CacheFullError, never a SIGBUS; what was written of ``data`` stays (in cells no row
        points to: the caller publishes nothing)."""
        mv = memoryview(data).cast("B")
        done, n = 0, len(mv)
        try:
            while done < n:
                done += os.pwrite(self._fd, mv[done:], offset + done)
        except OSError as e:
            raise self._io_error(e, "write into", n - done) from None

    def copy_in(self, src_fd: int, src_offset: int, offset: int, n: int) -> None:
        """Copy ``n`` bytes of file ``src_fd`` at ``src_offset`` to ``offset`` in the kernel
        (``os.sendfile``: no copy through user space, no zeroing of new pages; CacheFullError
        when full, as :meth:`write`). sendfile writes at a descriptor's file position, so it
        writes through a description of its own (``/proc/self/fd``), no other thread's; opened at
        the first call and kept (a restore makes one call an array), and the callers hold the
        store lock, so no two calls of this process use it at once."""
        try:
            fd = self._sending_fd()
        except OSError:
            self._copy_in_slowly(src_fd, src_offset, offset, n)
            return
        done = 0
        try:
            os.lseek(fd, offset, os.SEEK_SET)
            while done < n:
                sent = os.sendfile(fd, src_fd, src_offset + done, n - done)
                if sent == 0:
                    raise _source_ended(n - done)
                done += sent
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise self._io_error(e, "copy a file into", n - done) from None
            self._copy_in_slowly(src_fd, src_offset + done, offset + done, n - done)  # no sendfile here

    @critical  # (a Ctrl-C as the open returns, before the descriptor is kept, waits)
    def _sending_fd(self) -> int:
        """``copy_in``'s own descriptor of the segment, opened at its first call in this process
        (a forked child shares the parent's: its own, then)."""
        fd, pid = self._send
        if fd < 0 or pid != os.getpid():
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_WRONLY | os.O_CLOEXEC)
            self._send = (fd, os.getpid())
        return fd

    def _copy_in_slowly(self, src_fd: int, src_offset: int, offset: int, n: int) -> None:
        buf = bytearray(min(n, 8 << 20))
        done = 0
        while done < n:
            try:
                got = os.preadv(src_fd, [memoryview(buf)[: n - done]], src_offset + done)
            except OSError as e:
                raise SnapshotError(f"cannot read the source file at byte {src_offset + done} "
                                    f"({os.strerror(e.errno or 0)}): check the file and its disk") from None
            if got == 0:
                raise _source_ended(n - done)
            self.write(offset + done, memoryview(buf)[:got])
            done += got

    def _unallocated(self, begin: int, end: int) -> int:
        """Bytes of the page-aligned ``[begin, end)`` that have no page yet: cachestat's count
        of the pages there (fallocated and never written ones too, see _engine/memory/cachestat.py),
        else a SEEK_HOLE/SEEK_DATA walk (which counts those as missing: an overcount)."""
        if end <= begin:
            return 0
        held = _cachestat.pages(self._fd, begin, end - begin)
        if held is not None:
            return max(end - begin - held * _cachestat.PAGE, 0)
        return self._holes(begin, end)

    def _holes(self, begin: int, end: int) -> int:
        """Bytes of ``[begin, end)`` that SEEK_HOLE reports as holes (on tmpfs: no page, or a
        page fallocated and never written)."""
        missing, pos = 0, begin
        try:
            while pos < end:
                hole = os.lseek(self._fd, pos, os.SEEK_HOLE)
                if hole >= end:
                    break
                try:
                    data = os.lseek(self._fd, hole, os.SEEK_DATA)
                except OSError as e:  # ENXIO: no data after the hole
                    if e.errno != errno.ENXIO:
                        raise
                    data = end
                missing += min(data, end) - hole
                pos = data
        except OSError:
            return end - begin
        return missing

    def fileno(self) -> int:
        return self._fd

    def array(self, dtype: DTypeLike, count: int = -1, offset: int = 0) -> np.ndarray:
        """A numpy view of ``count`` items at byte ``offset`` of the mapping (the caller drops it
        before close: a view must not outlive its mapping)."""
        if self.mm is None:
            raise StoreClosedError(f"segment {self.name!r} is closed")
        return np.frombuffer(self.mm, dtype, count, offset)

    def close(self) -> None:
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # live numpy views: the mapping goes away with the last of them
        self._close_fds()

    @critical  # (each descriptor forgotten and closed at once)
    def _close_fds(self) -> None:
        # each descriptor is forgotten before it is closed: a second call (after Ctrl-C in between)
        # never closes its number again, maybe another file's by then (tests/test_interrupted_handles.py)
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        (fd, pid), self._send = self._send, (-1, 0)
        if fd >= 0 and pid == os.getpid():
            os.close(fd)

    def __del__(self) -> None:  # dropped unclosed (Ctrl-C before its owner kept it): no descriptor leaks
        with contextlib.suppress(Exception):
            self._close_fds()

    def unlink(self) -> None:
        _unlink_quietly(self.name)


def _source_ended(missing: int) -> SnapshotError:
    return SnapshotError(f"the source file ended {missing} bytes early: it was truncated while being read; "
                         "take the snapshot again")


def _unlink_quietly(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False
    except PermissionError:
        raise denied(name, "segment") from None


def unlink(name: str) -> bool:
    """Unlink segment ``name``; False when it did not exist."""
    return _unlink_quietly(name)


# Memory left to other processes when we reserve: tmpfs pages cannot be swapped
# out or reclaimed, so taking the last of them starves the whole machine.
MEMORY_MARGIN = 256 << 20


def _room_bytes() -> int | None:
    """Bytes we may still reserve: free space of /dev/shm, bounded by available memory."""
    room = None
    try:
        st = os.statvfs(SHM_DIR)
        room = st.f_bavail * st.f_frsize
    except OSError:
        pass
    avail = mem_available()
    if avail is not None:
        avail -= MEMORY_MARGIN
        room = avail if room is None else min(room, avail)
    return None if room is None else max(room, 0)


def segment_mtime(name: str) -> float | None:
    try:
        st = os.stat(shm_path(name))
    except FileNotFoundError:
        return None
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None


def listdir() -> list[str]:
    try:
        return sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:  # not Linux: no way to list POSIX shm names
        return []


MAX_PID = 1 << 22  # Linux's largest pid_max
