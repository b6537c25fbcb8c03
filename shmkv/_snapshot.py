"""Snapshot files: a msgpack stream of a store's sequences.

Format (version 1), a stream of msgpack objects that any msgpack reader walks:

1. a header map, keys in this order::

       format     "shmkv-snapshot"
       version    1
       layout     map: layers, kv_heads, head_dim, dtype, layer_types, window,
                  chunk, memory, max_tokens, max_seqs
       sequences  array of maps: id, length, capacity, window_offset (oldest token
                  the sliding/chunked layers hold), encoder_length, tokens (bin,
                  int64 LE), positions (bin, int64 LE)
       chunk      largest bin in the stream (64 MiB)
       meta_crc   crc32 of the msgpack encoding of the map's first five entries
       checksums  bin: one uint32 LE crc32 per array below, in stream order

2. the arrays, in order: for each sequence, K of layer 0..L-1 then V of layer
   0..L-1, each ``length x kv_heads x head_dim`` values of the storage dtype
   (little-endian, C order; bfloat16 as its uint16 bits, int8 as codes), and for
   int8 stores then the K and V scales of layer 0..L-1 (``length x kv_heads``
   float32): the stored bytes exactly, never re-quantized. A sliding or chunked
   layer's arrays hold its kept tokens only (``length - window_offset``). A
   sequence with an encoder cache then repeats the same regions for its
   ``encoder_length`` encoder tokens, every layer; split into ``bin`` values of at most 64 MiB (the
   default streaming unpacker refuses larger); an empty array has no bin.

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
import os
import re
import secrets
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import msgpack
import numpy as np

from . import _crash, _dtypes, _header, _lock, _segment
from ._lease import own_token
from ._header import (
    CAPACITY, CLEAN, ENC_SLOT, FINISHED, FLAGS, GEN, ID, LEASE_PID, LENGTH, LIVE, RECENCY, START, STATE, WBUF,
    WIN_OFF,
    Layout,
)
from .errors import (
    AccessDeniedError,
    CacheFullError,
    InvalidArgumentError,
    LayoutMismatchError,
    SequenceNotFound,
    ShmkvError,
    SnapshotError,
)

if TYPE_CHECKING:
    from ._store import Store

FORMAT = "shmkv-snapshot"
VERSION = 1
CHUNK = 64 << 20
# The header holds 16 bytes per saved token (ids, positions) and 4 per array: 256 MiB is
# 16M tokens. Anything larger is refused before it is buffered further.
MAX_HEADER = 256 << 20
MAX_ID = (1 << 62) - 1  # sequence ids (the next id, id + 1, must fit an int64 word)
# what every snapshot starts with: a map whose first entry is format: "shmkv-snapshot"
_MAGIC = msgpack.packb("format") + msgpack.packb(FORMAT)
Progress = Callable[[int, int], None]  # (bytes done, bytes total)
_SAVE_ATTEMPTS = 4


@dataclass
class _Seq:
    id: int
    length: int
    capacity: int
    start: int = 0
    gen: int = 0
    slot: int = -1
    tokens: np.ndarray | None = None
    positions: np.ndarray | None = None
    window_offset: int = 0  # oldest token the sliding/chunked layers hold
    encoder_length: int = 0  # tokens in the sequence's encoder cache
    encoder_start: int = 0
    finished: bool = False  # a cached prefix (seq.finish()): a loaded snapshot is a warm prefix cache
    recency: int = 0  # its last use, for LRU eviction: only the order matters
    clean: int = -1  # tokens [0, clean) may be given as a prefix (-1: all); see _header CLEAN
    meta: bytes = b""  # seq.meta, packed
    wbuf: int = 0  # its active window buffer (see _header WBUF)


def _layout_dict(layout: Layout) -> dict[str, Any]:
    return {
        "layers": layout.layers, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
        "dtype": layout.dtype, "layer_types": list(layout.layer_types), "window": layout.window,
        "chunk": layout.chunk, "memory": layout.memory, "max_tokens": layout.max_tokens,
        "max_seqs": layout.max_seqs,
    }


# -- saving ------------------------------------------------------------------


def _capture(store: Store, ids: list[int] | None) -> list[_Seq]:
    """Each sequence's (start, length, generation) and token ids/positions, seqlock-consistent."""
    t = store._table_np
    if ids is None:
        slots = [int(i) for i in np.flatnonzero(t[:, STATE] == LIVE)]
    else:
        slots = [store._slot_of(i) for i in ids]
    out = []
    for slot in slots:
        row = store._row(slot)
        for i in range(2000):
            g = row[GEN]
            if not g & 1:
                sid, start, cap, length, woff = row[ID], row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF]
                flags, recency, clean, wbuf = row[FLAGS], row[RECENCY], row[CLEAN], row[WBUF]
                meta = store._get_meta(slot)
                enc = row[ENC_SLOT]
                erow = store._row(enc - 1) if enc else None
                e_start, e_len = (erow[START], erow[LENGTH]) if erow is not None else (0, 0)
                toks = store._tokens[start : start + length].copy()
                poss = store._positions[start : start + length].copy()
                if row[GEN] == g:
                    if row[STATE] == LIVE:
                        out.append(_Seq(sid, length, cap, start, g, slot, toks, poss, woff, e_len, e_start,
                                        bool(flags & FINISHED), recency, clean, meta, wbuf))
                    elif ids is not None:
                        raise SequenceNotFound(f"store {store.name!r}: sequence {sid} was freed during the save")
                    break
            if i > 20:
                time.sleep(0.0002)  # a structural op (a move, say) is running
        else:
            raise ShmkvError(f"store {store.name!r}: sequence in slot {slot} kept changing for 0.4 s; save again")
    if ids is not None and len({s.id for s in out}) != len(out):
        raise InvalidArgumentError(f"seq_ids={ids} names a sequence twice")
    return sorted(out, key=lambda s: s.id)


