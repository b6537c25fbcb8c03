"""The value of a chunk in Redis, and how values are sent (``RemoteTier``'s wire).

Value. Exactly one key per chunk, holding header and bytes together, so an
eviction by Redis never leaves half a chunk (LMCache keeps metadata and bytes
under two keys and documents that race):

    ======  ====  ==============================================================
    offset  size  field
    ======  ====  ==============================================================
    0       4     magic ``b"SKVR"``
    4       2     format version (``FORMAT_VERSION``), little-endian
    6       2     zero
    8       4     header length ``h``
    12      4     zero
    16      h     msgpack map: ``fp`` (the layout fingerprint as a map), ``start``
                  (first token index = first position), ``n`` (tokens),
                  ``tokens`` (their ids, int64 little-endian), ``prefix`` (the
                  chained hash of every token up to the chunk's end: what its key
                  names, so a value copied under another prompt's key is refused
                  though its own ids match); then zeros up to
                  ``p = 16 + h`` rounded up to 16 (the payload is aligned)
    p       ...   K ``[layers, n, kv_heads, head_dim]`` in the storage encoding
                  (int8 codes, bfloat16 bits, or the floats), then V the same;
                  int8 only: K scales ``[layers, n, kv_heads]`` float32, V scales
    end-4   4     crc32 of every byte before it (a trailer: push computes it while
                  the K/V bytes go out straight from shared memory, uncopied; values
                  up to 256 KiB, and every value on a Redis Cluster, are joined first)
    ======  ====  ==============================================================

A value that fails any check raises ``Unsound`` naming what it is (``damaged``, or
``foreign``: another layout or format version under our key); the tier counts it, deletes it
and treats it as a miss.

Sending. The K/V bytes go out straight from the store's views, and a structural change of the
sequence while they go (it grows past its capacity and moves, is truncated or freed, and another
sequence takes its cells) would send another sequence's bytes. So a value is first written under
a pending key (``pending_key``: in the same Redis Cluster slot, expiring after ``PENDING_MS``),
and renamed to its key (``publish``: RENAMENX, one copy if two machines push it) only once every
byte is in Redis and the sequence's generation says no such change ran; otherwise the pending
values are deleted (``drop``). A reader never sees a pending key.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any

import msgpack
import numpy as np

from shmkv._engine.table import dtypes as _dtypes
from shmkv._engine.table.header import Layout
from shmkv._engine.prefixes.hashes import HASH_VERSION

__all__ = ["CRC", "FIXED", "FORMAT_VERSION", "MAGIC", "Geometry", "Unsound", "fingerprint", "joined", "payload_offset",
           "PENDING_MS", "drop", "pending_key", "publish", "same_codes", "send_pending", "stream_set", "unpack",
           "value_parts"]

FORMAT_VERSION = 2  # 2: the header's prefix hash
MAGIC = b"SKVR"
FIXED = struct.Struct("<4sHHII")  # magic, version, zero, header length, zero
CRC = struct.Struct("<I")  # the trailer: crc32 of everything before it
_JOIN_BYTES = 256 << 10  # values up to this size are joined and sent in one write
PENDING_MS = 600_000  # a pending value expires (its pusher died before publishing or dropping it)
_PX = b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(PENDING_MS)), PENDING_MS)


class Unsound(ValueError):
    """A value that is not a sound chunk of ours: ``what`` is ``damaged`` or ``foreign``."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def fingerprint(layout: Any, chunk_tokens: int) -> dict[str, Any]:
    """The layout as stored in every chunk header (and hashed into every key)."""
    return {
        "format": FORMAT_VERSION,
        "hash_version": HASH_VERSION,
        "layers": int(layout.layers),
        "kv_heads": int(layout.kv_heads),
        "head_dim": int(layout.head_dim),
        "dtype": str(layout.dtype),
        "layer_types": list(layout.layer_types),
        "window": int(layout.window),
        "chunk": int(layout.chunk),
        "chunk_tokens": int(chunk_tokens),
    }


def fp_hex(fp: dict[str, Any]) -> str:
    packed = msgpack.packb(sorted(fp.items()))
    return hashlib.blake2b(packed, digest_size=8, person=b"shmkv-layout-v1").hexdigest()


