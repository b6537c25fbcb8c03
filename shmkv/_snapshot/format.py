"""Snapshot files: the format, and the reader that parses and checks it (``_snapshot`` saves and restores).

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
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import msgpack
import numpy as np

from shmkv._engine.table import dtypes as _dtypes
from shmkv._engine.table import header as _header
from shmkv._engine.table.header import Layout
from shmkv.errors import AccessDeniedError, InvalidArgumentError, ShmkvError, SnapshotError

FORMAT = "shmkv-snapshot"
VERSION = 1
CHUNK = 64 << 20
# The header holds 16 bytes per saved token (ids, positions) and 4 per array: 256 MiB is
# 16M tokens. Anything larger is refused before it is buffered further.
MAX_HEADER = 256 << 20
MAX_ID = (1 << 62) - 1  # sequence ids (the next id, id + 1, must fit an int64 word)
ID_HINT = " (sequence ids: Sequence.id)"  # what save's and restore's seq_ids= errors add
Progress = Callable[[int, int], None]  # a save's or a restore's callback: (bytes done, bytes total)

try:  # ISA-L's CRC-32 (extra "fast": pip install 'shmkv[fast]'): zlib's very values, about 5x faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - without the extra
    from zlib import crc32 as _crc32
crc32 = _crc32  # the checksum of every array (this module's name for it)
CRC32 = crc32.__module__  # which one (tools/bench.py prints it)
# what every snapshot starts with: a map whose first entry is format: "shmkv-snapshot"
_MAGIC = msgpack.packb("format") + msgpack.packb(FORMAT)


@dataclass
class SeqRecord:
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
    clean: int = -1  # tokens [0, clean) may be given as a prefix (-1: all); see ``_engine/table/header.py`` CLEAN
    meta: bytes = b""  # seq.meta, packed
    wbuf: int = 0  # its active window buffer (see ``_engine/table/header.py`` WBUF)


def seekable_fd(f: IO[bytes]) -> int | None:
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


def layout_dict(layout: Layout) -> dict[str, Any]:
    return {
        "layers": layout.layers, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
        "dtype": layout.dtype, "layer_types": list(layout.layer_types), "window": layout.window,
        "chunk": layout.chunk, "memory": layout.memory, "max_tokens": layout.max_tokens,
        "max_seqs": layout.max_seqs,
    }


REGION_NAMES = ("keys", "values", "key scales", "value scales")


@dataclass(frozen=True, slots=True)
class _Part:
    """One array of the stream: a region (see REGION_NAMES) of one layer."""

    region: int
    layer: int
    tokens: int
    encoder: bool  # of the sequence's encoder cache
    window: bool  # a sliding/chunked layer's kept tokens, from its window buffer


def seq_parts(layout: Layout, s: SeqRecord) -> list[_Part]:
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


def token_bytes(layout: Layout, region: int) -> int:
    return layout.cell_items * _dtypes.itemsize(layout.dtype) if region < 2 else 4 * layout.kv_heads


@dataclass
class Snapshot:
    """A parsed, checked snapshot header (``shmkv.read_header`` returns one)."""

    layout: Layout
    sequences: list[SeqRecord]
    checksums: np.ndarray
    chunk: int

    @property
    def seq_ids(self) -> list[int]:
        return [s.id for s in self.sequences]

    @property
    def nbytes(self) -> int:
        """Bytes of array data the snapshot holds."""
        lay = self.layout
        return sum(p.tokens * token_bytes(lay, p.region) for s in self.sequences for p in seq_parts(lay, s))


class SnapshotReader:
    """Reads a snapshot stream: the header via msgpack, arrays straight into memory."""

    def __init__(self, f: IO[bytes], where: str) -> None:
        self.f = f
        self.where = where
        self.pending = b""  # bytes read past the header
        self.offset = 0  # stream offset of the next byte to consume
        self.size = -1  # the file's size, once asked (_copy_into: a regular file, not growing)

    def fail(self, what: str) -> SnapshotError:
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
            raise self.fail("empty file, not a shmkv snapshot")
        if head[0] not in (*range(0x80, 0x90), 0xDE, 0xDF) or head[1 : 1 + len(_MAGIC)] != _MAGIC:
            if len(head) < 1 + len(_MAGIC) and _MAGIC.startswith(head[1:]):
                raise self.fail(f"truncated inside the header (after {len(head)} bytes)")
            raise self.fail(f"not a shmkv snapshot: it does not start with a map of format {FORMAT!r} "
                             f"(first bytes {head[:8].hex()})")
        fed = 0  # bytes fed; only the last chunk is kept (the tail past the header is in it)
        chunk = head
        while True:
            fed += len(chunk)
            try:
                unp.feed(chunk)
            except msgpack.BufferFull:
                raise self.fail(f"header larger than {MAX_HEADER} bytes: not a shmkv snapshot") from None
            try:
                obj = unp.unpack()
                break
            except msgpack.OutOfData:
                pass
            except (ValueError, msgpack.UnpackException, TypeError) as e:
                raise self.fail(f"damaged header ({e})") from None
            chunk = read(1 << 16)
            if not chunk:
                raise self.fail(f"truncated inside the header (after {fed} bytes)")
        used = unp.tell()
        self.pending = chunk[len(chunk) - (fed - used) :] if fed > used else b""
        self.offset = used
        return _parse_header(obj, self.fail)

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
              pool: ThreadPoolExecutor | None = None, *,
              copy_in: Callable[[int, int, int, int], None] | None = None) -> Future[None] | None:
        """Read one array of ``nbytes`` into ``dest`` (or a scratch buffer) and check its crc.

        With a ``pool`` and a ``dest``, the crc is checked on the pool (overlapping
        the next read) and the returned future raises SnapshotError on a mismatch.
        ``copy_in(pos, fd, offset, n)``, for a file source: copies the file's bytes at
        ``offset`` to ``dest[pos:]`` itself (in the kernel, see Pages.file_copier).
        """
        deferred = pool is not None and dest is not None
        c = 0
        pos = 0
        scratch = None
        while pos < nbytes:
            at = self.offset
            h = self._read(1)
            if not h:
                raise self.fail(f"truncated at byte {at}: {what} is missing")
            kind = h[0]
            width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(kind)
            if width is None:
                raise self.fail(f"byte {at}: expected a msgpack bin for {what}, found type byte 0x{kind:02x}")
            lb = self._read(width)
            if len(lb) < width:
                raise self.fail(f"truncated at byte {at}: {what} is missing")
            n = int.from_bytes(lb, "big")
            if n == 0 or n > nbytes - pos or n > CHUNK:
                raise self.fail(f"byte {at}: a bin of {n} bytes does not fit {what} ({nbytes - pos} left)")
            if dest is not None and copy_in is not None and pool is not None:
                got = self._copy_into(copy_in, pos, n)
                if got < n:
                    raise self.fail(f"truncated at byte {self.offset}: {what} has {pos + got} of {nbytes} bytes")
                pos += n
                continue
            if dest is not None:
                target = dest[pos : pos + n]
            else:
                if scratch is None or len(scratch) < n:
                    scratch = memoryview(bytearray(min(CHUNK, nbytes)))
                target = scratch[:n]
            got = self._readinto(target)
            if got < n:
                raise self.fail(f"truncated at byte {self.offset}: {what} has {pos + got} of {nbytes} bytes")
            if not deferred:
                c = crc32(target, c)
            pos += n
        if deferred:
            assert pool is not None and dest is not None
            return pool.submit(self._check_crc, dest, crc, what)
        if c != crc:
            raise self.fail(f"checksum mismatch in {what} (data damaged)")
        return None

    def _copy_into(self, copy_in: Callable[[int, int, int, int], None], pos: int, n: int) -> int:
        """``_readinto(dest[pos : pos + n])`` with the file's bytes copied by ``copy_in``, all
        of them: what was read ahead (``pending``) is in the file too, and the destination is
        written through the descriptor only (its pages may not be allocated yet)."""
        fd = self.f.fileno()
        if self.size < 0:
            self.size = os.fstat(fd).st_size  # once, not once a bin
        k = max(0, min(n, self.size - self.offset))
        self.pending = b""  # bytes [offset, offset + len(pending)) of the file
        if k:
            copy_in(pos, fd, self.offset, k)
        self.offset += k
        self.f.seek(self.offset)
        return k

    def _check_crc(self, data: memoryview, crc: int, what: str) -> None:
        if crc32(data) != crc:
            raise self.fail(f"checksum mismatch in {what} (data damaged)")

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
        seqs.append(SeqRecord(sid, length, cap, tokens=np.frombuffer(toks, "<i8").astype(np.int64),
                         positions=positions, window_offset=woff, encoder_length=elen,
                         finished=finished, recency=recency, clean=clean, meta=meta))
    if len({s.id for s in seqs}) != len(seqs):
        raise fail("sequence ids repeat")
    sums = obj["checksums"]
    n_arrays = sum(len(seq_parts(layout, s)) for s in seqs)
    if not isinstance(sums, bytes) or len(sums) != 4 * n_arrays:
        raise fail(f"checksums hold {len(sums) if isinstance(sums, bytes) else sums!r} bytes, "
                   f"expected {4 * n_arrays}")
    return Snapshot(layout, seqs, np.frombuffer(sums, "<u4"), need(obj, "chunk", int, "header"))


@contextlib.contextmanager
def open_source(source: Any) -> Iterator[tuple[SnapshotReader, bool]]:
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
            yield SnapshotReader(f, path), True
    elif hasattr(source, "read") and not isinstance(source, io.TextIOBase):
        yield SnapshotReader(source, getattr(source, "name", "snapshot stream")), False
    else:
        raise InvalidArgumentError(f"snapshot source {source!r} is neither a path nor a readable binary file "
                                   "(open it with 'rb')")


def read_header(source: Any) -> Snapshot:
    """Parse and check a snapshot's header (layout, sequences) without reading the arrays."""
    with open_source(source) as (reader, _):
        return reader.header()