def _unchanged(store: Store, seqs: list[_Seq]) -> bool:
    return all(store._row(s.slot)[GEN] == s.gen and store._row(s.slot)[ID] == s.id for s in seqs)


REGION_NAMES = ("keys", "values", "key scales", "value scales")


@dataclass(frozen=True, slots=True)
class _Part:
    """One array of the stream: a region (see REGION_NAMES) of one layer."""

    region: int
    layer: int
    tokens: int
    encoder: bool  # of the sequence's encoder cache
    window: bool  # a sliding/chunked layer's kept tokens, from its window buffer


def _parts(layout: Layout, s: _Seq) -> list[_Part]:
    """The arrays of sequence ``s`` in stream order: the format's one statement of it,
    used by save, restore and the header check."""
    regions = range(4 if layout.dtype == "int8" else 2)
    bounded = set(layout.bounded)
    out = []
    for r in regions:
        for layer in range(layout.layers):
            win = r < 2 and layer in bounded
            out.append(_Part(r, layer, s.length - s.window_offset if win else s.length, False, win))
    if s.encoder_length:  # then the encoder cache: every region of every layer
        out += [_Part(r, layer, s.encoder_length, True, False) for r in regions for layer in range(layout.layers)]
    return out


def _token_bytes(layout: Layout, region: int) -> int:
    return layout.cell_items * _dtypes.itemsize(layout.dtype) if region < 2 else 4 * layout.kv_heads


def _regions(store: Store) -> tuple[Any, ...]:
    """The main-arena arrays of each region, ``[layers, max_tokens, ...]``."""
    return (store._K, store._V, store._KS, store._VS)


def _arrays(store: Store, s: _Seq) -> list[np.ndarray]:
    """The stored arrays of a sequence in stream order, as views of shared memory."""
    out = []
    w = store._wcell(s.slot, s.wbuf)
    for p in _parts(store.layout, s):
        if p.window:
            out.append((store._Kl, store._Vl)[p.region][p.layer][w : w + p.tokens])
        else:
            a = s.encoder_start if p.encoder else s.start
            out.append(_regions(store)[p.region][p.layer, a : a + p.tokens])
    return out


