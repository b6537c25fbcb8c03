"""Remote tier on Redis: stores on several machines share computed prefixes (docs/design.md §9).

A prompt prefilled on one machine is pushed to Redis (or Valkey, its API twin,
or a Redis Cluster) in chunks of ``chunk_tokens`` tokens; a store on another
machine pulls the chunks that continue its local prefix match instead of
recomputing them. There is no server of ours: Redis is the shared engine, as
LMCache's Redis connector does for vLLM. ``pip install 'shmkv[redis]'``.

Keys. A chunk of tokens ``[s, e)`` is named by the chained prefix hash of
``tokens[:e]`` (shmkv._engine.prefixes.hashes; the same on every machine), so it is found
only after the same whole prefix::

    {namespace}:shmkv:{layout fingerprint}:{HASH_VERSION}:{prefix hash, 16 hex}

The fingerprint (16 hex) covers the format version, the layout (layers,
kv_heads, head_dim, dtype, layer kinds, window, chunk) and ``chunk_tokens``:
a store of another layout asks for other keys and never sees these chunks.

Value: one key per chunk, header and bytes together (the layout of a value: ``_wire``).

A chunk is loaded only if magic, version, checksum, fingerprint, start, length
and token ids (against the prompt's) all agree; otherwise it is a miss, never
loaded, deleted from Redis, and counted (``stats().damaged`` / ``.foreign``).

Only chunks whose tokens sit at positions 0..n-1 with known ids, computed from
position 0, are pushed (what a prefix is, §8), each published only once all of it
is in Redis and the sequence's cells were nobody else's meanwhile (``_wire``), and
only for stores whose layers are all full attention: sliding and chunked layers
hold only their most recent tokens, so the first chunks of a long sequence no
longer exist there (``push`` raises
``NotSupportedError``; ``match`` and ``pull`` find nothing).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmkv._sequence import quant as _quant
from shmkv._sequence.reads import stamp
from shmkv._engine.prefixes.hashes import BLOCK, HASH_VERSION, as_tokens, block_hashes
from shmkv.errors import InvalidArgumentError, NotSupportedError, ReadOnlyError, RemoteError, ShmkvError
from shmkv.remote._client import check_settings, connect, is_redis_error, redact, what_to_do
from shmkv.remote._wire import (
    FORMAT_VERSION,
    WRONG_TYPE,
    Geometry,
    Unsound,
    drop,
    fingerprint,
    pending_key,
    publish,
    reply_is,
    same_codes,
    send_pending,
    unpack,
    value_parts,
)

__all__ = ["FORMAT_VERSION", "RemoteTier", "TierStats", "fingerprint"]

_BATCH_BYTES = 16 << 20  # bytes of chunks a pull's pipeline carries at once (two in flight bound its memory)
_GROUP_BYTES = 64 << 20  # bytes of chunks a push sends in one round trip
_EXISTS_BATCH = 4096


@dataclass(frozen=True, slots=True)
class TierStats:
    """What this ``RemoteTier`` object did (this process only; Redis keeps no counters of ours)."""

    chunks_pushed: int = 0  # chunks a push published
    bytes_pushed: int = 0
    chunks_pulled: int = 0  # chunks fetched that were loaded (in whole or part)
    bytes_pulled: int = 0
    tokens_pulled: int = 0
    damaged: int = 0  # failed magic, checksum, length or token ids: a miss, deleted
    foreign: int = 0  # another layout or format version under our key: a miss, deleted
    errors: int = 0  # connection errors and timeouts (a pull degraded, a push raised)


class RemoteTier:
    """A Redis tier shared by stores on several machines.

    Args:
        url: ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS). With
            ``cluster=True``, any node of the Redis Cluster (the db must be 0).
        namespace: prefix of every key (``[A-Za-z0-9_.-]``, at most 64): one per model,
            so models never share chunks even if their layouts agree.
        chunk_tokens: tokens a chunk (a multiple of 16); every store sharing a namespace
            must use the same value to find each other's chunks.
        cluster: use redis-py's ``RedisCluster`` client (keys spread over the cluster's
            servers by hash slot) instead of ``Redis``.
        timeout: seconds for connecting and for each socket read or write.

    The client connects lazily, on first use, and reconnects after fork. A tier
    pickles by its settings, so it can be handed to child processes.

    Example:
        >>> tier = RemoteTier("redis://10.0.0.5:6379/0", namespace="llama-8b")  # doctest: +SKIP
        >>> tier.push(store, seq.id)                                # doctest: +SKIP
        >>> tier.match(store.layout, prompt)                       # doctest: +SKIP
    """

    def __init__(self, url: str, *, namespace: str = "default", chunk_tokens: int = 256,
                 cluster: bool = False, timeout: float = 2.0) -> None:
        check_settings(url, namespace, chunk_tokens, timeout)
        self.url = url
        self.namespace = namespace
        self.chunk_tokens = int(chunk_tokens)
        self.cluster = bool(cluster)
        self.timeout = float(timeout)
        self._client: Any = None
        self._geo: dict[Any, Geometry] = {}
        self._stats = dict.fromkeys(TierStats.__slots__, 0)

    def __repr__(self) -> str:
        kind = " cluster" if self.cluster else ""
        return (f"<shmkv.RemoteTier {redact(self.url)}{kind} namespace={self.namespace!r} "
                f"chunk_tokens={self.chunk_tokens}>")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_make_tier, (self.url, self.namespace, self.chunk_tokens, self.cluster, self.timeout))

    # -- connection ------------------------------------------------------------

    def _redis(self) -> Any:
        if self._client is None:
            self._client = connect(self.url, self.cluster, self.timeout, self._call)
        return self._client

    def _call(self, fn: Any) -> Any:
        """Run ``fn`` mapping every Redis failure to RemoteError naming the URL."""
        try:
            return fn()
        except RemoteError:
            raise
        except Exception as e:
            if not is_redis_error(e):
                raise
            self._stats["errors"] += 1
            raise RemoteError(
                f"Redis tier {redact(self.url)}{' (cluster)' if self.cluster else ''} failed: "
                f"{type(e).__name__}: {e}; {what_to_do(e, self.timeout)}"
            ) from e

    def close(self) -> None:
        """Close the connections (the tier reconnects if used again)."""
        c, self._client = self._client, None
        if c is None:
            return
        try:
            if self.cluster:  # RedisCluster.close() can leave node connections open (redis-py 8, after SCAN)
                for node in c.get_nodes():
                    if node.redis_connection is not None:
                        node.redis_connection.connection_pool.disconnect()
            c.close()
        except Exception:  # closing a broken connection must not raise
            pass

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- names -----------------------------------------------------------------

    def _geometry(self, layout: Any) -> Geometry:
        g = self._geo.get(layout)
        if g is None:
            g = self._geo[layout] = Geometry(layout, self.chunk_tokens)
        return g

    def _keys(self, geo: Geometry, tokens: np.ndarray, chunks: int) -> list[str]:
        """Keys of the first ``chunks`` chunks of ``tokens``."""
        per = self.chunk_tokens // BLOCK
        hashes = block_hashes(tokens, limit=chunks * per)
        base = f"{self.namespace}:shmkv:{geo.fp_hex}:{HASH_VERSION}:"
        return [f"{base}{hashes[(i + 1) * per - 1]:016x}" for i in range(chunks)]

    def key(self, layout: Any, tokens: Any) -> str:
        """The key of the chunk ending at the end of ``tokens`` (a multiple of chunk_tokens long)."""
        t = as_tokens(tokens)
        if not len(t) or len(t) % self.chunk_tokens:
            raise InvalidArgumentError(
                f"key: {len(t)} tokens is not a whole number of chunks (chunk_tokens={self.chunk_tokens})"
            )
        return self._keys(self._geometry(layout), t, len(t) // self.chunk_tokens)[-1]

    def stats(self) -> TierStats:
        """Counters of this tier object (this process)."""
        return TierStats(**self._stats)

    # -- match -------------------------------------------------------------------

    def match(self, layout: Any, tokens: Any) -> int:
        """Tokens of ``tokens`` the tier can serve: whole chunks from token 0 (no ``len - 1`` cap).

        Checks existence only (pipelined EXISTS): no download, no checksum, so a chunk
        damaged in Redis still counts here (a pull then stops before it).

        Raises:
            RemoteError: Redis is down or timed out.
        """
        geo = self._geometry(layout)
        t = as_tokens(tokens)
        chunks = len(t) // self.chunk_tokens
        if not geo.full or not chunks:
            return 0
        keys = self._keys(geo, t, chunks)
        found = next((i for i, there in enumerate(self._existing(keys)) if not there), chunks)
        return found * self.chunk_tokens

    def _existing(self, keys: list[str]) -> Iterator[bool]:
        """Whether each key is in Redis: pipelined EXISTS, ``_EXISTS_BATCH`` keys a round trip,
        lazily (a caller that stops at the first missing chunk sends no further batch)."""
        r = self._redis()
        for b in range(0, len(keys), _EXISTS_BATCH):
            pipe = r.pipeline(transaction=False)
            for k in keys[b : b + _EXISTS_BATCH]:
                pipe.exists(k)
            yield from (bool(e) for e in self._call(pipe.execute))

    # -- push --------------------------------------------------------------------

    def push(self, store: Any, seq_id: int) -> int:
        """Upload sequence ``seq_id``'s committed tokens, in whole chunks not in Redis yet.

        Only the leading tokens at positions 0..n-1 with known ids (not -1), computed
        from position 0 (not moved by ``remove`` or ``shift_left``), are a prefix; a
        trailing partial chunk stays local. Existing chunks are skipped (pipelined
        EXISTS); new ones are sent under pending keys and published (renamed, unless
        another push of the same prefix was first: one copy) only if no structural
        change of the sequence ran while they went out (a move as it grows, a truncate,
        its free): then the push stops and deletes them, and returns what it published
        before. A read-only attachment can push.

        Returns:
            The chunks written (0 when all were there already).

        Raises:
            RemoteError: Redis is down, timed out, or refused the write (e.g. out of memory).
            NotSupportedError: the store has sliding or chunked layers.
        """
        layout = store.layout
        geo = self._geometry(layout)
        if not geo.full:
            raise NotSupportedError(
                f"push: store {store.name!r} has sliding/chunked layers ({', '.join(set(layout.layer_types))}); "
                "they keep only recent tokens, so whole prefixes cannot be pushed (remote tier: full layers only)"
            )
        seq = store.sequence(seq_id)
        gen, faithful = stamp(seq)
        toks = np.array(seq.tokens)
        pos = np.array(seq.positions)
        raw = [(seq.raw_keys(li), seq.raw_values(li)) for li in range(geo.L)]
        if gen % 2 or stamp(seq)[0] != gen:  # a structural change ran meanwhile: nothing read is sure
            return 0
        n = len(toks) if faithful < 0 else min(len(toks), faithful)
        bad = np.flatnonzero((pos[:n] != np.arange(n)) | (toks[:n] < 0))
        usable = int(bad[0]) if bad.size else n
        C = self.chunk_tokens
        chunks = usable // C
        if not chunks:
            return 0
        keys = self._keys(geo, toks, chunks)
        missing = [i for i, there in enumerate(self._existing(keys)) if not there]
        if not missing:
            return 0
        r = self._redis()
        tag = os.urandom(8).hex()  # (this push's pending keys: _wire's docstring)
        # Groups of chunks, one round trip each (one chunk a group when chunks are big).
        per = max(1, _GROUP_BYTES // (geo.payload_bytes(C) + 4096))
        written = 0
        for g in range(0, len(missing), per):
            batch = missing[g : g + per]
            items = [(pending_key(keys[i], tag), *value_parts(geo, raw, toks, i * C, C, key=keys[i])) for i in batch]
            pending = [key for key, _, _ in items]
            try:
                self._call(lambda items=items: send_pending(r, items, self.cluster))
                # every byte of the group is in Redis: the sequence's own only if its cells were
                # never another's meanwhile (the generation moves with any change that could do that)
                same = stamp(seq)[0] == gen
            except BaseException:
                drop(r, pending)
                raise
            if not same:
                drop(r, pending)
                break
            published = self._call(lambda pending=pending, batch=batch: publish(
                r, [(p, keys[i]) for p, i in zip(pending, batch, strict=True)], self.cluster))
            for (_, _, size), ok in zip(items, published, strict=True):
                if ok:
                    written += 1
                    self._stats["chunks_pushed"] += 1
                    self._stats["bytes_pushed"] += size
        return written

    # -- pull --------------------------------------------------------------------

    def pull(self, seq: Any, tokens: Any, have: int | None = None) -> int:
        """Append to ``seq`` the chunks of the prompt ``tokens`` that follow its first ``have`` tokens.

        ``seq`` (a write handle) holds the prompt's first ``have`` tokens (default: its
        length), for instance what the local prefix cache gave it. The whole chunks
        that continue the prompt are fetched (pipelined GET), each checked (checksum,
        layout, start, token ids) before it is loaded, and appended with their token
        ids and positions, up to ``len(tokens) - 1`` tokens in all (the caller runs at
        least one token); a chunk straddling ``have`` or the cap is loaded in part.
        The first missing or damaged chunk ends the pull.

        A tier that is down or times out ends the pull with a ``RuntimeWarning``
        (serving continues with what the sequence holds). This is what
        ``store.create_sequence(prefix=tokens, tier=tier)`` runs after the local match.

        Returns:
            Tokens appended (0 on a miss).
        """
        t = as_tokens(tokens)
        have = _pull_from(seq, t, have)
        geo = self._geometry(seq.store.layout)
        C = self.chunk_tokens
        cap = len(t) - 1
        chunks = len(t) // C  # chunks wholly inside the prompt: only those can be named
        first = have // C
        if not geo.full or cap <= have or first >= chunks:
            return 0
        try:
            keys = self._keys(geo, t, chunks)
            return self._pull(geo, seq, t, keys, first=first, have=have, cap=cap)
        except RemoteError as e:
            warnings.warn(f"{e}; continuing with the {len(seq)} tokens held locally", RuntimeWarning, stacklevel=2)
            return len(seq) - have

    def _pull(self, geo: Geometry, seq: Any, t: np.ndarray, keys: list[str], *, first: int, have: int,
              cap: int) -> int:
        C = self.chunk_tokens
        r = self._redis()
        per = max(1, _BATCH_BYTES // (geo.payload_bytes(C) + 4096))
        batches = [range(b, min(b + per, len(keys))) for b in range(first, len(keys), per)]

        def fetch(j: int) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for i in batches[j]:
                pipe.get(keys[i])

            def run() -> list[Any]:  # a key of another type is that chunk's miss, not the batch's failure
                out = list(pipe.execute(raise_on_error=False))
                for x in out:
                    if isinstance(x, Exception) and not reply_is(x, WRONG_TYPE):
                        raise x
                return out

            return list(self._call(run))

        pos = have
        # The next batch is fetched on a helper thread while this one is checked and written into
        # the store (recv, crc32 and copies release the GIL). A miss may leave one batch fetched
        # for nothing: reads only.
        with ThreadPoolExecutor(1) if len(batches) > 1 else _Inline() as ex:
            nxt = ex.submit(fetch, 0)
            for j, batch in enumerate(batches):
                blobs = nxt.result()
                if j + 1 < len(batches):
                    nxt = ex.submit(fetch, j + 1)
                for i, blob in zip(batch, blobs, strict=True):
                    s = i * C
                    if blob is None:
                        return pos - have
                    if isinstance(blob, Exception):  # (WRONGTYPE: not a value of ours under our key)
                        self._discard(keys[i], "foreign")
                        return pos - have
                    try:
                        arrays = unpack(geo, blob, t, s, C, key=keys[i])
                    except Unsound as e:
                        self._discard(keys[i], e.what)
                        return pos - have
                    a, b = pos - s, min(s + C, cap) - s  # the part of the chunk after what we hold
                    if not self._load(geo, seq, arrays, keys[i], t, s=s, a=a, b=b):
                        return pos - have
                    pos = s + b
                    self._stats["chunks_pulled"] += 1
                    self._stats["bytes_pulled"] += len(blob)
                    self._stats["tokens_pulled"] += b - a
                    if pos >= cap:
                        return pos - have
        return pos - have

    def _load(self, geo: Geometry, seq: Any, arrays: Any, key: str, t: np.ndarray, *, s: int, a: int,
              b: int) -> bool:
        """Append tokens ``[s + a, s + b)`` of a checked chunk to ``seq``; False if it cannot be loaded.

        The checksum is integrity, not authentication: a chunk can pass it and still hold values
        no store takes (int8 scales that are inf or NaN, say), or the store can be out of room.
        Any such chunk is a miss: nothing of it stays in ``seq`` (extend is all or nothing, and a
        chunk whose int8 codes do not come back the same is truncated away), a chunk whose content
        is refused is removed as a damaged one, and the pull ends there."""
        k, v, ks, vs = arrays
        try:
            if ks is not None and vs is not None:  # int8: dequantized; extend quantizes to the same codes
                if not (np.isfinite(ks[:, a:b]).all() and np.isfinite(vs[:, a:b]).all()):
                    raise ValueError("int8 scales that are not finite")
                k = _quant.dequantize_int8(k[:, a:b], ks[:, a:b])
                v = _quant.dequantize_int8(v[:, a:b], vs[:, a:b])
            elif geo.layout.dtype == "bfloat16":
                k, v = _quant.from_bf16(k[:, a:b]), _quant.from_bf16(v[:, a:b])
            else:
                k, v = k[:, a:b], v[:, a:b]
            seq.extend(k, v, tokens=t[s + a : s + b], positions=np.arange(s + a, s + b))
        except (ValueError, ArithmeticError):  # the content (InvalidArgumentError is a ValueError)
            self._discard(key, "damaged")
            return False
        except ShmkvError:  # the store's side (full, lock timeout): the chunk stays in Redis
            return False
        if ks is not None and not same_codes(seq, arrays, s + a, a, b):
            seq.truncate(s + a)  # never keep a value that differs from the pushed one
            return False
        return True

    def _discard(self, key: str, what: str) -> None:
        """Count a chunk that is not loaded and remove it, so a later push can replace it (RENAMENX
        would keep it forever). Best effort: the read-only user of a shared Redis may not delete."""
        self._stats[what] += 1
        try:
            self._redis().delete(key)
        except Exception as e:
            if not is_redis_error(e):
                raise

def _pull_from(seq: Any, t: np.ndarray, have: Any) -> int:
    """``pull``'s arguments checked before any fetch: ``seq`` a write handle holding the first
    ``have`` tokens of the prompt ``t`` (default: its length), returned."""
    if not seq.writable:
        raise ReadOnlyError(f"pull: sequence {seq.id}'s handle is read-only; pull into a write handle "
                            f"(store.sequence({seq.id}, write=True))")
    length = len(seq)
    if have is not None and (isinstance(have, bool) or not isinstance(have, (int, np.integer))):
        raise InvalidArgumentError(f"pull: have={have!r} must be an int (the tokens the sequence holds)")
    have = length if have is None else int(have)
    if have != length:
        raise InvalidArgumentError(f"pull: have={have} but sequence {seq.id} holds {length} tokens")
    if have and not np.array_equal(seq.tokens[:have], t[:have]):
        raise InvalidArgumentError(f"pull: the {have} tokens sequence {seq.id} holds are not the prompt's first {have}")
    return have


class _Inline:
    """ThreadPoolExecutor's submit and with, run at once in this thread (one batch: no thread)."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        f: Future[Any] = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:
            f.set_exception(e)
        return f


def _make_tier(url: str, namespace: str, chunk_tokens: int, cluster: bool, timeout: float) -> RemoteTier:
    return RemoteTier(url, namespace=namespace, chunk_tokens=chunk_tokens, cluster=cluster, timeout=timeout)


def with_client(tier: RemoteTier, fn: Callable[[Any], Any]) -> Any:
    """``fn(client)`` on the tier's Redis client, failures mapped as every tier call maps them
    (for ``shmkv tier``, which SCANs what the tier holds)."""
    return tier._call(lambda: fn(tier._redis()))
