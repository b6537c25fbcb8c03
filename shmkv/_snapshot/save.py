"""Saving a snapshot: a msgpack stream of a store's sequences (the format and its checked
reader: ``format``; loading it back: ``restore``).

Saving writes each array straight from shared memory (no packb of arrays).
A sequence is captured at its committed length; appends beyond it go on
untouched. A structural change of a sequence during the save (seen through its
seqlock generation) restarts the file, and the last attempt holds the store
lock. A path target is written to a temporary file in the same directory,
fsynced, renamed into place and the directory fsynced: a crash leaves the old
file or the new one. Temporary files of saves that died are judged by their
writer's flock (``remove_stale_temps``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import io
import os
import re
import secrets
import stat
import zlib
from contextlib import AbstractContextManager
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any, NoReturn

import msgpack
import numpy as np

from shmkv._engine.locking.interrupts import critical, shielding
from shmkv._engine.checks import check_progress, int_list
from shmkv._snapshot.format import (
    seekable_fd,
    ID_HINT,
    Progress,
    CHUNK,
    FORMAT,
    crc32,
    VERSION,
    SeqRecord,
    layout_dict,
    seq_parts,
)
from shmkv.errors import (
    AccessDeniedError,
    CacheFullError,
    InvalidArgumentError,
    SequenceNotFound,
    ShmkvError,
    SnapshotError,
)

if TYPE_CHECKING:
    from shmkv._engine.port import Port
    from shmkv._engine.table.snapshot_rows import SavedRow

_SAVE_ATTEMPTS = 4


# -- saving ------------------------------------------------------------------


class _Busy(Exception):
    """A lock-free capture met a row that a transaction is changing (or a dead one left)."""


def _busy() -> NoReturn:
    raise _Busy


def _capture(core: Port, ids: list[int] | None, *, locked: bool) -> list[SeqRecord]:
    """Each sequence's (start, length, generation) and token ids/positions.

    ``locked`` (the store lock through the journal, or a read-only attachment's shared
    lock): the rows as a rollback would leave them (``settled_rows``: a dead process's
    transaction is never captured). Else seqlocked, and ``_Busy`` when a row stays odd:
    a transaction is open (its rows stay odd until it ends), so the caller saves again
    under the lock."""
    rows = core.snapshot_rows
    if locked:
        settled = rows.settled_rows()
        if ids is None:
            slots = list(settled)
        else:
            slots = []
            for i in ids:
                hit = [s for s, r in settled.items() if r.id == i]
                if not hit:
                    raise SequenceNotFound(f"store {core.name!r} has no sequence {i!r}: it was freed or never "
                                           "created (store.sequences() lists the live ones)")
                slots.append(hit[0])
    elif rows.undo_pending():
        raise _Busy  # a transaction is open (or a dead one is in the log): save under the lock
    elif ids is None:
        slots = rows.live_slots()
    else:
        slots = [core.slot_of(i) for i in ids]
    out = []
    for slot in slots:
        if locked:
            out.append(_record(core, slot, settled[slot]))
            continue
        # a structural op (a move, say) running past SAVE's tries: _Busy, captured again under the lock
        live, seq = rows.read_seqlocked(slot, functools.partial(_record, core, slot), _busy)
        if live:
            out.append(seq)
        elif ids is not None:
            raise SequenceNotFound(f"store {core.name!r}: sequence {seq.id} was freed during the save")
    if not locked and rows.undo_pending():
        raise _Busy  # a transaction began meanwhile: its rows may be in what was read
    rows.map_spans()  # shared prefix pages mapped as the rows say
    for s in out if core.shares.unmapped else ():  # never a row whose shared pages are holes here
        core.shares.readable(s.slot, f"sequence {s.id} of store {core.name!r} (saving it)")
    return sorted(out, key=lambda s: s.id)


def _record(core: Port, slot: int, r: SavedRow) -> SeqRecord:
    """What a snapshot keeps of sequence row ``slot`` (its words ``r``): its tokens, positions
    and meta record copied beside them."""
    start, length = r.start, r.length
    return SeqRecord(r.id, length, r.capacity, start, r.generation, slot, core.tokens[start : start + length].copy(),
                     core.positions[start : start + length].copy(), r.window_offset, r.encoder_length,
                     r.encoder_start, r.finished, r.recency, r.clean, core.get_meta(slot), r.wbuf)


def _hold(core: Port) -> AbstractContextManager[None]:
    """What a save holds for a capture that must not fail: the store lock through the
    journal (recovering a dead holder's transaction), or on a read-only attachment a shared
    lock (live writers excluded; a dead one's transaction read as rolled back)."""
    return core.reading() if core.readonly else core.locked(scan=True)


def _unchanged(core: Port, seqs: list[SeqRecord]) -> bool:
    unchanged = core.snapshot_rows.unchanged
    return all(unchanged(s.slot, s.id, s.gen) for s in seqs)


def _regions(core: Port) -> tuple[Any, ...]:
    """The main-arena arrays of each region, ``[layers, max_tokens, ...]``."""
    return (core.K, core.V, core.KS, core.VS)


def _arrays(core: Port, s: SeqRecord) -> list[np.ndarray]:
    """The stored arrays of a sequence in stream order, as views of shared memory."""
    out = []
    w = core.wcell(s.slot, s.wbuf)
    for p in seq_parts(core.layout, s):
        if p.window:
            out.append((core.Kl, core.Vl)[p.region][p.layer][w : w + p.tokens])
        else:
            a = s.encoder_start if p.encoder else s.start
            out.append(_regions(core)[p.region][p.layer, a : a + p.tokens])
    return out


def _header_bytes(core: Port, seqs: list[SeqRecord], crcs: list[int]) -> bytes:
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "layout": layout_dict(core.layout),
        "sequences": [
            {"id": s.id, "length": s.length, "capacity": s.capacity, "window_offset": s.window_offset,
             "encoder_length": s.encoder_length, "finished": s.finished, "recency": s.recency, "clean": s.clean,
             "meta": s.meta,
             "tokens": s.tokens.astype("<i8").tobytes(), "positions": s.positions.astype("<i8").tobytes()}  # type: ignore[union-attr]  # captured: never None
            for s in seqs
        ],
        "chunk": CHUNK,
    }
    meta_crc = zlib.crc32(msgpack.packb(meta))
    meta["meta_crc"] = meta_crc
    meta["checksums"] = np.asarray(crcs, "<u4").tobytes()
    out: bytes = msgpack.packb(meta)
    return out


def _crcs(arrays: list[np.ndarray]) -> list[int]:
    """crc32 of each array; on two threads when it is worth it (zlib releases the GIL)."""
    if sum(a.nbytes for a in arrays) < (8 << 20):
        return [crc32(a) for a in arrays]
    with ThreadPoolExecutor(2) as ex:
        return list(ex.map(crc32, arrays))


def _write_once(core: Port, f: IO[bytes], seqs: list[SeqRecord], progress: Progress | None) -> int:
    """Write the snapshot of ``seqs`` to ``f`` (at its position); return the bytes written.

    The checksums sit in the header, before the arrays. A file that can be written at an
    offset (a path target) gets a header with zero checksums first, then the arrays, their
    crc32 computed meanwhile on a second thread (zlib releases the GIL) over the same bytes,
    then the checksums written into their place: one pass over the data. A stream gets
    the checksums first (a reading pass), then everything in order."""
    arrays = [a for s in seqs for a in _arrays(core, s)]
    fd = seekable_fd(f)
    if fd is None:
        return _write_parts(f, _header_bytes(core, seqs, _crcs(arrays)), arrays, progress)
    head = _header_bytes(core, seqs, [0] * len(arrays))
    at = f.tell() + len(head) - 4 * len(arrays)  # the checksums: the header's last bytes (a fixed-size bin)
    if head[len(head) - 4 * len(arrays) :] != bytes(4 * len(arrays)):
        raise AssertionError("the snapshot header does not end with its checksums")
    with ThreadPoolExecutor(1) as pool:
        sums = [pool.submit(crc32, a) for a in arrays]  # in stream order, beside the writes
        try:
            total = _write_parts(f, head, arrays, progress)
        finally:
            crcs = [s.result() for s in sums]
    if arrays:
        f.flush()  # a buffered file: the header must be in the file before its checksums go in
        sums_at = memoryview(np.asarray(crcs, "<u4").tobytes())
        while sums_at:  # (a write may take part of what it is given: the rest follows, or fails)
            n = os.pwrite(fd, sums_at, at)
            sums_at, at = sums_at[n:], at + n
    return total


def _write_all(f: IO[bytes], data: bytes | memoryview) -> None:
    """All of ``data`` into ``f``. A raw file (a path target's, or an unbuffered file object)
    may take only part of a write, as a file system filling up does with the last bytes it
    has room for: the rest is written (and fails, ENOSPC) rather than dropped, so a snapshot
    short of its end is never renamed into place."""
    left = memoryview(data)
    while left:
        n = f.write(left)
        if not n:  # (None: a non-blocking stream that would block; 0: one that takes nothing)
            raise SnapshotError(f"the save target {f!r} took none of {len(left)} bytes "
                                "(a non-blocking stream?): save to a path or a blocking binary file")
        left = left[n:]


def _write_parts(f: IO[bytes], head: bytes, arrays: list[np.ndarray], progress: Progress | None) -> int:
    """The header, then each array as msgpack bins of at most CHUNK bytes."""
    total = len(head) + sum(a.nbytes + 5 * -(-a.nbytes // CHUNK) for a in arrays)
    done = len(head)
    _write_all(f, head)
    if progress:
        progress(done, total)
    for a in arrays:
        if not a.nbytes:
            continue
        mv = memoryview(a).cast("B")  # type: ignore[arg-type]  # straight from shared memory
        for pos in range(0, a.nbytes, CHUNK):
            part = mv[pos : pos + CHUNK]
            _write_all(f, b"\xc6" + len(part).to_bytes(4, "big"))
            _write_all(f, part)
            done += len(part) + 5
            if progress:
                progress(done, total)
    return total



_TEMP_RE = re.compile(r"\.(?P<base>.+)\.tmp-(?P<pid>\d+)(?:-(?P<start>\d+))?-[0-9a-f]{8}")


@shielding()  # (a Ctrl-C as a temporary file is opened to be judged: raised once it is closed)
def remove_stale_temps(directory: str, base: str | None = None) -> list[str]:
    """Remove the temporary files (``.BASE.tmp-PID-START-XXXX``) of saves whose writer died
    (killed mid-way); a live writer's file is kept. Only files we own. Returns the removed paths.

    Liveness is a kernel fact (docs/design.md §3), not the pid in the name (another PID
    namespace's, or reused): a writer holds a flock on its file until it is renamed into place
    (:func:`_save_path`), so a file whose flock can be taken has no live writer."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for f in names:
        m = _TEMP_RE.fullmatch(f)
        if m is None or (base is not None and m["base"] != base):
            continue
        path = os.path.join(directory, f)
        if _remove_if_stale(path):
            removed.append(path)
    return removed


@critical  # (a Ctrl-C as the open returns, before the descriptor is kept, waits: see _new_temp)
def _remove_if_stale(path: str) -> bool:
    """Remove the temporary file ``path`` if it is ours and no writer holds its flock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone, another user's, or a symlink: not ours to judge
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its writer is alive
        os.unlink(path)  # (a writer that opened it but had not locked it yet notices: _locked_temp)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@shielding(undo=lambda made: _drop_temp(*made))  # (a Ctrl-C as a file is opened or made: raised once it is kept)
@critical  # (down to the file object that closes the descriptor: nothing unowned in between)
def _new_temp(directory: str, base: str) -> tuple[str, io.FileIO]:
    """The stale temporary files of saves to ``directory/base`` removed, and a new one made: its
    path and a file object on it."""
    remove_stale_temps(directory, base)  # left by saves that were killed mid-way
    tmp, fd = _locked_temp(directory, base)
    try:
        return tmp, io.FileIO(fd, "w")
    except BaseException:
        _drop_temp(tmp, fd)
        raise


@critical  # (a Ctrl-C as the file is made, before it is kept, waits: see _new_temp)
def _locked_temp(directory: str, base: str) -> tuple[str, int]:
    """A new temporary file for a save to ``directory/base``, opened and flocked (its liveness,
    see :func:`remove_stale_temps`); made again if a stale-temp sweep removed it before the lock.
    A failure removes the file it made."""
    pid = os.getpid()
    while True:
        tmp = os.path.join(directory,
                           f".{base}.tmp-{pid}-{process_start_time(pid)}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else holds a file this new...
            if os.stat(tmp, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return tmp, fd
        except BlockingIOError:
            pass  # ... but a sweep may have locked it to judge it: then it unlinks it
        except FileNotFoundError:
            pass  # removed by a sweep between the open and the lock
        except BaseException:
            _drop_temp(tmp, fd)
            raise
        os.close(fd)


def _drop_temp(tmp: str, fd: int | io.FileIO) -> None:
    """Close and remove a save's temporary file (``fd`` open on it, or a file object: ``tmp`` its name)."""
    if isinstance(fd, int):
        os.close(fd)
    else:
        fd.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


def save(core: Port, target: Any, seq_ids: list[int] | None = None, progress: Progress | None = None) -> int:
    """Write a snapshot of ``store`` (or of ``seq_ids``) to a path or a binary file object.

    Returns the number of bytes written. See the module docstring for the format
    and the guarantees.
    """
    core.check_open()
    ids = None if seq_ids is None else int_list("save", "seq_ids", seq_ids, ID_HINT, distinct=True)
    check_progress("save", progress)
    if isinstance(target, (str, bytes, os.PathLike)):
        path = os.fsdecode(target)
        if not path or path.endswith(os.sep) or os.path.basename(path) in (".", "..") or os.path.isdir(path):
            raise InvalidArgumentError(f"save: the path {path!r} names no file (a directory?): give a file's path, "
                                       "e.g. 'cache.shmkv'")
        return _save_path(core, _replaced_file(path), ids, progress)
    if not hasattr(target, "write") or isinstance(target, io.TextIOBase) \
            or not getattr(target, "writable", lambda: True)():  # (an object with write() alone: as before)
        raise InvalidArgumentError(f"save target {target!r} is neither a path nor a writable binary file "
                                   "(open it with 'wb')")
    # a stream cannot be rewound: hold the store lock so no structural change can race
    with _hold(core):
        seqs = _capture(core, ids, locked=True)
        total = _write_once(core, target, seqs, progress)
    flush = getattr(target, "flush", None)
    if flush is not None:
        flush()  # a buffered pipe or socket would otherwise hold the tail back
    return total


_KINDS = {stat.S_IFCHR: "character device", stat.S_IFBLK: "block device", stat.S_IFIFO: "FIFO",
          stat.S_IFSOCK: "socket"}


def _replaced_file(path: str) -> str:
    """The file a save to ``path`` replaces (a new file renamed into place): ``path`` itself when
    it is missing or a regular file, the file a symlink names (the link stays a link). Anything
    else is refused: a rename would put a regular file where a device (/dev/null, as root), a
    FIFO or a socket was."""
    real = os.path.realpath(path) if os.path.islink(path) else path
    try:
        mode = os.stat(real).st_mode
    except OSError:  # (missing, or not reachable: the save's own errors say which)
        return real
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "special file")
        raise InvalidArgumentError(
            f"save: {path!r} is a {kind}, not a regular file, and a save to a path renames a new file into "
            f"place, which would replace it: give a regular file's path, or write into it with "
            f"store.save(open({path!r}, 'wb'))"
        )
    return real


def _save_path(core: Port, path: str, ids: list[int] | None, progress: Progress | None) -> int:
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    try:
        tmp, f = _new_temp(directory, base)  # flocked until renamed into place: this save is alive
    except FileNotFoundError:
        raise InvalidArgumentError(f"cannot save to {path!r}: directory {directory!r} does not exist") from None
    except PermissionError:
        raise AccessDeniedError(f"cannot save to {path!r}: no write permission in {directory!r}") from None
    except OSError as e:
        raise _save_error(e, path) from None
    try:
        with f:
            for attempt in range(_SAVE_ATTEMPTS):
                last = attempt == _SAVE_ATTEMPTS - 1
                with _hold(core) if last else contextlib.nullcontext():
                    try:
                        seqs = _capture(core, ids, locked=last)
                    except _Busy:
                        continue
                    f.seek(0)
                    f.truncate()
                    total = _write_once(core, f, seqs, progress)
                    if last or _unchanged(core, seqs):
                        break
            os.fsync(f.fileno())
            os.replace(tmp, path)  # with the file (and its flock) still open: never judged stale before
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, FileNotFoundError) and not isinstance(e, ShmkvError):
            raise SnapshotError(f"cannot save to {path!r}: the temporary file {tmp!r} was removed while the save "
                                "ran (by hand, or by a program that does not honour its lock): save again") from None
        if isinstance(e, OSError) and not isinstance(e, ShmkvError):
            raise _save_error(e, path) from None
        raise
    _sync_directory(directory)  # the rename is on disk
    return total


@shielding()  # (a Ctrl-C as the directory is opened: raised once it is closed)
@critical
def _sync_directory(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _save_error(e: OSError, path: str) -> Exception:
    if isinstance(e, IsADirectoryError):
        return InvalidArgumentError(f"cannot save to {path!r}: it is a directory; name a file in it")
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return CacheFullError(
            f"cannot save to {path!r}: {os.strerror(e.errno)} on its file system; the previous snapshot "
            "(if any) is kept: free space there, or save elsewhere"
        )
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return CacheFullError(f"cannot save to {path!r}: {os.strerror(e.errno)}: close files or raise `ulimit -n`")
    return e


__all__ = ["remove_stale_temps", "save"]


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (Linux), 0 when unknown.

    Part of a snapshot temporary file's name, so a recycled pid is not mistaken for its writer.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses; fields after
    # the last ')' are space-separated, starttime is field 22.
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return 0