def _header_bytes(store: Store, seqs: list[_Seq], crcs: list[int]) -> bytes:
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "layout": _layout_dict(store.layout),
        "sequences": [
            {"id": s.id, "length": s.length, "capacity": s.capacity, "window_offset": s.window_offset,
             "encoder_length": s.encoder_length, "finished": s.finished, "recency": s.recency, "clean": s.clean,
             "meta": s.meta,
             "tokens": s.tokens.astype("<i8").tobytes(), "positions": s.positions.astype("<i8").tobytes()}  # type: ignore[union-attr]
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
        return [zlib.crc32(a) for a in arrays]  # type: ignore[arg-type]  # ndarray is a Buffer
    with ThreadPoolExecutor(2) as ex:
        return list(ex.map(zlib.crc32, arrays))


def _write_once(store: Store, f: IO[bytes], seqs: list[_Seq], progress: Progress | None) -> int:
    arrays = [a for s in seqs for a in _arrays(store, s)]
    crcs = _crcs(arrays)
    head = _header_bytes(store, seqs, crcs)
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


def _check_ids(seq_ids: Any, what: str) -> list[int] | None:
    """``seq_ids`` as a list of ints, or None; anything else (1.7, 'a', True) is refused."""
    if seq_ids is None:
        return None
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
        raise InvalidArgumentError(f"{what}: seq_ids={seq_ids!r} must be a list of sequence ids (ints)")
    ids = list(seq_ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise InvalidArgumentError(f"{what}: seq_ids holds {i!r}; sequence ids are ints (Sequence.id)")
    return [int(i) for i in ids]


_TEMP_RE = re.compile(r"\.(?P<base>.+)\.tmp-(?P<pid>\d+)(?:-(?P<start>\d+))?-[0-9a-f]{8}")


def remove_stale_temps(directory: str, base: str | None = None) -> list[str]:
    """Remove the temporary files (``.BASE.tmp-PID-START-XXXX``) of saves whose writer died
    (killed mid-way); a live writer's file is kept. Only files we own. Returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for f in names:
        m = _TEMP_RE.fullmatch(f)
        if m is None or (base is not None and m["base"] != base):
            continue
        if _segment.pid_alive(int(m["pid"]), int(m["start"] or 0)):
            continue
        path = os.path.join(directory, f)
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def save(store: Store, target: Any, seq_ids: list[int] | None = None, progress: Progress | None = None) -> int:
    """Write a snapshot of ``store`` (or of ``seq_ids``) to a path or a binary file object.

    Returns the number of bytes written. See the module docstring for the format
    and the guarantees.
    """
    store._check_open()
    ids = _check_ids(seq_ids, "save")
    if isinstance(target, (str, bytes, os.PathLike)):
        return _save_path(store, os.fsdecode(target), ids, progress)
    if not hasattr(target, "write"):
        raise InvalidArgumentError(f"save target {target!r} is neither a path nor a writable binary file")
    # a stream cannot be rewound: hold the store lock so no structural change can race
    with _lock.held(store._lock_path, store.name, store.lock_timeout):
        seqs = _capture(store, ids)
        total = _write_once(store, target, seqs, progress)
    flush = getattr(target, "flush", None)
    if flush is not None:
        flush()  # a buffered pipe or socket would otherwise hold the tail back
    return total


def _save_path(store: Store, path: str, ids: list[int] | None, progress: Progress | None) -> int:
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    remove_stale_temps(directory, base)  # left by saves that were killed mid-way
    pid = os.getpid()
    tmp = os.path.join(directory, f".{base}.tmp-{pid}-{_segment.process_start_time(pid)}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
                with (_lock.held(store._lock_path, store.name, store.lock_timeout) if last
                      else contextlib.nullcontext()):
                    f.seek(0)
                    f.truncate()
                    seqs = _capture(store, ids)
                    total = _write_once(store, f, seqs, progress)
                    if last or _unchanged(store, seqs):
                        break
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
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


@dataclass
class Snapshot:
    """A parsed, checked snapshot header (``shmkv.read_header`` returns one)."""

    layout: Layout
    sequences: list[_Seq]
    checksums: np.ndarray
    chunk: int

    @property
    def seq_ids(self) -> list[int]:
        return [s.id for s in self.sequences]

    @property
    def nbytes(self) -> int:
        """Bytes of array data the snapshot holds."""
        lay = self.layout
        return sum(p.tokens * _token_bytes(lay, p.region) for s in self.sequences for p in _parts(lay, s))


class _Reader:
    """Reads a snapshot stream: the header via msgpack, arrays straight into memory."""

    def __init__(self, f: IO[bytes], where: str) -> None:
        self.f = f
        self.where = where
        self.pending = b""  # bytes read past the header
        self.offset = 0  # stream offset of the next byte to consume

    def _fail(self, what: str) -> SnapshotError:
        return SnapshotError(f"{self.where}: {what}")

    def header(self) -> Snapshot:
        unp = msgpack.Unpacker(raw=False, max_buffer_size=MAX_HEADER, strict_map_key=True)
        # read1 returns what a pipe or socket has now; read(n) would wait for n bytes
        read = getattr(self.f, "read1", self.f.read)
        head = b""
        while len(head) < 1 + len(_MAGIC):  # refuse a foreign file from its first bytes
            chunk = read(1 << 16)
            if not chunk:
                break
            head += chunk
        if not head:
            raise self._fail("empty file, not a shmkv snapshot")
        if head[0] not in (*range(0x80, 0x90), 0xDE, 0xDF) or head[1 : 1 + len(_MAGIC)] != _MAGIC:
            if len(head) < 1 + len(_MAGIC) and _MAGIC.startswith(head[1:]):
                raise self._fail(f"truncated inside the header (after {len(head)} bytes)")
            raise self._fail(f"not a shmkv snapshot: it does not start with a map of format {FORMAT!r} "
                             f"(first bytes {head[:8].hex()})")
        fed = 0  # bytes fed; only the last chunk is kept (the tail past the header is in it)
        chunk = head
        while True:
            fed += len(chunk)
            try:
                unp.feed(chunk)
            except msgpack.BufferFull:
                raise self._fail(f"header larger than {MAX_HEADER} bytes: not a shmkv snapshot") from None
            try:
                obj = unp.unpack()
                break
            except msgpack.OutOfData:
                pass
            except (ValueError, msgpack.UnpackException, TypeError) as e:
                raise self._fail(f"damaged header ({e})") from None
            chunk = read(1 << 16)
            if not chunk:
                raise self._fail(f"truncated inside the header (after {fed} bytes)")
        used = unp.tell()
        self.pending = chunk[len(chunk) - (fed - used) :] if fed > used else b""
        self.offset = used
        return _parse_header(obj, self._fail)

    def _read(self, n: int) -> bytes:
        out = self.pending[:n]
        self.pending = self.pending[n:]
        while len(out) < n:
            more = self.f.read(n - len(out))
            if not more:
                break
            out += more
        self.offset += len(out)
        return out

    def _readinto(self, mv: memoryview) -> int:
        got = 0
        if self.pending:
            k = min(len(self.pending), len(mv))
            mv[:k] = self.pending[:k]
            self.pending = self.pending[k:]
            got = k
        readinto = getattr(self.f, "readinto", None)
        while got < len(mv):
            if readinto is not None:
                k = readinto(mv[got:])
            else:
                b = self.f.read(len(mv) - got)
                k = len(b)
                mv[got : got + k] = b
            if not k:
                break
            got += k
        self.offset += got
        return got

    def array(self, dest: memoryview | None, nbytes: int, crc: int, what: str,
              pool: ThreadPoolExecutor | None = None) -> Future[None] | None:
        """Read one array of ``nbytes`` into ``dest`` (or a scratch buffer) and check its crc.

        With a ``pool`` and a ``dest``, the crc is checked on the pool (overlapping
        the next read) and the returned future raises SnapshotError on a mismatch.
        """
        deferred = pool is not None and dest is not None
        c = 0
        pos = 0
        scratch = None
        while pos < nbytes:
            at = self.offset
            h = self._read(1)
            if not h:
                raise self._fail(f"truncated at byte {at}: {what} is missing")
            kind = h[0]
            width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(kind)
            if width is None:
                raise self._fail(f"byte {at}: expected a msgpack bin for {what}, found type byte 0x{kind:02x}")
            lb = self._read(width)
            if len(lb) < width:
                raise self._fail(f"truncated at byte {at}: {what} is missing")
            n = int.from_bytes(lb, "big")
            if n == 0 or n > nbytes - pos or n > CHUNK:
                raise self._fail(f"byte {at}: a bin of {n} bytes does not fit {what} ({nbytes - pos} left)")
            if dest is not None:
                target = dest[pos : pos + n]
            else:
                if scratch is None or len(scratch) < n:
                    scratch = memoryview(bytearray(min(CHUNK, nbytes)))
                target = scratch[:n]
            got = self._readinto(target)
            if got < n:
                raise self._fail(f"truncated at byte {self.offset}: {what} has {pos + got} of {nbytes} bytes")
            if not deferred:
                c = zlib.crc32(target, c)
            pos += n
        if deferred:
            assert pool is not None and dest is not None
            return pool.submit(self._check_crc, dest, crc, what)
        if c != crc:
            raise self._fail(f"checksum mismatch in {what} (data damaged)")
        return None

    def _check_crc(self, data: memoryview, crc: int, what: str) -> None:
        if zlib.crc32(data) != crc:
            raise self._fail(f"checksum mismatch in {what} (data damaged)")

    def at_end(self) -> bool:
        return not self.pending and not self.f.read(1)


def _is_packed_dict(b: bytes) -> bool:
    if not b:
        return True
    try:
        return isinstance(msgpack.unpackb(b), dict)
    except Exception:
        return False


def _parse_header(obj: Any, fail: Callable[[str], SnapshotError]) -> Snapshot:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        fmt = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise fail(f"not a shmkv snapshot (format {fmt!r}, expected {FORMAT!r})")
    if obj.get("version") != VERSION:
        raise fail(f"snapshot version {obj.get('version')!r}; this shmkv reads version {VERSION}")
    keys = ["format", "version", "layout", "sequences", "chunk"]
    if list(obj)[:7] != [*keys, "meta_crc", "checksums"]:
        raise fail(f"header keys {list(obj)} are not those of version {VERSION}")
    meta = {k: obj[k] for k in keys}
    if zlib.crc32(msgpack.packb(meta)) != obj["meta_crc"]:
        raise fail("header checksum mismatch (meta_crc): the header is damaged")

    def need(d: Any, key: str, typ: type, where: str) -> Any:
        v = d.get(key) if isinstance(d, dict) else None
        if not isinstance(v, typ) or isinstance(v, bool):
            raise fail(f"{where}.{key} is {v!r}, expected {typ.__name__}")
        return v

    lay = obj["layout"]
    try:
        layout = _header.make_layout(
            layers=need(lay, "layers", int, "layout"), kv_heads=need(lay, "kv_heads", int, "layout"),
            head_dim=need(lay, "head_dim", int, "layout"), dtype=need(lay, "dtype", str, "layout"),
            max_tokens=need(lay, "max_tokens", int, "layout"), max_seqs=need(lay, "max_seqs", int, "layout"),
            layer_types=need(lay, "layer_types", list, "layout"), window=need(lay, "window", int, "layout"),
            chunk=need(lay, "chunk", int, "layout"), memory=need(lay, "memory", int, "layout"),
        )
    except SnapshotError:
        raise
    except ShmkvError as e:
        raise fail(f"layout is not usable: {e}") from None
    need_bytes = _header.offsets(layout, 1).data_bytes
    if need_bytes > _header.MAX_STORE_BYTES:
        raise fail(f"layout is not usable: max_tokens={layout.max_tokens} with this geometry needs {need_bytes} "
                   f"bytes of shared memory, more than shmkv maps ({_header.MAX_STORE_BYTES})")
    seq_list = obj["sequences"]
    if not isinstance(seq_list, list):
        raise fail("sequences is not an array")
    seqs = []
    for i, s in enumerate(seq_list):
        where = f"sequences[{i}]"
        sid, length = need(s, "id", int, where), need(s, "length", int, where)
        cap = need(s, "capacity", int, where)
        woff = need(s, "window_offset", int, where)
        elen = need(s, "encoder_length", int, where)
        toks, poss = need(s, "tokens", bytes, where), need(s, "positions", bytes, where)
        if not 1 <= sid <= MAX_ID:
            raise fail(f"{where}: sequence id {sid} is outside 1..{MAX_ID}")
        if (not 0 <= length <= cap <= 1 << 40 or len(toks) != 8 * length or len(poss) != 8 * length
                or not 0 <= woff <= length or (woff and not layout.bounded)
                or not 0 <= elen <= layout.max_tokens
                or (layout.bounded and length - woff > layout.window_cells)):
            raise fail(f"{where} (id {sid}) declares inconsistent sizes: length {length}, capacity {cap}, "
                       f"{len(toks)} token bytes, {len(poss)} position bytes, window offset {woff}, "
                       f"encoder length {elen} (max_tokens={layout.max_tokens})")
        positions = np.frombuffer(poss, "<i8").astype(np.int64)
        if length and (positions[0] < 0 or (length > 1 and not (np.diff(positions) > 0).all())):
            bad = int(np.flatnonzero(np.diff(positions) <= 0)[0]) + 1 if positions[0] >= 0 else 0
            raise fail(f"{where} (id {sid}): positions must be >= 0 and increase; position {bad} is "
                       f"{int(positions[bad])} after {int(positions[bad - 1]) if bad else 'none'}")
        # prefix-cache state: optional. A snapshot written before it has none, and cannot say
        # whether remove() moved its tokens: its sequences are kept, but are no donors (clean=0)
        finished, recency, clean = s.get("finished", False), s.get("recency", 0), s.get("clean", 0)
        if not (isinstance(finished, bool) and type(recency) is int and 0 <= recency < 1 << 62
                and type(clean) is int and -1 <= clean <= length):
            raise fail(f"{where} (id {sid}) has bad prefix-cache fields: finished {finished!r}, "
                       f"recency {recency!r}, clean {clean!r}")
        meta = s.get("meta", b"")
        if not isinstance(meta, bytes) or len(meta) > _header.META_BYTES or not _is_packed_dict(meta):
            raise fail(f"{where} (id {sid}) has bad meta: it must be a msgpack map of at most "
                       f"{_header.META_BYTES} bytes")
        seqs.append(_Seq(sid, length, cap, tokens=np.frombuffer(toks, "<i8").astype(np.int64),
                         positions=positions, window_offset=woff, encoder_length=elen,
                         finished=finished, recency=recency, clean=clean, meta=meta))
    if len({s.id for s in seqs}) != len(seqs):
        raise fail("sequence ids repeat")
    sums = obj["checksums"]
    n_arrays = sum(len(_parts(layout, s)) for s in seqs)
    if not isinstance(sums, bytes) or len(sums) != 4 * n_arrays:
        raise fail(f"checksums hold {len(sums) if isinstance(sums, bytes) else sums!r} bytes, "
                   f"expected {4 * n_arrays}")
    return Snapshot(layout, seqs, np.frombuffer(sums, "<u4"), need(obj, "chunk", int, "header"))


@contextlib.contextmanager
def _open_source(source: Any) -> Iterator[tuple[_Reader, bool]]:
    if isinstance(source, (str, bytes, os.PathLike)):
        path = os.fsdecode(source)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise SnapshotError(f"snapshot file {path!r} does not exist") from None
        except IsADirectoryError:
            raise SnapshotError(f"{path!r} is a directory, not a snapshot file") from None
        except PermissionError:
            raise AccessDeniedError(f"snapshot file {path!r} is not readable by uid {os.geteuid()}") from None
        except OSError as e:
            raise SnapshotError(f"cannot open snapshot file {path!r}: {os.strerror(e.errno or 0)}") from None
        with f:
            yield _Reader(f, path), True
    elif hasattr(source, "read"):
        yield _Reader(source, getattr(source, "name", "snapshot stream")), False
    else:
        raise InvalidArgumentError(f"snapshot source {source!r} is neither a path nor a readable binary file")


def read_header(source: Any) -> Snapshot:
    """Parse and check a snapshot's header (layout, sequences) without reading the arrays."""
    with _open_source(source) as (reader, _):
        return reader.header()


def restore(store: Store, source: Any, seq_ids: list[int] | None = None,
            progress: Progress | None = None) -> list[int]:
    """Restore sequences from a snapshot into ``store``, all or nothing; return their ids.

    Sequences whose ids exist in the store are replaced (they must not be
    leased by another live process); others are created with the snapshot's ids.
    A store of another geometry (layers, kv_heads, head_dim, dtype) raises
    LayoutMismatchError; capacity limits may differ.
    """
    store._check_writable()
    with _open_source(source) as (reader, is_file):
        return _restore(store, reader, reader.header(), is_file, seq_ids=seq_ids, progress=progress)


def _restore(store: Store, reader: _Reader, snap: Snapshot, is_file: bool, *, seq_ids: list[int] | None,
             progress: Progress | None) -> list[int]:
    """Restore ``snap`` (its header read already) with the arrays that follow in ``reader``."""
    lay = store.layout
    if snap.layout.geometry != lay.geometry or snap.layout.layer_types != lay.layer_types:
        raise LayoutMismatchError(
            f"{reader.where}: snapshot geometry (layers, kv_heads, head_dim, dtype) {snap.layout.geometry} "
            f"and layer kinds differ from store {store.name!r}'s {lay.geometry}; restore into a store "
            f"created with the same geometry (shmkv.load creates one)"
        )
    ids = snap.seq_ids
    if seq_ids is not None:
        wanted = _check_ids(seq_ids, "restore") or []
        missing = [i for i in wanted if i not in ids]
        if missing:
            raise SequenceNotFound(f"{reader.where}: sequences {missing} are not in the snapshot (it has {ids})")
        selected = set(wanted)
    else:
        selected = set(ids)
    total = snap.nbytes
    with _lock.held(store._lock_path, store.name, store.lock_timeout):
        t = store._table_np
        plan: list[tuple[_Seq, int, int]] = []  # (seq, existing slot or -1 - new slot, staged start)
        enc_start: dict[int, int] = {}  # staged encoder ranges
        enc_slot: dict[int, int] = {}
        taken: list[tuple[int, int]] = []
        free_slots = [int(i) for i in np.flatnonzero(t[:, STATE] == 0)]
        for s in snap.sequences:
            if s.id not in selected:
                continue
            hits = np.flatnonzero((t[:, ID] == s.id) & (t[:, STATE] == LIVE))
            slot = int(hits[0]) if hits.size else -1
            if slot >= 0:
                store._check_not_leased_by_other(store._row(slot), s.id, allow_token=_own(store, slot))
            elif not free_slots:
                raise CacheFullError(
                    f"store {store.name!r} has no free sequence slot for sequence {s.id} of {reader.where} "
                    f"(max_seqs={lay.max_seqs}); free sequences or restore fewer (seq_ids=)"
                )
            else:
                slot = -1 - free_slots.pop(0)  # a new sequence: -1 - the slot it will take
            cap = max(1, min(max(s.capacity, s.length), lay.max_tokens))
            if s.length > lay.max_tokens:
                raise CacheFullError(f"sequence {s.id} of {reader.where} has {s.length} tokens, more than "
                                     f"store {store.name!r}'s max_tokens={lay.max_tokens}")
            try:
                start = store._alloc(cap, taken)
            except CacheFullError:
                cap = max(1, s.length)
                start = store._alloc(cap, taken)
            taken.append((start, cap))
            plan.append((s, slot, start))
            if s.encoder_length:
                if not free_slots:
                    raise CacheFullError(
                        f"store {store.name!r} has no free slot for the encoder cache of sequence {s.id} "
                        f"(max_seqs={lay.max_seqs}); free sequences or restore fewer (seq_ids=)"
                    )
                enc_slot[s.id] = free_slots.pop(0)
                enc_start[s.id] = store._alloc(s.encoder_length, taken, all_layers=True)
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
                    arr = _regions(store)[part.region]
                    if not (p and nbytes):
                        dest = None
                    elif part.window:
                        buf = windows[(s.id, part.region, part.layer)] = np.empty((part.tokens, *arr.shape[2:]),
                                                                                   arr.dtype)
                        dest = memoryview(buf).cast("B")  # type: ignore[arg-type]
                    else:
                        a = enc_start[s.id] if part.encoder else p[2]
                        dest = memoryview(arr[part.layer, a : a + part.tokens]).cast("B")
                    what = (f"sequence {s.id} layer {part.layer} {'encoder ' if part.encoder else ''}"
                            f"{REGION_NAMES[part.region]}")
                    fut = reader.array(dest, nbytes, int(snap.checksums[k]), what, pool)
                    if fut is not None:
                        checks.append(fut)
                    k += 1
                    done += nbytes
                    if progress:
                        progress(done, total)
            for fut in checks:
                fut.result()  # raises the first mismatch
        if is_file and not reader.at_end():
            raise reader._fail(f"unexpected data after the last array (byte {reader.offset})")
        # everything checked: publish
        # one atomic unit: after a crash, every sequence as it was (crash recovery in _store)
        with store._unit():
            next_id = store._hdr[_header.W_NEXT_ID]
            for i, (s, existing, start) in enumerate(plan):
                cap = next(c for st_, c in taken if st_ == start)
                assert s.tokens is not None and s.positions is not None
                store._tokens[start : start + s.length] = s.tokens
                store._positions[start : start + s.length] = s.positions
                slot = existing if existing >= 0 else -1 - existing
                row = store._row(slot)
                with store._changing(row):
                    if existing < 0:
                        store._reserve_window(slot)
                        row[WBUF] = 0
                    # a live sequence's window goes into its other buffer (its own stays intact)
                    wb = 1 - row[WBUF] if existing >= 0 else 0
                    w = store._wcell(slot, wb)
                    for (sid, r, layer), buf in windows.items():
                        if sid == s.id:
                            (store._Kl if r == 0 else store._Vl)[layer][w : w + buf.shape[0]] = buf
                    row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF] = start, cap, s.length, s.window_offset
                    row[WBUF] = wb
                    if existing < 0:
                        row[ID], row[LEASE_PID], row[ENC_SLOT] = s.id, 0, 0
                        row[STATE] = LIVE
                    if s.encoder_length:
                        store._set_encoder(row, s.encoder_length, enc_start[s.id], enc_slot[s.id])
                    else:
                        store._drop_encoder(row)
                if i == 0:
                    _crash.point("restore.published")
                next_id = max(next_id, s.id + 1)
            # the prefix cache: finished flags, LRU order (oldest use first) and the index
            for s, existing, _ in sorted(plan, key=lambda p: p[0].recency):
                store._restored(existing if existing >= 0 else -1 - existing, s.finished, s.clean, s.meta)
            store._hdr[_header.W_NEXT_ID] = next_id  # inside the unit: rows back after a crash, ids not reused
    return [p[0].id for p in plan]


def _own(store: Store, slot: int) -> int:
    return own_token(store._row(slot))


def load_with(create: Callable[..., Store], source: Any, name: str, *, persistent: bool, max_tokens: int | None,
              max_seqs: int | None, progress: Progress | None, **create_kw: Any) -> Store:
    """``shmkv.load``: ``create`` (``shmkv.create``) store ``name`` with a snapshot's layout, restore it all."""
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
            _restore(store, reader, snap, is_file, seq_ids=None, progress=progress)
        except BaseException:
            store.unlink()
            raise
    return store


__all__ = ["Snapshot", "load_with", "read_header", "remove_stale_temps", "restore", "save"]