class Geometry:
    """Byte geometry of one chunk for one layout (computed once per layout and tier)."""

    def __init__(self, layout: Layout, chunk_tokens: int) -> None:
        self.layout = layout
        self.fp = fingerprint(layout, chunk_tokens)
        self.fp_hex = fp_hex(self.fp)
        self.L, self.H, self.D = layout.layers, layout.kv_heads, layout.head_dim
        self.int8 = layout.dtype == "int8"
        self.code = _dtypes.storage(layout.dtype).newbyteorder("<")  # the wire is little-endian
        self.full = not layout.bounded

    def payload_bytes(self, n: int) -> int:
        b = 2 * self.L * n * self.H * self.D * self.code.itemsize
        return b + (2 * self.L * n * self.H * 4 if self.int8 else 0)

    def arrays(self, buf: Any, off: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """K, V (and int8 scales) as arrays over ``buf`` from ``off`` (zero-copy)."""
        shape = (self.L, n, self.H, self.D)
        cnt = self.L * n * self.H * self.D
        k = np.frombuffer(buf, self.code, cnt, off).reshape(shape)
        off += cnt * self.code.itemsize
        v = np.frombuffer(buf, self.code, cnt, off).reshape(shape)
        off += cnt * self.code.itemsize
        if not self.int8:
            return k, v, None, None
        scnt = self.L * n * self.H
        ks = np.frombuffer(buf, "<f4", scnt, off).reshape(shape[:3])
        vs = np.frombuffer(buf, "<f4", scnt, off + 4 * scnt).reshape(shape[:3])
        return k, v, ks, vs


def value_parts(geo: Geometry, raw: list[Any], toks: np.ndarray, s: int, n: int, *, key: str) -> tuple[list[Any], int]:
    """The value of the chunk of tokens [s, s + n) under ``key`` without its crc trailer, as a list
    of bytes-like parts (the K/V parts are zero-copy views of the store), and the value's size."""
    hdr = msgpack.packb({"fp": geo.fp, "start": s, "n": n, "tokens": toks[s : s + n].astype("<i8").tobytes(),
                         "prefix": prefix_of(key)})
    off = payload_offset(len(hdr))
    parts: list[Any] = [FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(hdr), 0) + hdr
                        + bytes(off - FIXED.size - len(hdr))]
    kv = [(kc, vc) for (kc, _), (vc, _) in raw]
    for which in (0, 1):  # K of every layer, then V of every layer: [layers, n, kv_heads, head_dim]
        parts += [bytes_view(x[which][s : s + n]) for x in kv]
    if geo.int8:
        scales = [(ksc, vsc) for (_, ksc), (_, vsc) in raw]
        for which in (0, 1):
            parts += [bytes_view(x[which][s : s + n]) for x in scales]
    return parts, off + geo.payload_bytes(n) + CRC.size


def pending_key(key: str, tag: str) -> str:
    """Where ``key``'s value waits until it is published: ``{key}`` is its Redis Cluster hash tag
    (our keys hold no braces), so both are in one slot; ``tag``: the push's own."""
    return f"{{{key}}}:pending:{tag}"


# Redis's error replies this module and the pull tell apart, as redis-py gives them: the text
# after a generic ``ERR`` code, the whole text after any other code
NO_SUCH_KEY = "no such key"  # RENAMENX of a key that is not there (a pending value evicted)
WRONG_TYPE = "WRONGTYPE"  # GET of a key that holds another type (not a value of ours)


def reply_is(x: object, reply: str) -> bool:
    """Whether ``x`` is Redis's error reply ``reply`` (``NO_SUCH_KEY``, ``WRONG_TYPE``)."""
    import redis.exceptions as rx

    return isinstance(x, rx.ResponseError) and str(x).startswith(reply)


def publish(r: Any, pairs: list[tuple[str, str]], cluster: bool) -> list[bool]:
    """Each pending key renamed to its key unless the key exists (then the pending value is
    deleted): whether each was renamed. A pending key Redis evicted meanwhile (``maxmemory``) is
    not. One round trip (a Redis Cluster client refuses RENAMENX in a pipeline, though both keys
    are in one slot: three a key there)."""
    import redis.exceptions as rx

    if cluster:
        out = []
        for pending, key in pairs:
            try:
                out.append(bool(r.renamenx(pending, key)))
            except rx.ResponseError as e:
                if not reply_is(e, NO_SUCH_KEY):  # (evicted: not published; anything else is an error)
                    raise
                out.append(False)
            r.persist(key)
            r.delete(pending)
        return out
    pipe = r.pipeline(transaction=False)
    for pending, key in pairs:
        pipe.renamenx(pending, key)
        pipe.persist(key)  # (the pending key's expiry came along)
        pipe.delete(pending)  # (still there when the key existed)
    got = pipe.execute(raise_on_error=False)[::3]
    for x in got:  # (a reply that is an error other than an evicted pending key: raised as before)
        if isinstance(x, Exception) and not reply_is(x, NO_SUCH_KEY):
            raise x
    return [x is True or x == 1 for x in got]


