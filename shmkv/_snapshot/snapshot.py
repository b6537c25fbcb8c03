"""Snapshot files: a msgpack stream of a store's sequences.

The file format and its reader: ``_snapshot_format``.

Saving writes each array straight from shared memory (no packb of arrays).
A sequence is captured at its committed length; appends beyond it go on
untouched. A structural change of a sequence during the save (seen through its
seqlock generation) restarts the file, and the last attempt holds the store
lock. A path target is written to a temporary file in the same directory,
fsynced, renamed into place and the directory fsynced: a crash leaves the old
file or the new one. Restore reads everything into ranges that no sequence
owns yet and publishes them only when every checksum matched: all or nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

import msgpack
import numpy as np

from shmkv._engine import crash as _crash
from shmkv._engine import header as _header
from shmkv._engine import segment as _segment
from shmkv._engine.checks import int_list
from shmkv._engine.lease import own_token
from shmkv._engine.seqlock import SAVE, seqlocked
from shmkv._snapshot.format import (
    CHUNK,
    FORMAT,
    crc32,
    REGION_NAMES,
    VERSION,
    Snapshot,
    _Reader,
    _Seq,
    _layout_dict,
    _open_source,
    _parts,
    _token_bytes,
)
from shmkv._engine.header import (
    CAPACITY,
    CLEAN,
    ENC_SLOT,
    FINISHED,
    FLAGS,
    GEN,
    ID,
    LEASE_PID,
    LENGTH,
    LIVE,
    RECENCY,
    START,
    STATE,
    WBUF,
    WIN_OFF,
)
from shmkv.errors import (
    AccessDeniedError,
    CacheFullError,
    InvalidArgumentError,
    LayoutMismatchError,
    SequenceNotFound,
    ShmkvError,
    SnapshotError,
)

if TYPE_CHECKING:
    from shmkv._engine.port import Port

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class _Removable(Protocol):
    """A store ``load_with`` created: removed again when its restore fails."""

    def unlink(self) -> None: ...


S = TypeVar("S", bound=_Removable)
_SAVE_ATTEMPTS = 4


# -- saving ------------------------------------------------------------------


class _Busy(Exception):
    """A lock-free capture met a row that a transaction is changing (or a dead one left)."""


def _busy() -> NoReturn:
    raise _Busy


def _capture(core: Port, ids: list[int] | None, *, locked: bool) -> list[_Seq]:
    """Each sequence's (start, length, generation) and token ids/positions.

    ``locked`` (the store lock through the journal, or a read-only attachment's shared
    lock): the rows as a rollback would leave them (``settled_row``: a dead process's
    transaction is never captured). Else seqlocked, and ``_Busy`` when a row stays odd:
    a transaction is open (its rows stay odd until it ends), so the caller saves again
    under the lock."""
    t = core.table_np
    if locked:
        rows = {slot: core.settled_row(slot) for slot in range(len(t))}
        if ids is None:
            slots = [s for s, r in rows.items() if r[STATE] == LIVE]
        else:
            slots = []
            for i in ids:
                hit = [s for s, r in rows.items() if r[STATE] == LIVE and r[ID] == i]
                if not hit:
                    raise SequenceNotFound(f"store {core.name!r} has no sequence {i!r}: it was freed or never "
                                           "created (store.sequences() lists the live ones)")
                slots.append(hit[0])
    elif core.hdr[_header.W_UNDO_COUNT]:
        raise _Busy  # a transaction is open (or a dead one is in the log): save under the lock
    elif ids is None:
        slots = [int(i) for i in np.flatnonzero(t[:, STATE] == LIVE)]
    else:
        slots = [core.slot_of(i) for i in ids]
    out = []
    for slot in slots:
        if locked:
            r = rows[slot]
            enc = r[ENC_SLOT]
            e_start, e_len = (rows[enc - 1][START], rows[enc - 1][LENGTH]) if enc else (0, 0)
            start, length = r[START], r[LENGTH]
            out.append(_Seq(r[ID], length, r[CAPACITY], start, r[GEN], slot,
                            core.tokens[start : start + length].copy(), core.positions[start : start + length].copy(),
                            r[WIN_OFF], e_len, e_start, bool(r[FLAGS] & FINISHED), r[RECENCY], r[CLEAN],
                            core.get_meta(slot), r[WBUF]))
            continue
        row = core.row(slot)

        def read(row: memoryview = row, slot: int = slot) -> tuple[bool, _Seq]:
            g = row[GEN]
            sid, start, cap, length, woff = row[ID], row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF]
            flags, recency, clean, wbuf = row[FLAGS], row[RECENCY], row[CLEAN], row[WBUF]
            meta = core.get_meta(slot)
            enc = row[ENC_SLOT]
            erow = core.row(enc - 1) if enc else None
            e_start, e_len = (erow[START], erow[LENGTH]) if erow is not None else (0, 0)
            toks = core.tokens[start : start + length].copy()
            poss = core.positions[start : start + length].copy()
            return row[STATE] == LIVE, _Seq(sid, length, cap, start, g, slot, toks, poss, woff, e_len, e_start,
                                            bool(flags & FINISHED), recency, clean, meta, wbuf)

        # a structural op (a move, say) running past SAVE's tries: _Busy, captured again under the lock
        live, seq = seqlocked(row, GEN, read, SAVE, _busy)
        if live:
            out.append(seq)
        elif ids is not None:
            raise SequenceNotFound(f"store {core.name!r}: sequence {seq.id} was freed during the save")
    if not locked and core.hdr[_header.W_UNDO_COUNT]:
        raise _Busy  # a transaction began meanwhile: its rows may be in what was read
    if ids is not None and len({s.id for s in out}) != len(out):
        raise InvalidArgumentError(f"seq_ids={ids} names a sequence twice")
    return sorted(out, key=lambda s: s.id)


def _hold(core: Port) -> AbstractContextManager[None]:
    """What a save holds for a capture that must not fail: the store lock through the
    journal (recovering a dead holder's transaction), or on a read-only attachment a shared
    lock (live writers excluded; a dead one's transaction read as rolled back)."""
    return core.reading() if core.readonly else core.locked(scan=True)


def _unchanged(core: Port, seqs: list[_Seq]) -> bool:
    return all(core.row(s.slot)[GEN] == s.gen and core.row(s.slot)[ID] == s.id for s in seqs)


def _regions(core: Port) -> tuple[Any, ...]:
    """The main-arena arrays of each region, ``[layers, max_tokens, ...]``."""
    return (core.K, core.V, core.KS, core.VS)


def _arrays(core: Port, s: _Seq) -> list[np.ndarray]:
    """The stored arrays of a sequence in stream order, as views of shared memory."""
    out = []
    w = core.wcell(s.slot, s.wbuf)
    for p in _parts(core.layout, s):
        if p.window:
            out.append((core.Kl, core.Vl)[p.region][p.layer][w : w + p.tokens])
        else:
            a = s.encoder_start if p.encoder else s.start
            out.append(_regions(core)[p.region][p.layer, a : a + p.tokens])
    return out


def _header_bytes(core: Port, seqs: list[_Seq], crcs: list[int]) -> bytes:
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "layout": _layout_dict(core.layout),
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


def _write_once(core: Port, f: IO[bytes], seqs: list[_Seq], progress: Progress | None) -> int:
    """Write the snapshot of ``seqs`` to ``f`` (at its position); return the bytes written.

    The checksums sit in the header, before the arrays. A file that can be written at an
    offset (a path target) gets a header with zero checksums first, then the arrays, their
    crc32 computed meanwhile on a second thread (zlib releases the GIL) over the same bytes,
    then the checksums written into their place: one pass over the data. A stream gets
    the checksums first (a reading pass), then everything in order."""
    arrays = [a for s in seqs for a in _arrays(core, s)]
    fd = _seekable_fd(f)
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
        os.pwrite(fd, np.asarray(crcs, "<u4").tobytes(), at)
    return total


def _seekable_fd(f: IO[bytes]) -> int | None:
    """``f``'s descriptor when it is a file that os.pwrite can write at an offset (not one opened
    for appending: there Linux's pwrite ignores the offset and appends)."""
    try:
        if not f.seekable():
            return None
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
        return None
    return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _write_parts(f: IO[bytes], head: bytes, arrays: list[np.ndarray], progress: Progress | None) -> int:
    """The header, then each array as msgpack bins of at most CHUNK bytes."""
    total = len(head) + sum(a.nbytes + 5 * -(-a.nbytes // CHUNK) for a in arrays)
    done = len(head)
    f.write(head)
    if progress:
        progress(done, total)
    for a in arrays:
        if not a.nbytes:
            continue
        mv = memoryview(a).cast("B")  # type: ignore[arg-type]  # straight from shared memory
        for pos in range(0, a.nbytes, CHUNK):
            part = mv[pos : pos + CHUNK]
            f.write(b"\xc6" + len(part).to_bytes(4, "big"))
            f.write(part)
            done += len(part) + 5
            if progress:
                progress(done, total)
    return total


_ID_HINT = " (sequence ids: Sequence.id)"

_TEMP_RE = re.compile(r"\.(?P<base>.+)\.tmp-(?P<pid>\d+)(?:-(?P<start>\d+))?-[0-9a-f]{8}")


def remove_stale_temps(directory: str, base: str | None = None) -> list[str]:
    """Remove the temporary files (``.BASE.tmp-PID-START-XXXX``) of saves whose writer died
    (killed mid-way); a live writer's file is kept. Only files we own. Returns the removed paths.

    Liveness is a kernel fact (DESIGN section 3), not the pid in the name (another PID
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
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone, another user's, or a symlink: not ours to judge
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its writer is alive
            os.unlink(path)  # (a writer that opened it but had not locked it yet notices: _locked_temp)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _locked_temp(directory: str, base: str) -> tuple[str, int]:
    """A new temporary file for a save to ``directory/base``, opened and flocked (its liveness,
    see :func:`remove_stale_temps`); made again if a stale-temp sweep removed it before the lock."""
    pid = os.getpid()
    while True:
        tmp = os.path.join(directory,
                           f".{base}.tmp-{pid}-{_segment.process_start_time(pid)}-{secrets.token_hex(4)}")
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
            os.close(fd)
            raise
        os.close(fd)


def save(core: Port, target: Any, seq_ids: list[int] | None = None, progress: Progress | None = None) -> int:
    """Write a snapshot of ``store`` (or of ``seq_ids``) to a path or a binary file object.

    Returns the number of bytes written. See the module docstring for the format
    and the guarantees.
    """
    core.check_open()
    ids = None if seq_ids is None else int_list("save", "seq_ids", seq_ids, _ID_HINT)
    if isinstance(target, (str, bytes, os.PathLike)):
        return _save_path(core, os.fsdecode(target), ids, progress)
    if not hasattr(target, "write"):
        raise InvalidArgumentError(f"save target {target!r} is neither a path nor a writable binary file")
    # a stream cannot be rewound: hold the store lock so no structural change can race
    with _hold(core):
        seqs = _capture(core, ids, locked=True)
        total = _write_once(core, target, seqs, progress)
    flush = getattr(target, "flush", None)
    if flush is not None:
        flush()  # a buffered pipe or socket would otherwise hold the tail back
    return total


def _save_path(core: Port, path: str, ids: list[int] | None, progress: Progress | None) -> int:
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    remove_stale_temps(directory, base)  # left by saves that were killed mid-way
    try:
        tmp, fd = _locked_temp(directory, base)  # flocked until renamed into place: this save is alive
    except FileNotFoundError:
        raise InvalidArgumentError(f"cannot save to {path!r}: directory {directory!r} does not exist") from None
    except PermissionError:
        raise AccessDeniedError(f"cannot save to {path!r}: no write permission in {directory!r}") from None
    except OSError as e:
        raise _save_error(e, path) from None
    try:
        with open(fd, "wb", buffering=0) as f:
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
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return total


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


# -- reading -------------------------------------------------------------------


def restore(core: Port, source: Any, seq_ids: list[int] | None = None,
            progress: Progress | None = None) -> list[int]:
    """Restore sequences from a snapshot into ``store``, all or nothing; return their ids.

    Sequences whose ids exist in the store are replaced (they must not be
    leased by another live process); others are created with the snapshot's ids.
    A store of another geometry (layers, kv_heads, head_dim, dtype) raises
    LayoutMismatchError; capacity limits may differ.
    """
    core.check_writable()
    with _open_source(source) as (reader, is_file):
        return _restore(core, reader, reader.header(), is_file, seq_ids=seq_ids, progress=progress)


def _restore(core: Port, reader: _Reader, snap: Snapshot, is_file: bool, *, seq_ids: list[int] | None,
             progress: Progress | None) -> list[int]:
    """Restore ``snap`` (its header read already) with the arrays that follow in ``reader``."""
    lay = core.layout
    if snap.layout.geometry != lay.geometry or snap.layout.layer_types != lay.layer_types:
        raise LayoutMismatchError(
            f"{reader.where}: snapshot geometry (layers, kv_heads, head_dim, dtype) {snap.layout.geometry} "
            f"and layer kinds differ from store {core.name!r}'s {lay.geometry}; restore into a store "
            f"created with the same geometry (shmkv.load creates one)"
        )
    ids = snap.seq_ids
    if seq_ids is not None:
        wanted = [] if seq_ids is None else int_list("restore", "seq_ids", seq_ids, _ID_HINT)
        missing = [i for i in wanted if i not in ids]
        if missing:
            raise SequenceNotFound(f"{reader.where}: sequences {missing} are not in the snapshot (it has {ids})")
        selected = set(wanted)
    else:
        selected = set(ids)
    total = snap.nbytes
    # a regular file's arrays are copied by the kernel (sendfile) into ranges only staged for them
    direct = is_file and _seekable_fd(reader.f) is not None
    with core.locked(scan=True):  # the journal's way in: a dead holder's transaction rolled back first
        t = core.table_np
        plan: list[tuple[_Seq, int, int]] = []  # (seq, existing slot or -1 - new slot, staged start)
        enc_start: dict[int, int] = {}  # staged encoder ranges
        enc_slot: dict[int, int] = {}
        taken: list[tuple[int, int]] = []
        free_slots = [int(i) for i in np.flatnonzero(t[:, STATE] == 0)]
        free_set = set(free_slots)
        for s in snap.sequences:
            if s.id not in selected:
                continue
            hits = np.flatnonzero((t[:, ID] == s.id) & (t[:, STATE] == LIVE))
            slot = int(hits[0]) if hits.size else -1
            if slot >= 0:
                core.check_not_leased_by_other(core.row(slot), s.id, allow_token=_own(core, slot))
            elif not free_slots:
                raise CacheFullError(
                    f"store {core.name!r} has no free sequence slot for sequence {s.id} of {reader.where} "
                    f"(max_seqs={lay.max_seqs}); free sequences or restore fewer (seq_ids=)"
                )
            else:  # a new sequence: -1 - the slot it will take, its id's own (see Core.slot_of) if free
                own = s.id % lay.max_seqs
                slot = -1 - (free_slots.pop(free_slots.index(own)) if own in free_set else free_slots.pop(0))
                free_set.discard(-1 - slot)
            cap = max(1, min(max(s.capacity, s.length), lay.max_tokens))
            if s.length > lay.max_tokens:
                raise CacheFullError(f"sequence {s.id} of {reader.where} has {s.length} tokens, more than "
                                     f"store {core.name!r}'s max_tokens={lay.max_tokens}")
            try:  # from a file the arrays arrive through the descriptor, which allocates (_stage)
                start = core.alloc(cap, taken, stage=direct)
            except CacheFullError:
                cap = max(1, s.length)
                start = core.alloc(cap, taken, stage=direct)
            taken.append((start, cap))
            plan.append((s, slot, start))
            if s.encoder_length:
                if not free_slots:
                    raise CacheFullError(
                        f"store {core.name!r} has no free slot for the encoder cache of sequence {s.id} "
                        f"(max_seqs={lay.max_seqs}); free sequences or restore fewer (seq_ids=)"
                    )
                enc_slot[s.id] = free_slots.pop()  # from the end: rows of ids to come stay free
                free_set.discard(enc_slot[s.id])
                enc_start[s.id] = core.alloc(s.encoder_length, taken, all_layers=True)
                taken.append((enc_start[s.id], s.encoder_length))
        # stream every array; those selected land in their staged (unpublished) ranges
        by_id = {p[0].id: p for p in plan}
        done = 0
        k = 0
        checks: list[Future[None]] = []
        # sliding/chunked layers' tokens go to private buffers first: an existing
        # sequence's window buffer is live until the publish step below
        windows: dict[tuple[int, int, int], np.ndarray] = {}
        with ThreadPoolExecutor(1) as pool:
            for s in snap.sequences:
                p = by_id.get(s.id)
                for part in _parts(lay, s):
                    nbytes = part.tokens * _token_bytes(lay, part.region)
                    arr = _regions(core)[part.region]
                    if not (p and nbytes):
                        dest = None
                    elif part.window:
                        buf = windows[(s.id, part.region, part.layer)] = np.empty((part.tokens, *arr.shape[2:]),
                                                                                   arr.dtype)
                        dest = memoryview(buf).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
                    else:
                        a = enc_start[s.id] if part.encoder else p[2]
                        view = arr[part.layer, a : a + part.tokens]
                        dest = memoryview(view).cast("B")
                    what = (f"sequence {s.id} layer {part.layer} {'encoder ' if part.encoder else ''}"
                            f"{REGION_NAMES[part.region]}")
                    # from a file into the main arena: the kernel copies (no zeroing, no user-space copy)
                    copy_in = (core.file_copier(view)
                               if dest is not None and direct and not part.window else None)
                    fut = reader.array(dest, nbytes, int(snap.checksums[k]), what, pool, copy_in=copy_in)
                    if fut is not None:
                        checks.append(fut)
                    k += 1
                    done += nbytes
                    if progress:
                        progress(done, total)
            for fut in checks:
                fut.result()  # raises the first mismatch
        if is_file and not reader.at_end():
            raise reader.fail(f"unexpected data after the last array (byte {reader.offset})")
        for s, _, start in plan:  # written: now the rest of each range
            core.settle(start, s.length, next(c for st_, c in taken if st_ == start))
        # everything checked: publish
        # one atomic unit: after a crash, every sequence as it was (crash recovery in _store)
        with core.transaction():
            next_id = core.hdr[_header.W_NEXT_ID]
            for i, (s, existing, start) in enumerate(plan):
                cap = next(c for st_, c in taken if st_ == start)
                assert s.tokens is not None and s.positions is not None
                core.tokens[start : start + s.length] = s.tokens
                core.positions[start : start + s.length] = s.positions
                slot = existing if existing >= 0 else -1 - existing
                row = core.row(slot)
                with core.changing(row):
                    if existing < 0:
                        core.new_incarnation(row)  # a handle on a freed sequence of that id stays dead
                        core.reserve_window(slot)
                        row[WBUF] = 0
                    # a live sequence's window goes into its other buffer (its own stays intact)
                    wb = 1 - row[WBUF] if existing >= 0 else 0
                    w = core.wcell(slot, wb)
                    for (sid, r, layer), buf in windows.items():
                        if sid == s.id:
                            (core.Kl if r == 0 else core.Vl)[layer][w : w + buf.shape[0]] = buf
                    row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF] = start, cap, s.length, s.window_offset
                    row[WBUF] = wb
                    if existing < 0:
                        row[ID], row[LEASE_PID], row[ENC_SLOT] = s.id, 0, 0
                        row[STATE] = LIVE
                    if s.encoder_length:
                        core.set_encoder(row, s.encoder_length, enc_start[s.id], enc_slot[s.id])
                    else:
                        core.drop_encoder(row)
                if i == 0:
                    _crash.point("restore.published")
                next_id = max(next_id, s.id + 1)
            # the prefix cache: finished flags, LRU order (oldest use first) and the index
            for s, existing, _ in sorted(plan, key=lambda p: p[0].recency):
                core.restored(existing if existing >= 0 else -1 - existing, s.finished, s.clean, s.meta)
            core.hdr[_header.W_NEXT_ID] = next_id  # inside the unit: rows back after a crash, ids not reused
    return [p[0].id for p in plan]


def _own(core: Port, slot: int) -> int:
    return own_token(core.row(slot))


def load_with(create: Callable[..., S], core_of: Callable[[S], Port], source: Any, name: str, *, persistent: bool,
              max_tokens: int | None, max_seqs: int | None, progress: Progress | None, **create_kw: Any) -> S:
    """``shmkv.load``: ``create`` (``shmkv.create``) store ``name`` with a snapshot's layout, restore it all
    into its engine (``core_of``)."""
    with _open_source(source) as (reader, is_file):
        snap = reader.header()
        lay = snap.layout
        # an encoder cache takes a table row and a range of its own
        encoders = [s for s in snap.sequences if s.encoder_length]
        need_tokens = sum(max(1, s.length) for s in snap.sequences) + sum(s.encoder_length for s in encoders)
        store = create(
            name, layers=lay.layers, kv_heads=lay.kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
            max_tokens=max_tokens or max(lay.max_tokens, need_tokens),
            max_seqs=max_seqs or max(lay.max_seqs, len(snap.sequences) + len(encoders)),
            layer_types=list(lay.layer_types), window=lay.window or None, chunk=lay.chunk or None,
            memory=lay.memory or None, persistent=persistent, **create_kw,
        )
        try:
            _restore(core_of(store), reader, snap, is_file, seq_ids=None, progress=progress)
        except BaseException:
            store.unlink()
            raise
    return store


__all__ = ["load_with", "remove_stale_temps", "restore", "save"]
