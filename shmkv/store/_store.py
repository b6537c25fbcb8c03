"""Store: a named KV cache in shared memory, the public handle (``Core`` and ``Arena`` below it;
create, gc and the rest of the lifecycle: ``_lifecycle``)."""

from __future__ import annotations

import atexit
import errno
import math
import mmap
import os
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from shmkv._engine import crash as _crash
from shmkv._engine import futex as _futex
from shmkv._sequence import group as _group
from shmkv._engine import header as _header
from shmkv._engine import liveness as _liveness
from shmkv._engine import lock as _lock
from shmkv._engine import segment as _segment
from shmkv._snapshot import snapshot as _snapshot
from shmkv._engine.header import (
    SEQ_WORDS,
    WBUF,
    CAPACITY,
    GEN,
    ID,
    LEASE_CLIENT,
    LEASE_PID,
    LEASE_TOKEN,
    LENGTH,
    START,
    ENC_SLOT,
    ENCODER,
    LIVE,
    STATE,
    WIN_OFF,
    CLEAN,
    FINISHED,
    FLAGS,
    IDX_BLOCKS,
)
from shmkv._engine.arena import Arena
from shmkv._sequence.batch import Batch
from shmkv._engine.core import register_client
from shmkv._engine.checks import count
from shmkv._engine.lease import live_writers, new_token, own_token
from shmkv._engine.prefix_hash import as_tokens
from shmkv._engine.segment import Segment
from shmkv._sequence.handle import Sequence, drop_lease
from shmkv._sequence.waiting import drop_read_only
from shmkv.errors import (
    AccessDeniedError,
    CacheFullError,
    CorruptStoreError,
    InvalidArgumentError,
    ShmkvError,
    StoreClosedError,
    StoreNotFound,
)

DEFAULT_MAX_CLIENTS = 128
DEFAULT_CAPACITY = 256
SeqId = int  # sequence ids are plain ints in the API; kept as a name for the docs