def drop(r: Any, pending: list[str]) -> None:
    """Pending values deleted, unpublished; best effort (left behind, they expire: ``PENDING_MS``)."""
    try:
        pipe = r.pipeline(transaction=False)
        for key in pending:
            pipe.delete(key)
        pipe.execute()
    except Exception:  # (Redis down: the caller raises the error that brought it here, if any)
        pass


def send_pending(r: Any, items: list[tuple[str, list[Any], int]], cluster: bool) -> None:
    """Each value SET under its pending key (``items``: key, parts, size), one round trip: streamed
    from its parts (``stream_set``), or joined first on a Redis Cluster."""
    if not cluster:
        stream_set(r, items)
        return
    pipe = r.pipeline(transaction=False)
    for key, parts, _ in items:
        pipe.set(key, joined(parts), px=PENDING_MS)
    pipe.execute()


def stream_set(r: Any, items: list[tuple[str, list[Any], int]]) -> list[bool]:
    """SET of each value, expiring after ``PENDING_MS`` (pending keys), straight from its parts
    (no copy of the K/V bytes), on one connection, all sent before the replies are read (a
    pipeline). The crc32 trailer is computed while the parts go out."""
    pool = r.connection_pool
    for attempt in (0, 1):
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py < 5.1 wants a command name
            conn = pool.get_connection("SET")
        try:
            for key, parts, size in items:
                kb = key.encode()
                conn.send_packed_command([b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(kb), kb, size)],
                                         check_health=False)
                if size <= _JOIN_BYTES:  # small: one write (a joined copy: cheaper than many sends)
                    value = joined(parts)
                    conn.send_packed_command([value + _PX], check_health=False)
                    continue
                crc = 0
                for part in parts:
                    crc = zlib.crc32(part, crc)
                    conn.send_packed_command([part], check_health=False)
                conn.send_packed_command([CRC.pack(crc) + _PX], check_health=False)
            return [conn.read_response() is not None for _ in items]
        except BaseException as e:
            conn.disconnect()  # replies may be left unread: this connection is done
            import redis.exceptions as rx

            # a pooled connection gone stale (server restarted): once more on a new one (SET repeats safely)
            if attempt or not isinstance(e, rx.ConnectionError):
                raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")


def same_codes(seq: Any, arrays: Any, at: int, a: int, b: int) -> bool:
    k, v, _, _ = arrays
    for li in range(k.shape[0]):
        if not (np.array_equal(seq.raw_keys(li)[0][at : at + b - a], k[li, a:b])
                and np.array_equal(seq.raw_values(li)[0][at : at + b - a], v[li, a:b])):
            return False
    return True


def prefix_of(key: str) -> int:
    """The chained prefix hash a chunk's key names (its last field, 16 hex digits)."""
    return int(key.rsplit(":", 1)[1], 16)


def unpack(geo: Geometry, blob: bytes, t: np.ndarray, s: int, C: int, *, key: str) -> Any:
    """The arrays of the chunk of tokens [s, s + C) of ``t`` in ``blob``, read under ``key``,
    checked: magic, version, checksum, fingerprint, start, length, token ids and the prefix hash
    the key names. ``Unsound`` if any differs."""
    what = "damaged"
    try:
        magic, version, _, hlen, _ = FIXED.unpack_from(blob, 0)
        if magic != MAGIC:
            raise ValueError("magic")
        if version != FORMAT_VERSION:
            what = "foreign"
            raise ValueError("version")
        if len(blob) < FIXED.size + CRC.size or (
                zlib.crc32(memoryview(blob)[: -CRC.size]) != CRC.unpack_from(blob, len(blob) - CRC.size)[0]):
            raise ValueError("checksum")
        hdr = msgpack.unpackb(memoryview(blob)[FIXED.size : FIXED.size + hlen])
        if hdr.get("fp") != geo.fp:
            what = "foreign"
            raise ValueError("layout")
        off = payload_offset(hlen)
        if (hdr.get("start") != s or hdr.get("n") != C or len(blob) != off + geo.payload_bytes(C) + CRC.size
                or hdr.get("tokens") != t[s : s + C].tobytes() or hdr.get("prefix") != prefix_of(key)):
            raise ValueError("start, length, token ids or the prefix before them")
        return geo.arrays(blob, off, C)
    except (ValueError, TypeError, KeyError, struct.error, msgpack.UnpackException, AttributeError) as e:
        raise Unsound(what) from e


def bytes_view(a: np.ndarray) -> memoryview:
    """A contiguous array's bytes, zero-copy."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def joined(parts: list[Any]) -> bytes:
    """A value in one piece: its parts and the crc32 trailer."""
    body = b"".join(parts)
    return body + CRC.pack(zlib.crc32(body))


def payload_offset(hlen: int) -> int:
    return -(-(FIXED.size + hlen) // 16) * 16