@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """One row of the sequence table, as read at one moment."""

    id: int
    length: int
    capacity: int
    start: int
    lease_pid: int
    lease_alive: bool
    generation: int
    finished: bool = False  # seq.finish(): a cached prefix, evictable


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Occupancy of a store at one moment (``store.stats()``)."""

    name: str
    sequences: int
    max_seqs: int
    tokens: int  # committed tokens over all sequences
    reserved_tokens: int  # cells owned by sequence ranges
    max_tokens: int
    free_tokens: int
    largest_free_range: int
    bytes_per_token: int  # K and V of every layer, plus token id and position
    bytes_used: int  # committed tokens x bytes_per_token
    bytes_reserved: int  # reserved cells x bytes_per_token, plus the sliding/chunked buffers
    clients: int
    generation: int
    window_tokens: int = 0  # tokens the sliding/chunked layers hold, over all sequences (bounded)
    encoder_tokens: int = 0  # tokens in encoder (cross-attention) caches
    finished: int = 0  # finished sequences: cached prefixes, evictable
    prefix_hits: int = 0  # create_sequence(prefix=) calls that reused tokens, by every process
    prefix_misses: int = 0  # ... that reused none
    prefix_tokens_reused: int = 0
    evictions: int = 0  # finished sequences evicted to make room


class Store(Arena):
    """A handle on a named store. Create with :func:`create`, attach with :func:`attach`.

    ``close()`` gives up this handle's leases and client slot, closes its
    descriptors and unmaps both segments at once. A view (``seq.keys()``, ...) or a
    Sequence handle that outlives it keeps the pages it uses mapped until it is
    collected: reading it stays valid, never a segfault (``.copy()`` what you keep
    for long). The creator's ``close()`` (or exit) also removes a non-persistent
    store, if its segments are still the ones it created; dropping the handle
    (garbage collection) only closes it. ``unlink()`` removes the store
    explicitly, also after ``close()``.
    """

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in the full layers (K, V, int8 scales), plus its id and position.

        Sliding and chunked layers add ``_kv_bytes(len(bounded))`` per token they keep (see stats()).
        """
        return self._kv_bytes(len(self._full)) + 16

    # -- lifecycle -------------------------------------------------------------

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("read-only" if self.readonly else "read-write")
        lay = self.layout
        return (f"<shmkv.Store {self.name!r} {state} layers={lay.layers} kv_heads={lay.kv_heads} "
                f"head_dim={lay.head_dim} dtype={lay.dtype} max_tokens={lay.max_tokens}>")

    def __reduce__(self) -> tuple[Any, ...]:
        # A store pickles by name: the receiving process attaches on its own.
        return (attach, (self.name, self.readonly))

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        # closing counts: a handle whose lease close() just dropped says StoreClosedError, not ReadOnlyError
        return self._closed or "_close_plan" in self.__dict__

    @property
    def persistent(self) -> bool:
        self._check_open()
        return bool(self._hdr[_header.W_PERSISTENT])

    def close(self) -> None:
        """Give up this handle's leases, close its descriptors and unmap (views the caller still
        holds keep their own pages); the creator also removes a non-persistent store.

        The store is removed only while its segments are still the ones this
        process created (same store identity): a newer store of the same name
        is left alone.
        """
        self._close(remove=None)

    def _close(self, remove: bool | None) -> None:
        """Close (``remove``: None, the creator's rule; True/False: remove or not). Another thread's
        hold of the store lock (a structural operation in progress) is waited out first (up to
        lock_timeout), and a thread that uses the handle afterwards gets StoreClosedError."""
        if self.__dict__.get("_close_done"):
            return
        quiet = self._lock.quiesce(self.lock_timeout)
        try:
            if not self.__dict__.get("_close_done"):  # (another thread closed it while this one waited)
                self._teardown(remove)
        finally:
            if quiet:
                self._lock.unquiesce()

    def _teardown(self, remove: bool | None) -> None:
        """Every step may be cut short by an exception (Ctrl-C): the next close() finishes the job
        (each step is idempotent), and until it is done the finalizer still closes what is left."""
        plan: tuple[bool, bool] | None = self.__dict__.get("_close_plan")
        if plan is None:
            if remove is None:
                remove = self._creator and not bool(self._hdr[_header.W_PERSISTENT])
            inherited = self._fork_epoch != _segment.fork_epoch or self._pid != os.getpid()
            plan = self._close_plan = (bool(remove) and not inherited, inherited)
        remove, inherited = plan
        if not self._closed:
            if not inherited and not self.readonly:
                for handle in list(live_writers.values()):
                    if getattr(handle, "_store", None) is self:
                        drop_lease(handle)
                try:
                    # a store removed meanwhile has no lock file to take (taking it would leave one behind)
                    if read_identity(self.name) == self._identity:
                        self._drop_waiters()
                except Exception:  # closing must not fail because the lock is stuck
                    pass
            elif not inherited:
                self._drop_waiters()  # (read-only: counts in the liveness file, no lock)
            self._unregister_client()  # our client row, and the byte of the liveness file (no lock taken)
            self._closed = True
            if not inherited:  # this handle's sleepers in Sequence.wait look again: StoreClosedError
                for slot in list(self._waiting):
                    _futex.wake(self._length_addr0 + slot * 8 * SEQ_WORDS)
        self._drop_views()
        self._live.close()
        self._lock.close()
        self._hseg.close()  # unmapped now, unless views (or handles) the caller keeps hold them
        self._dseg.close()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._creator and not inherited:
            _exit_removals.pop((self.name, self._identity), None)
        if remove:
            _remove_if_same(self.name, self._identity)
        self._close_done = True

    def _drop_waiters(self) -> None:
        """close(): take this handle's sleepers in Sequence.wait off the rows' waiter counts
        (they end with StoreClosedError without touching the store again)."""
        if self._waiting and _futex.AVAILABLE and not self.readonly:
            with self._locked():
                for slot, n in self._waiting.items():
                    self._waiters[slot] -= n
        elif self._waiting and _futex.AVAILABLE and self._ro_waiters.writable:
            drop_read_only(self._ro_waiters, self._waiting)

    def _drop_views(self) -> None:
        """Drop every reference this handle holds into its mappings (arrays, memoryviews, and the
        objects and containers made of them), so that closing the segments unmaps them at once.
        What the caller still holds (views, Sequence handles) keeps its own pages mapped and valid
        until it is collected (never a segfault); a closed handle only checks it is closed."""
        closed = _Closed(self.name)
        for attr, value in list(vars(self).items()):
            if _holds_views(value):
                setattr(self, attr, closed)

    def unlink(self) -> None:
        """Remove the store (segments, lock and liveness files) now, if its name still holds the
        store this handle attached to (same store identity; a newer store of that name is left
        alone), and close this handle if it is open. Other attached processes keep their mappings.

        Works on a closed handle too, as with ``multiprocessing.shared_memory``: ``store.close();
        store.unlink()`` removes a created, attached or persistent store (once; then it does nothing).
        """
        self._close(remove=False)
        _remove_if_same(self.name, self._identity)

    def transaction(self) -> AbstractContextManager[None]:
        """Hold the store lock across several structural operations (a context manager).

        It enters through the journal's one way into the lock, so it first rolls back
        what a process that died holding the lock left half done (``shmkv verify
        --repair`` is this). It is not itself atomic: each structural operation inside
        is its own journaled transaction (all or nothing: rolled back on an exception of
        any kind, or by the next lock holder after a crash), and an exception in the
        block does not undo the operations that completed before it. Other processes'
        structural operations wait meanwhile: keep it short.

        Example:
            >>> with store.transaction():          # doctest: +SKIP
            ...     store.copy_prefix(a, b, 16)
            ...     store.sequence(b, write=True).truncate(8)
        """
        return self._locked()

    def clients(self) -> list[int]:
        """Pids of the live read-write attachments of the store (one per attachment).

        Alive means holding its byte of the liveness file, whatever the PID namespace; the pids
        are for display: each is the pid in its process's own namespace."""
        self._check_open()
        out = []
        for pid, key, _flags, _ in self._clients_np.tolist():
            if pid and key > 0 and self._alive(key):
                out.append(pid)
        return out

    # -- sequences -------------------------------------------------------------

    def create_sequence(self, capacity: int = DEFAULT_CAPACITY, *, prefix: Any = None, tier: Any = None,
                        _protect: int = -1) -> Sequence:
        """Create a sequence with room for ``capacity`` tokens; return its write handle.

        The pages of its range are reserved now, so a full /dev/shm raises
        CacheFullError here rather than SIGBUS later. When the store is full,
        finished sequences (``seq.finish()``) are evicted, least recently used first.

        Args:
            capacity: token cells to reserve (the sequence grows past them when it must).
            prefix: the prompt's token ids. The new sequence starts with the longest prefix
                of it that any sequence of the store holds from position 0 (copied in, at most
                ``len(prefix) - 1`` tokens, so at least one token is left to compute):
                ``len(seq)`` says how many. Counted in ``stats()`` as a hit or a miss.
            tier: a :class:`shmkv.remote.RemoteTier`: after the local match, whole chunks
                of the prompt that the tier holds continue it (checked, then appended and
                committed: from then on they are in this store's prefix cache too). A tier
                that is down or slow gives a ``RuntimeWarning`` and the local match alone.

        Example:
            >>> seq = store.create_sequence(capacity=1024, prefix=prompt)   # doctest: +SKIP
            >>> n = len(seq)                                              # doctest: +SKIP
            >>> seq.extend(k_all[:, n:], v_all[:, n:], tokens=prompt[n:])  # doctest: +SKIP
        """
        made: list[int] = []  # (id, lease token) once the inner call has chosen them
        try:
            return self._create_sequence(capacity, prefix, tier, _protect, made)
        except BaseException:  # KeyboardInterrupt included: the caller never gets the handle
            if made:
                self._drop_unreturned(made[0], made[1], free=True)
            raise

    def _create_sequence(self, capacity: int, prefix: Any, tier: Any, _protect: int, made: list[int]) -> Sequence:
        capacity = count("capacity", capacity, minimum=1)
        if capacity > self.layout.max_tokens:
            raise CacheFullError(
                f"capacity={capacity} exceeds the store's max_tokens={self.layout.max_tokens}: "
                "ask for less, or create the store with a larger max_tokens="
            )
        toks = None if prefix is None else _prompt(prefix)
        token = new_token()
        client = self._client_key()
        with self._locked():
            n, _, donor = self._index.match(toks) if toks is not None else (0, 0, -1)
            # the id decides the row: id % max_seqs, so that any process finds it at once (_slot_of)
            next_id, rows = self._hdr[_header.W_NEXT_ID], self.layout.max_seqs
            try:
                slot, start = self._new_row(max(capacity, n), protect=donor if n else _protect, near=next_id % rows)
            except CacheFullError:
                if n == 0:
                    raise
                n, donor = 0, -1  # only the donor's eviction makes room: a miss, which may evict it
                slot, start = self._new_row(capacity, protect=_protect, near=next_id % rows)
            row = self._row(slot)
            seq_id = next_id + (slot - next_id) % rows  # the next id of that row: ids skip the rows in use
            self._hdr[_header.W_NEXT_ID] = seq_id + 1  # ids are never reused: a rolled-back create skips one
            made += (seq_id, token)
            with self._transaction():  # the row and its prefix: both, or after a crash neither
                with self._changing(row):
                    self._new_incarnation(row)
                    row[ID] = seq_id
                    row[START] = start
                    row[CAPACITY] = max(capacity, n)
                    row[LENGTH] = 0
                    row[WIN_OFF] = 0
                    row[WBUF] = 0
                    row[ENC_SLOT] = 0
                    _crash.point("create.row")
                    row[FLAGS] = 0
                    row[IDX_BLOCKS] = 0
                    row[CLEAN] = -1
                    self._log_meta(slot)
                    self._meta[slot, :8] = 0
                    self._touch(row)
                    row[LEASE_CLIENT] = client
                    row[LEASE_TOKEN] = token
                    row[LEASE_PID] = os.getpid()
                    row[STATE] = LIVE
                if n:
                    self._copy_prefix_rows(donor, slot, n)
                    _crash.point("create.copied")
            if toks is not None:
                hdr = self._hdr
                if n:
                    self._touch(self._row(donor))
                    hdr[_header.W_PREFIX_HITS] += 1
                    hdr[_header.W_PREFIX_REUSED] += n
                else:
                    hdr[_header.W_PREFIX_MISSES] += 1
            seq = Sequence(self, seq_id, slot, write=True, token=token)
            if self._owes(start, row[CAPACITY]):
                # its range is allocated, not pre-faulted (_new_row): a step of the row's seqlock
                # sends the handle's first write down its checked path, where a prefill (extend)
                # writes through the descriptor and appends pre-fault the range first
                row[GEN] += 2
        if tier is not None:
            if toks is None:
                raise InvalidArgumentError("create_sequence: tier= needs prefix= (the prompt's token ids)")
            try:
                tier.pull(seq, toks, have=n)  # network I/O: outside the store lock
            except BaseException:  # (a chunk that cannot be loaded is a miss; this is anything else)
                seq.free()  # no live, unfinished sequence is left behind
                raise
        return seq

    def match_prefix(self, tokens: Any) -> int:
        """Tokens of ``tokens`` that ``create_sequence(prefix=tokens)`` would reuse now.

        No side effect: no counter, no recency, no lock; works on a read-only attachment.

        Example:
            >>> store.match_prefix(prompt)   # doctest: +SKIP
            299
        """
        self._check_open()
        return self._index.match(_prompt(tokens))[0]

    def sequence(self, seq_id: int, write: bool = False) -> Sequence:
        """A handle on sequence ``seq_id``; ``write=True`` takes its write lease.

        Raises:
            SequenceNotFound: no live sequence has that id.
            LeaseError: ``write=True`` and a live process (or another handle here) holds the lease.
        """
        self._check_open()
        slot = self._slot_of(seq_id)
        if not write:
            return Sequence(self, int(seq_id), slot, write=False, token=0)
        token = new_token()
        client = self._client_key()
        try:
            return self._take_lease(int(seq_id), token, client)
        except BaseException:  # KeyboardInterrupt included: no lease is left for a handle never returned
            self._drop_unreturned(int(seq_id), token, free=False)
            raise

    def _drop_unreturned(self, seq_id: int, token: int, *, free: bool) -> None:
        """Undo what create_sequence (``free``) or a lease take-over did for a handle that never
        reached its caller (an exception after the work, KeyboardInterrupt included): free the new
        sequence, or give up the lease, if the row still holds ``token``. Best effort: the
        exception that got here is what the caller sees."""
        live_writers.pop(token, None)
        try:
            with self._locked():
                slot = self._slot_of(seq_id)
                row = self._row(slot)
                if row[LEASE_TOKEN] != token:
                    return
                if free:
                    self._free_row(slot)
                else:
                    row[LEASE_PID] = 0  # what release() does
        except ShmkvError:  # closed, gone, or the lock is busy: nothing more to do here
            pass

    def _take_lease(self, seq_id: int, token: int, client: int) -> Sequence:
        with self._locked():
            slot = self._slot_of(seq_id)
            row = self._row(slot)
            self._check_not_leased_by_other(row, int(seq_id))
            if row[FLAGS] & FINISHED:  # taken back (a chat's next turn): no longer evictable
                row[FLAGS] &= ~FINISHED
                self._touch(row)
            row[LEASE_CLIENT] = client
            row[LEASE_TOKEN] = token
            _crash.point("lease.taken")
            row[LEASE_PID] = os.getpid()  # last: until then the old (dead) holder's lease stands
        return Sequence(self, int(seq_id), slot, write=True, token=token)

    def forward(self, seq_ids: Any, positions: Any, tokens: Any = None) -> Batch:
        """Start a batch forward: one entry of ``seq_ids``/``positions`` per new token.

        Uses this process's write handles on those sequences, or takes their leases
        until commit. See :class:`shmkv.Batch`.

        Example:
            >>> with store.forward([a, a, b], [7, 8, 3]) as batch:       # doctest: +SKIP
            ...     for layer in range(layers):
            ...         K, V, mask = batch.put(layer, k[layer], v[layer])
            ...     batch.commit()
        """
        self._check_writable()
        return Batch(self, seq_ids, positions, tokens)

    def sequences(self) -> list[SequenceInfo]:
        """The live sequences, in id order."""
        self._check_open()
        out = []
        if self._hdr[_header.W_UNDO_COUNT] and not self._depth:
            # a transaction is in the undo log: the rows as its rollback leaves them (_journal, 7)
            with self._reading():
                table = [self._settled_row(slot) for slot in range(self.layout.max_seqs)]
        else:
            table = [self._table_np[slot].tolist() for slot in np.flatnonzero(self._table_np[:, STATE] == LIVE)]
        asked: dict[int, bool] = {}  # client key -> alive: one question per writer, however many leases
        for r in table:
            if r[STATE] != LIVE:
                continue
            key, alive = r[LEASE_CLIENT], False
            if r[LEASE_PID]:
                known = asked.get(key)
                alive = asked[key] = self._alive(key) if known is None else known
            out.append(SequenceInfo(r[ID], r[LENGTH], r[CAPACITY], r[START], r[LEASE_PID], alive, r[GEN],
                                    bool(r[FLAGS] & FINISHED)))
        return sorted(out, key=lambda s: s.id)

    def copy_prefix(self, src_id: int, dst_id: int, n: int) -> None:
        """Replace sequence ``dst_id``'s content with the first ``n`` tokens of ``src_id``.

        Sliding/chunked layers of dst hold every token of the first ``n`` that src's hold.

        dst grows (or moves) if its capacity is below n. dst must not be leased by
        another live process; a write handle of this process on dst sees the new
        content (its uncommitted tokens are dropped).
        """
        n = count("n", n)
        if int(src_id) == int(dst_id):
            raise InvalidArgumentError(f"copy_prefix: src_id and dst_id are both {src_id}; use truncate() instead")
        with self._locked():
            s_row = self._row(self._slot_of(src_id))
            d_slot = self._slot_of(dst_id)
            d_row = self._row(d_slot)
            if n > s_row[LENGTH]:
                raise InvalidArgumentError(
                    f"copy_prefix: n={n} exceeds the length {s_row[LENGTH]} of sequence {src_id}"
                )
            self._check_not_leased_by_other(d_row, int(dst_id), allow_token=own_token(d_row))
            self._copy_prefix_rows(self._slot_of(src_id), d_slot, n, held=True)

    def lease(self, seq_ids: Iterable[int]) -> list[Sequence]:
        """Write handles on every sequence of ``seq_ids``, in that order: all leases, or none
        (the first failure's ``LeaseError`` / ``SequenceNotFound``; the leases taken are given back)."""
        return _group.lease(self, seq_ids)

    def regather(self, seqs: list[Sequence], rows: Iterable[int]) -> list[Sequence]:
        """Reorder, repeat and drop the rows of a batch: returns write handles whose row ``i`` holds
        what ``seqs[rows[i]]`` holds (committed K/V of every layer, token ids, positions, encoder).

        A row's first use keeps its handle (and meta); repeats are copied into sequences no row
        keeps (no allocation), or forked when there are none (a repeat's meta is ``{}``, as a
        fork's); sequences no row keeps are freed. ``seqs``: this store object's write handles,
        each once, nothing pending. A ``CacheFullError`` (no room for a fork) changes nothing.
        """
        return _group.regather(self, seqs, rows)

    def create_sequences(self, n: int, capacity: int = DEFAULT_CAPACITY, *,
                         prefix: Iterable[Any] | None = None) -> list[Sequence]:
        """``n`` new sequences (write handles) of ``capacity`` each: every one, or none (on any
        error the ones made are freed and the error propagates). ``prefix``: one prompt per
        sequence, as ``create_sequence(prefix=)`` takes it (a reused prefix longer than ``capacity``
        enlarges its range). Made under one hold of the store lock, first fit: when the first free
        range that fits ``capacity`` holds all ``n`` (no eviction needed), their ranges are adjacent
        and equally spaced, which ``batch_kv`` reads zero-copy."""
        return _group.create_sequences(self, n, capacity, prefix)

    def batch_kv(self, seqs: Iterable[Sequence], layer: int, *, pending: bool = False,
                 writable: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of ``layer`` for several sequences of equal length, ``[B, T, kv_heads,
        head_dim]``. Zero-copy, one strided view of the shared cells, when the rows' cells are
        equally spaced in the order given (checked each call; e.g. ``create_sequences``' rows on
        full layers) and stored as read (plain floats; bfloat16 as ml_dtypes views); otherwise,
        and for int8, a gathered copy. ``pending``: this process's handles' pending tokens too
        (what ``append`` returned). Views are read-only unless ``writable`` (write handles only):
        writing into a view writes the shared cache, writing into a gathered copy writes only the
        copy (``np.shares_memory`` tells which). Content holds as for ``seq.keys``."""
        return _group.batch_kv(self, seqs, layer, pending, writable)

    # -- snapshots ---------------------------------------------------------------

    def save(self, path: Any, seq_ids: list[int] | None = None, *,
             progress: Callable[[int, int], None] | None = None) -> int:
        """Write a msgpack snapshot of the store (or of ``seq_ids``) to a path or binary file.

        Decode workers keep appending while it runs; each sequence is saved at
        its committed length. A path is replaced atomically. Returns bytes written.

        Example:
            >>> store.save("/tmp/cache.shmkv")       # doctest: +SKIP
        """
        return _snapshot.save(self, path, seq_ids, progress)

    def restore(self, path: Any, seq_ids: list[int] | None = None, *,
                progress: Callable[[int, int], None] | None = None) -> list[int]:
        """Restore sequences from a snapshot (path or binary file), all or nothing; return their ids.

        Raises:
            SnapshotError: the file is damaged or not a snapshot (the store is unchanged).
            LayoutMismatchError: the snapshot's geometry differs from the store's.
            CacheFullError: the store has no room (the store is unchanged).
        """
        return _snapshot.restore(self, path, seq_ids, progress)

    # -- reading ---------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Occupancy: sequences, tokens, free cells and bytes."""
        self._check_open()
        t = self._table_np
        live = t[t[:, STATE] == LIVE]
        encoders = t[t[:, STATE] == ENCODER]
        gaps = self._free_ranges()
        bpt = self.bytes_per_token
        tokens = int(live[:, LENGTH].sum())
        reserved = int(live[:, CAPACITY].sum())
        enc_tokens = int(encoders[:, LENGTH].sum())
        enc_bpt = self._kv_bytes(self.layout.layers)  # an encoder token has every layer
        kept = int((live[:, LENGTH] - live[:, WIN_OFF]).sum()) if self.layout.bounded else 0
        wbytes = self._kv_bytes(len(self.layout.bounded))  # per token the bounded layers keep
        return StoreStats(
            name=self.name,
            sequences=int(live.shape[0]),
            max_seqs=self.layout.max_seqs,
            tokens=tokens,
            reserved_tokens=reserved,
            max_tokens=self.layout.max_tokens,
            free_tokens=sum(s for _, s in gaps),
            largest_free_range=max((s for _, s in gaps), default=0),
            bytes_per_token=bpt,
            bytes_used=tokens * bpt + kept * wbytes + enc_tokens * enc_bpt,
            bytes_reserved=reserved * bpt + int(live.shape[0]) * 2 * self._wc * wbytes
            + int(encoders[:, CAPACITY].sum()) * enc_bpt,
            encoder_tokens=enc_tokens,
            window_tokens=kept,
            clients=len(self.clients()),
            generation=int(self._hdr[_header.W_GENERATION]),
            finished=int(((live[:, FLAGS] & FINISHED) != 0).sum()),
            prefix_hits=int(self._hdr[_header.W_PREFIX_HITS]),
            prefix_misses=int(self._hdr[_header.W_PREFIX_MISSES]),
            prefix_tokens_reused=int(self._hdr[_header.W_PREFIX_REUSED]),
            evictions=int(self._hdr[_header.W_EVICTIONS]),
        )


class _Closed:
    """What a closed handle holds instead of its views: any use raises StoreClosedError (another
    thread that was past the handle's open check when it closed gets that, not a TypeError from None)."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def _raise(self, *args: object, **kwargs: object) -> NoReturn:
        raise StoreClosedError(f"store {self._name!r} is closed (by another thread?): attach again with "
                               f"shmkv.attach({self._name!r})")

    __getitem__ = __setitem__ = __len__ = __iter__ = __contains__ = __call__ = __bool__ = _raise

    def __getattr__(self, attr: str) -> NoReturn:
        self._raise()


def _holds_views(value: object, depth: int = 2) -> bool:
    """Whether ``value`` is, or holds (``depth`` levels down), a view of a mapping."""
    if isinstance(value, (np.ndarray, memoryview, mmap.mmap)):
        return True
    if isinstance(value, _Closed):  # (a close() that is finishing an interrupted one)
        return False
    if depth <= 0 or isinstance(value, (str, bytes, int, float, Segment)):
        return False
    if isinstance(value, (list, tuple)):
        return any(_holds_views(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_views(v, depth - 1) for v in value.values())
    fields = getattr(value, "__dict__", None)
    return isinstance(fields, dict) and any(_holds_views(v, depth - 1) for v in fields.values())


def _prompt(tokens: Any) -> np.ndarray:
    """A prompt's token ids as int64, checked: ids are >= 0 (-1 marks "no id" in the store)."""
    try:
        t = as_tokens(tokens)
    except ValueError as e:
        raise InvalidArgumentError(f"prefix: {e}; pass the prompt's token ids as a 1-d int sequence") from None
    if t.size and int(t.min()) < 0:
        raise InvalidArgumentError(f"prefix: token ids must be >= 0, got {int(t.min())}")
    return t


# -- module-level lifecycle ----------------------------------------------------


@_lock.lifecycle_op
def _remove_names(name: str) -> bool:
    """Unlink the segments, then the lock and liveness files (never those while a segment exists)."""
    found = _segment.unlink(_segment.header_name(name))
    found = _segment.unlink(_segment.data_name(name)) or found
    for path, what in ((_segment.lock_path(name), "lock file"), (_liveness.live_path(name), "liveness file")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except PermissionError:
            raise _segment.denied(os.path.basename(path), what) from None
    return found


def _magic_words(name: str, *which: int) -> tuple[int, ...] | None:
    """Words ``which`` of ``name``'s header if it has the shmkv magic, else None (no header,
    not ours to read, too small, or not a shmkv header)."""
    try:
        hseg = Segment.open(_segment.header_name(name), readonly=True)
    except (StoreNotFound, AccessDeniedError):
        return None
    try:
        if hseg.size < _header.FIXED_BYTES:
            return None
        words = hseg.array(np.int64, _header.FIXED_BYTES // 8)
        out = tuple(int(words[w]) for w in which) if int(words[_header.W_MAGIC]) == _header.MAGIC else None
        del words
        return out
    finally:
        hseg.close()


def read_identity(name: str) -> int | None:
    """The store identity in ``name``'s header, None when there is no readable shmkv header."""
    words = _magic_words(name, _header.W_IDENTITY)  # (a version-1 header holds 0 there: never ours)
    return words[0] if words is not None else None


def _remove_if_same(name: str, identity: int) -> bool:
    """Remove store ``name`` only if its header still holds ``identity`` (it is the store we know)."""
    if identity and read_identity(name) == identity:
        return _remove_names(name)
    return False


# (name, identity) -> (pid, fork epoch) of the non-persistent stores this process created
# and has not closed: removed at interpreter exit, by the creating process only (a forked
# child that exits must not remove them), and only if their identity is unchanged.
_exit_removals: dict[tuple[str, int], tuple[int, int]] = {}


@atexit.register
def _remove_at_exit() -> None:
    for (name, identity), (pid, epoch) in list(_exit_removals.items()):
        if pid == os.getpid() and epoch == _segment.fork_epoch:
            try:
                _remove_if_same(name, identity)
            except Exception:  # exiting: nothing left to report to
                pass
    _exit_removals.clear()


_mp_exit_pid = 0


def _remove_at_process_exit(name: str, identity: int) -> None:
    """Register a created store for removal when this process exits.

    atexit covers a normal interpreter exit; multiprocessing's fork and forkserver
    children end with os._exit and run only multiprocessing's own exit finalizers,
    so the removal is registered there too (once per process; it runs once).
    """
    global _mp_exit_pid
    _exit_removals[(name, identity)] = (os.getpid(), _segment.fork_epoch)
    if _mp_exit_pid != os.getpid():
        from multiprocessing import util

        util.Finalize(None, _remove_at_exit, exitpriority=0)
        _mp_exit_pid = os.getpid()


def _lock_open_error(name: str, e: OSError) -> ShmkvError:
    """The error for a store lock file that cannot be opened (attach), naming the fix."""
    path = _segment.lock_path(name)
    why = f"{os.strerror(e.errno or 0)}; {_segment._owner(path)}"
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return CacheFullError(f"store {name!r}: cannot open its lock file {path} ({why}): close stores you no "
                              "longer use, or raise the limit (`ulimit -n`)")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a missing lock file that /dev/shm has no inode for
        return _segment.shm_full(os.path.basename(path), e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.ELOOP):
        return AccessDeniedError(
            f"store {name!r}: cannot open its lock file {path} ({why}): it must be a regular file that the "
            "store's users may open (create(..., mode=0o660) and a common group); remove a stray one as its "
            "owner, or use another store name"
        )
    return CorruptStoreError(f"store {name!r}: cannot open its lock file {path} ({why}): remove the store "
                             f"(`shmkv rm {name}`) and create it anew")


def _check_timeout(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or math.isnan(value) or value < 0:
        raise InvalidArgumentError(f"{name}={value!r} must be a number of seconds >= 0")
    return float(value)


def attach(name: str, readonly: bool = False, *, timeout: float = 5.0,
           lock_timeout: float = _lock.DEFAULT_TIMEOUT) -> Store:
    """Attach to the existing store ``name``.

    ``readonly=True`` maps the segments read-only: views are not writeable and
    any write through the mapping faults. A read-only attachment is not listed
    as a client (it cannot write the client table) and holds no leases.

    Raises:
        StoreNotFound: no store of that name (the message says how to list them).
        CorruptStoreError: the segment is not an intact shmkv store.
        AccessDeniedError: the store belongs to another user and its mode keeps us out.
    """
    _segment.check_name(name)
    lock_timeout = _check_timeout("lock_timeout", lock_timeout)
    try:
        hseg = Segment.open(_segment.header_name(name), readonly)
    except StoreNotFound:
        raise StoreNotFound(f"no store named {name!r} (shmkv.list_stores() or `shmkv ls` lists them)") from None
    opened: list[Segment] = []
    try:
        words = hseg.array(np.int64, _header.FIXED_BYTES // 8) if hseg.size >= 512 else None
        deadline = time.monotonic() + timeout
        while words is not None and int(words[_header.W_MAGIC]) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # the creator writes the magic last
        raw = hseg.array(np.uint8)
        layout, max_clients = _header.read(words if words is not None else np.zeros(64, np.int64), raw,
                                           hseg.size, name)
        persistent = words is not None and bool(words[_header.W_PERSISTENT])  # (read() refused a short one)
        del words, raw
        dseg = Segment.open(_segment.data_name(name), readonly)
        opened.append(dseg)
        off = _header.offsets(layout, max_clients)
        if dseg.size < off.data_bytes:
            raise CorruptStoreError(
                f"store {name!r}: data segment is {dseg.size} bytes, the header needs {off.data_bytes}"
            )
    except StoreNotFound:
        hseg.close()
        raise StoreNotFound(
            f"no store named {name!r} (shmkv.list_stores() or `shmkv ls` lists them)"
        ) from None
    except BaseException:  # (Ctrl-C included: the data segment's descriptor too, if it was opened)
        for seg in (hseg, *opened):
            seg.close()
        raise
    try:
        store = Store(name, hseg, dseg, layout, max_clients, creator=False, persistent=persistent,
                      lock_timeout=lock_timeout)
    except BaseException as e:
        hseg.close()  # nothing leaks: both segments' descriptors (and mappings) go now
        dseg.close()
        if isinstance(e, OSError) and not isinstance(e, ShmkvError):
            raise _lock_open_error(name, e) from None
        raise
    if not readonly:
        try:
            register_client(store)
        except BaseException:
            store.close()
            raise
    return store
