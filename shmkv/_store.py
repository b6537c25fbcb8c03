"""Store: a named KV cache in shared memory (create, gc and the rest of the lifecycle: _lifecycle).

Concurrency (DESIGN.md section 3):

* The lease holder of a sequence writes cells beyond its committed length and
  then publishes the new length with one aligned 8-byte store. On x86-64 (TSO)
  stores become visible in program order, and the numpy copy is an opaque C
  call that completes before the length store, so a reader that reads the
  length first never sees a cell that is not fully written.
* Structural operations take the store lock, and bracket their changes to a
  sequence row with its seqlock generation (odd while changing). Readers read
  the generation, the row, the generation again, and retry while it moved.
* Liveness: every read-write process is in the client table; a lease whose
  holder died (pid gone, or pid recycled: start times differ) can be taken.
"""

from __future__ import annotations

import atexit
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _crash, _dtypes, _header, _lock, _segment, _snapshot
from ._header import (
    WBUF,
    CAPACITY,
    CLIENT_WORDS,
    GEN,
    ID,
    LEASE_PID,
    LEASE_START,
    LEASE_TOKEN,
    LENGTH,
    SEQ_WORDS,
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
    INDEX_WORDS,
    NOINDEX,
    RECENCY,
    Layout,
)
from ._batch import Batch
from ._checks import count
from ._lease import live_writers, new_token, own_token
from ._prefix import PrefixIndex
from ._prefix_hash import as_tokens
from ._segment import Segment
from ._sequence import Sequence
from .errors import (
    AccessDeniedError,
    CacheFullError,
    CorruptStoreError,
    InvalidArgumentError,
    LeaseError,
    NotSupportedError,
    ReadOnlyError,
    SequenceNotFound,
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


def _words(mm: Any, offset: int, count: int) -> memoryview:
    """An int64 memoryview of ``count`` words at ``offset``: item reads give Python ints."""
    return memoryview(mm)[offset : offset + 8 * count].cast("q")


class Store:
    """A handle on a named store. Create with :func:`create`, attach with :func:`attach`.

    ``close()`` gives up this process's leases and unmaps (views keep their
    pages mapped until they are collected). The creator's ``close()`` (or exit)
    also removes a non-persistent store, if its segments are still the ones it
    created; dropping the handle (garbage collection) only closes its
    descriptors. ``unlink()`` removes the store explicitly.
    """

    def __init__(self, name: str, hseg: Segment, dseg: Segment, layout: Layout, max_clients: int, *,
                 creator: bool, persistent: bool, lock_timeout: float) -> None:
        self.name = name
        self.layout = layout
        self.readonly = hseg.readonly
        self.lock_timeout = float(lock_timeout)
        self._creator = creator
        self._persistent = persistent
        self._pid = os.getpid()
        self._fork_epoch = _segment.fork_epoch
        self._closed = False
        self._hseg, self._dseg = hseg, dseg
        self._lock_path = _segment.lock_path(name)
        self._lock = _lock.StoreLock(self._lock_path, name, readonly=hseg.readonly)
        self._identity = int(np.frombuffer(hseg.mm, np.int64, 1, 8 * _header.W_IDENTITY)[0])  # type: ignore[arg-type]
        off = self._off = _header.offsets(layout, max_clients)
        hmm, dmm = hseg.mm, dseg.mm
        assert hmm is not None and dmm is not None
        self._max_clients = max_clients
        self._hdr = _words(hseg.mm, 0, _header.FIXED_BYTES // 8)
        self._table = _words(hseg.mm, off.seq_off, layout.max_seqs * SEQ_WORDS)
        self._table_np = np.frombuffer(hmm, np.int64, layout.max_seqs * SEQ_WORDS, off.seq_off).reshape(
            layout.max_seqs, SEQ_WORDS
        )
        self._clients_np = np.frombuffer(hmm, np.int64, max_clients * CLIENT_WORDS, off.client_off).reshape(
            max_clients, CLIENT_WORDS
        )
        dt = _dtypes.storage(layout.dtype)
        L, T, H, D = layout.layers, layout.max_tokens, layout.kv_heads, layout.head_dim
        self._K = np.frombuffer(dmm, dt, L * T * H * D, off.k_off).reshape(L, T, H, D)
        self._V = np.frombuffer(dmm, dt, L * T * H * D, off.v_off).reshape(L, T, H, D)
        self._tokens = np.frombuffer(dmm, np.int64, T, off.tokens_off)
        self._positions = np.frombuffer(dmm, np.int64, T, off.positions_off)
        self._hashes = np.frombuffer(dmm, np.int64, T, off.hashes_off)
        self._meta = np.frombuffer(hmm, np.uint8, layout.max_seqs * _header.META_RECORD, off.meta_off).reshape(
            layout.max_seqs, _header.META_RECORD)
        self._index = PrefixIndex(_words(hmm, off.index_off, off.index_slots * INDEX_WORDS), self._table,
                                  self._tokens, self._positions, self._hashes, layout=layout)
        # Per-layer views: slicing one is cheaper than a 4-D index. A sliding or chunked
        # layer's view is its window region instead: a buffer of window_cells per slot.
        self._Kl = list(self._K)
        self._Vl = list(self._V)
        self._full = [i for i in range(L) if i not in layout.bounded]
        self._wc = layout.window_cells
        nb, WT = len(layout.bounded), 2 * layout.max_seqs * layout.window_cells  # two buffers a slot
        if nb:
            self._WK = np.frombuffer(dmm, dt, nb * WT * H * D, off.wk_off).reshape(nb, WT, H, D)
            self._WV = np.frombuffer(dmm, dt, nb * WT * H * D, off.wv_off).reshape(nb, WT, H, D)
            for j, layer in enumerate(layout.bounded):
                self._Kl[layer], self._Vl[layer] = self._WK[j], self._WV[j]
        # int8 stores: one float32 scale per (layer, cell, head) for K and for V
        S = L * T * H if layout.dtype == "int8" else 0
        self._KS = np.frombuffer(dmm, np.float32, S, off.ks_off).reshape(-1, T, H) if S else None
        self._VS = np.frombuffer(dmm, np.float32, S, off.vs_off).reshape(-1, T, H) if S else None
        # what every Sequence handle reads through: built once here, not per handle (a handle
        # is made per request; fewer objects keep store.sequence(id) cheap)
        self._Kr = [_readonly(a) for a in self._Kl]
        self._Vr = [_readonly(a) for a in self._Vl]
        self._KSl = list(self._KS) if self._KS is not None else None
        self._VSl = list(self._VS) if self._VS is not None else None
        self._slot_hint: dict[int, int] = {}  # sequence id -> table row, checked on use (see _slot_of)
        self._rows: dict[int, memoryview] = {}  # slot -> its row (see _row)
        self._row_slot: dict[int, int] = {}  # id(row) -> slot
        # crash recovery: the undo log (see "crash recovery" below) and this process's unit
        self._undo_np = np.frombuffer(hmm, np.int64, layout.max_seqs * _header.UNDO_WORDS, off.undo_off).reshape(
            layout.max_seqs, _header.UNDO_WORDS)
        self._meta_w = np.frombuffer(hmm, np.int64, layout.max_seqs * _header.META_RECORD // 8,
                                     off.meta_off).reshape(layout.max_seqs, _header.META_RECORD // 8)
        self._unit_depth = 0
        self._logged: set[int] = set()
        # A dropped handle closes its descriptors; it never removes the store (only close or exit do).
        self._finalizer: weakref.finalize | None = weakref.finalize(self, _close_segments, hseg, dseg)
        self._finalizer.atexit = False  # at exit the process closes them anyway

    def _kv_bytes(self, layers: int) -> int:
        """Bytes of K and V (and int8 scales) of one token in ``layers`` layers."""
        scales = self.layout.kv_heads * 4 if self._KS is not None else 0
        return 2 * layers * (self._off.cell_bytes + scales)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in the full layers (K, V, int8 scales), plus its id and position.

        Sliding and chunked layers add ``_kv_bytes(len(bounded))`` per token they keep (see stats()).
        """
        return self._kv_bytes(len(self._full)) + 16

    def _free_slot(self, what: str, evict: bool = False, protect: int = -1) -> int:
        """A free row of the sequence table (lock held), or CacheFullError.

        ``evict``: evict finished sequences (least recently used first, never row ``protect``)
        when no row is free."""
        free = np.flatnonzero(self._table_np[:, STATE] == 0)
        if free.size == 0 and evict and self._evict(0, 1, protect):
            free = np.flatnonzero(self._table_np[:, STATE] == 0)
        if free.size == 0:
            raise CacheFullError(
                f"store {self.name!r} has no free slot for {what}: all max_seqs={self.layout.max_seqs} rows hold "
                "sequences or encoder caches; free some, or create the store with a larger max_seqs="
            )
        return int(free[0])

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
        return self._closed

    @property
    def persistent(self) -> bool:
        self._check_open()
        return bool(self._hdr[_header.W_PERSISTENT])

    def close(self) -> None:
        """Give up this handle's leases and unmap; the creator also removes a non-persistent store.

        The store is removed only while its segments are still the ones this
        process created (same store identity): a newer store of the same name
        is left alone.
        """
        if not self._closed:
            self._close(remove=self._creator and not self.persistent)

    def _close(self, remove: bool) -> None:
        if self._closed:
            return
        inherited = self._fork_epoch != _segment.fork_epoch or self._pid != os.getpid()
        if not inherited and not self.readonly:
            me = os.getpid()
            for handle in list(live_writers.values()):
                if getattr(handle, "_store", None) is self:
                    handle._drop_lease()
            try:
                # a store removed meanwhile has no lock file to take (taking it would leave one behind)
                if read_identity(self.name) == self._identity:
                    self._unregister_client(me)
            except Exception:  # closing must not fail because the lock is stuck
                pass
        remove = remove and not inherited
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._hdr = self._table = None  # type: ignore[assignment]
        self._lock.close()
        self._hseg.close()
        self._dseg.close()
        if self._creator and not inherited:
            _exit_removals.pop((self.name, self._identity), None)
        if remove:
            _remove_if_same(self.name, self._identity)

    def unlink(self) -> None:
        """Close this handle and remove the store's segments and lock file now, if they are still
        the store this handle attached to (attached processes keep their mappings)."""
        if self._closed:
            raise StoreClosedError(f"store {self.name!r} is closed: shmkv.remove({self.name!r}) removes it by name")
        self._close(remove=True)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.name!r} is closed: attach again with shmkv.attach({self.name!r})")

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(
                f"store {self.name!r} is attached read-only: attach with shmkv.attach({self.name!r}) to modify it"
            )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store lock, for structural operations. The outermost acquisition first rolls back
        what a process that died holding it left half done (see "crash recovery")."""
        self._check_writable()
        outer = not self._lock.is_held
        with self._lock.held(self.lock_timeout):
            if outer and (self._hdr[_header.W_UNDO_COUNT] or self._unit_depth):
                self._unit_depth = 0
                self._logged.clear()
                self._recover()
            yield

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """What a reader that must wait out a structural change holds: the store lock on a
        read-write attachment (which also recovers), a shared lock on a read-only one (no write
        access needed; LockTimeout after lock_timeout). Rows are then read with _settled_row."""
        self._check_open()
        if not self.readonly:
            with self._locked():
                yield
            return
        with self._lock.held(self.lock_timeout, shared=True):
            yield

    def _settled_row(self, slot: int) -> list[int]:
        """Row ``slot``'s words once a dead process's operation is rolled back (under _reading):
        a read-only reader cannot roll back, so it reads the logged old words (crash recovery)."""
        for i in range(self._hdr[_header.W_UNDO_COUNT]):
            if self._undo_np[i, 0] == slot:
                return self._undo_np[i, 1 : 1 + SEQ_WORDS].tolist()  # type: ignore[no-any-return]
        return self._table_np[slot].tolist()  # type: ignore[no-any-return]

    def transaction(self) -> Any:
        """Hold the store lock across several structural operations (a context manager)."""
        return self._locked()

    # -- clients ---------------------------------------------------------------

    def _register_client(self) -> None:
        me, start = os.getpid(), _segment.process_start_time(os.getpid())
        with self._locked():
            rows = self._clients_np
            free = None
            for i in range(self._max_clients):
                pid = int(rows[i, 0])
                if not 0 <= pid <= _segment.MAX_PID or int(rows[i, 1]) < 0:
                    raise CorruptStoreError(
                        f"store {self.name!r}: client table row {i} holds pid {pid}, start {int(rows[i, 1])}, "
                        "which no process has: the header was overwritten by something other than shmkv; "
                        f"check it with `shmkv verify {self.name}`, save what you need and create the store anew"
                    )
                if pid and not _segment.pid_alive(pid, int(rows[i, 1])):
                    rows[i] = 0
                    pid = 0
                if pid == 0 and free is None:
                    free = i
            if free is None:
                raise CacheFullError(
                    f"store {self.name!r}: all {self._max_clients} client slots hold live processes; "
                    "close unused attachments (or create the store with a larger max_clients=)"
                )
            rows[free, 1] = start
            rows[free, 2] = 1
            rows[free, 0] = me

    def _unregister_client(self, pid: int) -> None:
        with self._locked():
            rows = self._clients_np
            for i in range(self._max_clients):
                if int(rows[i, 0]) == pid:
                    rows[i] = 0
                    break

    def clients(self) -> list[int]:
        """Pids of the live read-write processes attached to the store."""
        self._check_open()
        out = []
        for pid, start, _flags, _ in self._clients_np.tolist():
            if pid and _segment.pid_alive(pid, start):
                out.append(pid)
        return out

    # -- the sequence table ----------------------------------------------------

    def _slot_of(self, seq_id: object) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise InvalidArgumentError(f"sequence id {seq_id!r} must be an int (Sequence.id)")
        seq_id = int(seq_id)
        # Ids are never reused, so a remembered slot is right exactly when its row still
        # holds that id, live: O(1) for every id this process has seen, flat in max_seqs.
        slot = self._slot_hint.get(seq_id)
        if slot is not None:
            b = slot * SEQ_WORDS
            if self._table[b + ID] == seq_id and self._table[b + STATE] == LIVE:
                return slot
        t = self._table_np
        hits = np.flatnonzero((t[:, ID] == seq_id) & (t[:, STATE] == LIVE))
        if hits.size:
            if len(self._slot_hint) > 4 * self.layout.max_seqs:
                self._slot_hint.clear()
            self._slot_hint[seq_id] = int(hits[0])
        if hits.size == 0:
            raise SequenceNotFound(
                f"store {self.name!r} has no sequence {seq_id!r}: it was freed or never created "
                "(store.sequences() lists the live ones)"
            )
        return int(hits[0])

    def _row(self, slot: int) -> memoryview:
        """Row ``slot`` of the sequence table (one memoryview a slot, reused: _changing knows it)."""
        row = self._rows.get(slot)
        if row is None:
            row = self._rows[slot] = self._table[slot * SEQ_WORDS : (slot + 1) * SEQ_WORDS]
            self._row_slot[id(row)] = slot
        return row

    # -- crash recovery ------------------------------------------------------------
    #
    # A process may die at any instruction (SIGKILL, OOM, a segfault), also inside a structural
    # operation, with the store lock held; the kernel then releases the lock. The protocol that
    # makes every such death leave the store exactly as before the operation:
    #
    # 1. Data is never written over committed cells that a row points to: new content goes into
    #    cells no row points to (a fresh range; a sequence's other window buffer, see _header
    #    WBUF; a range freed earlier in the same operation is never reused by it), and the rows
    #    are switched to it at the end.
    # 2. Before a row's words change, its old words (and its meta record) are appended to the
    #    undo log in the header (_log_row), then the log's count is published (one word). All
    #    the rows one operation changes (an "atomic unit": the outermost _changing bracket, or
    #    _unit() around several) are logged; the count goes back to 0 when the unit ends.
    # 3. Whoever next takes the store lock and finds a non-zero count (its writer is dead: it
    #    held the lock) puts every logged row back (_recover), with an even generation above
    #    any it had, so readers and writers see a change and reload. By (1), the cells the old
    #    rows point to are intact. Odd generations left by a dead process are made even.
    # 4. Frees inside a unit (evictions to make room) are complete on their own: their rows leave
    #    the log when done, so a recovery never resurrects a row whose cells were then reused.
    #
    # Token ids, positions and hashes go with the cells (1). Counters (hits, evictions), the
    # recency clock and the prefix index are not rolled back: they are statistics or hints
    # that lookups verify. Named crash points (_crash.point) let the tests kill a process at
    # every step of every operation.

    @contextmanager
    def _unit(self) -> Iterator[None]:
        """An atomic unit: every row changed inside it is rolled back together after a crash."""
        self._unit_depth += 1
        try:
            yield
        finally:
            self._unit_depth -= 1
            if self._unit_depth == 0:
                self._hdr[_header.W_UNDO_COUNT] = 0  # committed: the old rows are no longer needed
                self._logged.clear()

    def _log_row(self, slot: int) -> None:
        """Append row ``slot``'s current words and meta record to the undo log (once per unit)."""
        if slot in self._logged:
            return
        hdr = self._hdr
        k = hdr[_header.W_UNDO_COUNT]
        entry = self._undo_np[k]
        entry[0] = slot
        entry[1 : 1 + SEQ_WORDS] = self._table_np[slot]
        entry[1 + SEQ_WORDS :] = self._meta_w[slot]
        if k == 0:
            hdr[_header.W_UNDO_PID] = os.getpid()
            hdr[_header.W_UNDO_START] = _segment.process_start_time(os.getpid())
        hdr[_header.W_UNDO_COUNT] = k + 1  # published after the entry
        self._logged.add(slot)

    def _forget(self, *slots: int) -> None:
        """Drop completed rows from the undo log (a free inside a larger unit, see 4. above)."""
        hdr = self._hdr
        for slot in slots:
            if slot not in self._logged:
                continue
            k = hdr[_header.W_UNDO_COUNT]
            i = next(i for i in range(k) if self._undo_np[i, 0] == slot)
            if i != k - 1:
                self._undo_np[i] = self._undo_np[k - 1]  # the last entry moves into the gap first
            hdr[_header.W_UNDO_COUNT] = k - 1
            self._logged.discard(slot)

    def _recover(self) -> int:
        """Roll back the unit a dead process left (lock held); make odd generations even.
        Returns the rows put back."""
        hdr = self._hdr
        k = hdr[_header.W_UNDO_COUNT]
        t = self._table_np
        for i in range(k):
            entry = self._undo_np[i]
            slot = int(entry[0])
            if not 0 <= slot < self.layout.max_seqs:
                continue
            gen = max(int(entry[1 + GEN]), int(t[slot, GEN])) | 1
            row = self._row(slot)
            row[GEN] = gen  # odd while it is put back
            words = entry[1 : 1 + SEQ_WORDS].tolist()
            for w, v in enumerate(words):
                if w != GEN:
                    row[w] = v
            self._meta_w[slot] = entry[1 + SEQ_WORDS :]
            row[GEN] = gen + 1
        odd = np.flatnonzero(t[:, GEN] & 1)  # a bracket a dead process left open
        for slot in odd.tolist():
            self._row(slot)[GEN] += 1
        hdr[_header.W_UNDO_COUNT] = 0
        if k or odd.size:
            hdr[_header.W_RECOVERIES] += 1
            hdr[_header.W_GENERATION] += 1
        self._slot_hint.clear()
        return int(k)

    @contextmanager
    def _changing(self, row: memoryview) -> Iterator[None]:
        """Seqlock bracket around a structural change of one sequence (lock held); the row is
        logged for crash recovery and joins the current atomic unit (see above)."""
        slot = self._row_slot[id(row)]
        with self._unit():
            self._log_row(slot)
            row[GEN] += 1  # odd: readers wait
            try:
                yield
            finally:
                row[GEN] += 1
                self._hdr[_header.W_GENERATION] += 1

    def _free_ranges(self, taken: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """Gaps between the live ranges (and ``taken`` ones being staged by a restore), in order.

        Derived from the table each time (never stored, so never out of step with it), in numpy:
        a sort of the live rows' starts, tens of microseconds at 4096 sequences."""
        t = self._table_np
        used = t[:, STATE] != 0
        starts, caps = t[used, START], t[used, CAPACITY]
        if taken:
            extra = np.asarray(taken, np.int64).reshape(-1, 2)
            starts, caps = np.concatenate([starts, extra[:, 0]]), np.concatenate([caps, extra[:, 1]])
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], (starts + caps)[order]
        # end of everything before each range (ranges never overlap, but stay safe if they did)
        before = np.maximum.accumulate(np.concatenate([[0], ends]))
        gap_starts = np.concatenate([before[:-1], before[-1:]])
        gap_ends = np.concatenate([starts, [self.layout.max_tokens]])
        keep = gap_ends > gap_starts
        return list(zip(gap_starts[keep].tolist(), (gap_ends - gap_starts)[keep].tolist(), strict=True))

    def _alloc(self, capacity: int, taken: list[tuple[int, int]] | None = None, all_layers: bool = False,
               evict: bool = False, protect: int = -1) -> int:
        """First-fit a range of ``capacity`` cells (lock held); reserve its pages.

        ``evict``: evict finished sequences (least recently used first, never row ``protect``)
        when no free range is large enough."""
        gaps = self._free_ranges(taken)
        fit = next((start for start, size in gaps if size >= capacity), None)
        if fit is None and evict and self._evict(capacity, 0, protect):
            gaps = self._free_ranges(taken)
            fit = next((start for start, size in gaps if size >= capacity), None)
        if fit is not None:
            self._reserve(fit, capacity, all_layers)
            return fit
        raise CacheFullError(
            f"store {self.name!r} has no free range of {capacity} token cells "
            f"({sum(s for _, s in gaps)} of max_tokens={self.layout.max_tokens} free, fragmented or used): "
            "free or truncate sequences, or create the store with a larger max_tokens="
        )

    def _evict(self, cells: int, rows: int, protect: int = -1) -> bool:
        """Evict the fewest least-recently-used finished sequences after which a free range of
        ``cells`` cells and ``rows`` free table rows exist (lock held). Evicts nothing and returns
        False when evicting every finished sequence would not be enough (DESIGN §8)."""
        t = self._table_np
        cand = [int(i) for i in np.flatnonzero((t[:, STATE] == LIVE) & ((t[:, FLAGS] & FINISHED) != 0))
                if i != protect and not self._lease_holder(self._row(int(i)))[1]]  # never a live lease
        if not cand:
            return False
        cand.sort(key=lambda i: int(t[i, RECENCY]))
        enc = {i: int(t[i, ENC_SLOT]) - 1 for i in cand}  # an evicted sequence frees its encoder row too
        used = [int(i) for i in np.flatnonzero(t[:, STATE] != 0)]
        free_rows = self.layout.max_seqs - len(used)

        def fits(gone: set[int]) -> bool:
            if free_rows + len(gone) < rows:
                return False
            if not cells:
                return True
            live = sorted((int(t[i, START]), int(t[i, CAPACITY])) for i in used if i not in gone)
            pos = 0
            for start, cap in live:
                if start - pos >= cells:
                    return True
                pos = max(pos, start + cap)
            return self.layout.max_tokens - pos >= cells

        every = set(cand) | {e for e in enc.values() if e >= 0}
        if not fits(every):
            return False
        gone: set[int] = set()
        chosen = []
        for i in cand:
            chosen.append(i)
            gone.add(i)
            if enc[i] >= 0:
                gone.add(enc[i])
            if fits(gone):
                break
        for i in chosen:
            self._free_row(i)
            self._hdr[_header.W_EVICTIONS] += 1
        return True

    def _free_row(self, slot: int) -> None:
        """Free a sequence's row and its encoder row (lock held). Its index entries become
        invalid by themselves (see _prefix)."""
        row = self._row(slot)
        enc = row[ENC_SLOT] - 1
        with self._changing(row):
            self._drop_encoder(row)
            _crash.point("free.row")
            row[STATE] = 0
            row[LENGTH] = 0
            row[CAPACITY] = 0
            row[LEASE_PID] = 0
            row[ID] = 0
            row[FLAGS] = 0
            row[IDX_BLOCKS] = 0
            self._meta[slot, :8] = 0
        # complete: out of the undo log, so the unit's later use of its cells stays safe (rule 4)
        self._forget(slot, *([enc] if enc >= 0 else []))

    def _set_meta(self, slot: int, packed: bytes) -> None:
        """Write a sequence's packed metadata (lock held, row changing)."""
        rec = self._meta[slot]
        rec[8 : 8 + len(packed)] = np.frombuffer(packed, np.uint8)
        rec[:8] = np.frombuffer(len(packed).to_bytes(8, "little"), np.uint8)

    def _get_meta(self, slot: int) -> bytes:
        """A sequence's packed metadata, as stored (the caller checks the row's seqlock)."""
        rec = self._meta[slot]
        n = int.from_bytes(rec[:8].tobytes(), "little")
        return rec[8 : 8 + min(n, _header.META_BYTES)].tobytes()

    def _touch(self, row: memoryview) -> None:
        """Mark a use of a sequence for LRU eviction (lock held)."""
        clock = self._hdr[_header.W_CLOCK] + 1
        self._hdr[_header.W_CLOCK] = clock
        row[RECENCY] = clock

    def _index_blocks(self, slot: int, upto: int, adopt: bool = False) -> None:
        """Index the sequence's whole blocks up to token ``upto`` (lock held); set NOINDEX when a
        block cannot be (a token id -1, tokens moved by remove or shift_left). ``adopt``: also
        add entries for its blocks [0, IDX_BLOCKS), whose hashes came with copied cells."""
        row = self._row(slot)
        hdr = self._hdr
        if self._index.full(hdr[_header.W_INDEX_USED] + upto // 16):
            hdr[_header.W_INDEX_USED] = self._index.rebuild()
        if adopt:
            hdr[_header.W_INDEX_USED] += self._index.adopt(slot)
        hdr[_header.W_INDEX_USED] += self._index.index_blocks(slot, upto)
        if row[IDX_BLOCKS] < upto // 16:
            row[FLAGS] |= NOINDEX

    def _restored(self, slot: int, finished: bool, clean: int, meta: bytes) -> None:
        """A sequence a snapshot restore just published (lock held; called oldest use first):
        its prefix-cache state, a fresh recency, and its blocks in the index."""
        row = self._row(slot)
        # finished (evictable) only while nobody holds its lease: a restore over a sequence this
        # process writes keeps it the writer's
        row[FLAGS] = FINISHED if finished and not self._lease_holder(row)[1] else 0
        row[CLEAN] = clean
        row[IDX_BLOCKS] = 0
        with self._changing(row):
            self._set_meta(slot, meta)
        self._touch(row)
        self._index_blocks(slot, row[LENGTH])

    def _reserve(self, start: int, count: int, all_layers: bool = False) -> None:
        off = self._off
        cb = off.cell_bytes
        layers = range(self.layout.layers) if all_layers else self._full
        ranges = [(base + layer * off.layer_stride + start * cb, count * cb)
                  for base in (off.k_off, off.v_off) for layer in layers]
        ranges += [(off.tokens_off + start * 8, count * 8), (off.positions_off + start * 8, count * 8)]
        sb = self.layout.kv_heads * 4
        ranges += [(base + layer * off.scale_stride + start * sb, count * sb)
                   for base in (off.ks_off, off.vs_off) for layer in range(self.layout.layers) if off.scale_stride]
        self._dseg.reserve(ranges)

    def _reserve_window(self, slot: int) -> None:
        """Reserve a slot's buffer in every bounded layer (its size never changes)."""
        off, wc = self._off, self._wc
        if not wc:
            return
        cb = off.cell_bytes
        self._dseg.reserve([(base + j * off.w_stride + 2 * slot * wc * cb, 2 * wc * cb)  # both buffers
                            for base in (off.wk_off, off.wv_off) for j in range(len(self.layout.bounded))])

    def _wcell(self, slot: int, wbuf: int) -> int:
        """First cell of window buffer ``wbuf`` (0 or 1) of ``slot`` in the bounded layers' arrays."""
        return (2 * slot + wbuf) * self._wc

    def _set_encoder(self, parent: memoryview, n: int, start: int | None = None, slot: int | None = None) -> int:
        """Give the sequence on ``parent`` a fresh encoder row of ``n`` cells (lock held, parent
        changing); the old one is freed. ``start``: a range already reserved for it.
        Returns the new range's first cell."""
        # the new row and range first, then the old encoder goes: its cells are not reused here
        if slot is None:
            slot = self._free_slot("an encoder cache")
        if start is None:
            start = self._alloc(max(n, 1), all_layers=True)
        self._drop_encoder(parent)
        row = self._row(slot)
        with self._changing(row):
            row[ID], row[START], row[CAPACITY], row[LENGTH] = parent[ID], start, max(n, 1), n
            row[STATE] = ENCODER
        parent[ENC_SLOT] = slot + 1
        return start

    def _drop_encoder(self, parent: memoryview) -> None:
        if parent[ENC_SLOT]:
            row = self._row(parent[ENC_SLOT] - 1)
            with self._changing(row):
                row[STATE] = 0
                row[LENGTH] = row[CAPACITY] = row[ID] = 0
            parent[ENC_SLOT] = 0

    def _copy_all_layers(self, src: int, dst: int, n: int) -> None:
        """Copy n cells of every layer's main-arena K/V (and scales): encoder ranges."""
        for arr in (self._K, self._V, self._KS, self._VS):
            if arr is not None and n:
                for layer in range(self.layout.layers):
                    np.copyto(arr[layer, dst : dst + n], arr[layer, src : src + n])

    def _copy_window(self, a: int, b: int, n: int) -> None:
        """Copy n cells from cell a to cell b of every bounded layer's window array."""
        if n <= 0 or a == b:
            return
        for layer in self.layout.bounded:
            for arr in (self._Kl[layer], self._Vl[layer]):
                np.copyto(arr[b : b + n], arr[a : a + n])

    def _rewrite(self, slot: int, full: list[tuple[int, int, int]], window: list[tuple[int, int, int]],
                 capacity: int | None = None, protect: int = -1) -> tuple[int, int]:
        """New content for a sequence, written where no row points (crash recovery, rule 1):
        ``full`` parts (src token, dst token, n) into a fresh range of ``capacity`` cells (default:
        the same), ``window`` parts (src, dst, n) as offsets into the slot's active and other window
        buffers. Returns (new start, new WBUF) for the caller to switch the row to (lock held)."""
        row = self._row(slot)
        start, wb = row[START], row[WBUF]
        new_start = self._alloc(row[CAPACITY] if capacity is None else capacity, evict=True, protect=protect)
        for src, dst, n in full:
            self._copy_cells(start + src, new_start + dst, n)
        a0, b0 = self._wcell(slot, wb), self._wcell(slot, 1 - wb)
        for src, dst, n in window:
            self._copy_window(a0 + src, b0 + dst, n)
        return new_start, 1 - wb

    def _copy_cells(self, src: int, dst: int, n: int) -> None:
        """Copy n cells of every layer, token id and position (lock held; overlap-safe)."""
        if n <= 0 or src == dst:
            return
        # one layer at a time: a 4-D slice over all layers spans overlapping address
        # extents, and numpy would then copy through a temporary (half the bandwidth)
        for arrs in ([self._Kl[i] for i in self._full], [self._Vl[i] for i in self._full], self._KS, self._VS):
            for layer in arrs if arrs is not None else ():
                np.copyto(layer[dst : dst + n], layer[src : src + n])
        self._tokens[dst : dst + n] = self._tokens[src : src + n]
        self._positions[dst : dst + n] = self._positions[src : src + n]
        self._hashes[dst : dst + n] = self._hashes[src : src + n]

    def _lease_holder(self, row: memoryview) -> tuple[int, bool]:
        """(pid, alive) of the lease on ``row``; alive means it may not be taken."""
        pid = row[LEASE_PID]
        if pid == 0:
            return 0, False
        if pid == os.getpid() and self._fork_epoch == _segment.fork_epoch:
            return pid, row[LEASE_TOKEN] in live_writers
        return pid, _segment.pid_alive(pid, row[LEASE_START])

    def _check_not_leased_by_other(self, row: memoryview, seq_id: int, allow_token: int = 0) -> None:
        pid, alive = self._lease_holder(row)
        if alive and not (allow_token and row[LEASE_TOKEN] == allow_token):
            who = "another handle in this process" if pid == os.getpid() else f"live process {pid}"
            raise LeaseError(
                f"sequence {seq_id} of store {self.name!r} is leased by {who}: "
                "its writer must release() it first (or exit)"
            )

    # -- sequences -------------------------------------------------------------

    def create_sequence(self, capacity: int = DEFAULT_CAPACITY, *, prefix: Any = None, tier: Any = None,
                        _protect: int = -1) -> Any:
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
        capacity = count("capacity", capacity, minimum=1)
        if capacity > self.layout.max_tokens:
            raise CacheFullError(
                f"capacity={capacity} exceeds the store's max_tokens={self.layout.max_tokens}: "
                "ask for less, or create the store with a larger max_tokens="
            )
        toks = None if prefix is None else _prompt(prefix)
        token = new_token()
        with self._locked():
            n, _, donor = self._index.match(toks) if toks is not None else (0, 0, -1)
            try:
                slot, start = self._new_row(max(capacity, n), protect=donor if n else _protect)
            except CacheFullError:
                if n == 0:
                    raise
                n, donor = 0, -1  # only the donor's eviction makes room: a miss, which may evict it
                slot, start = self._new_row(capacity, protect=_protect)
            row = self._row(slot)
            seq_id = self._hdr[_header.W_NEXT_ID]
            self._hdr[_header.W_NEXT_ID] = seq_id + 1  # ids are never reused: a rolled-back create skips one
            with self._unit():  # the row and its prefix: both, or after a crash neither
                with self._changing(row):
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
                    self._meta[slot, :8] = 0
                    self._touch(row)
                    row[LEASE_START] = _segment.process_start_time(os.getpid())
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
        if tier is not None:
            if toks is None:
                raise InvalidArgumentError("create_sequence: tier= needs prefix= (the prompt's token ids)")
            tier.pull(seq, toks, have=n)  # network I/O: outside the store lock
        return seq

    def _new_row(self, capacity: int, protect: int = -1) -> tuple[int, int]:
        """A free table row and a reserved range for a new sequence (lock held), evicting
        finished sequences other than row ``protect`` when there is no room."""
        t = self._table_np
        has_row = bool((t[:, STATE] == 0).any())
        has_cells = any(size >= capacity for _, size in self._free_ranges())
        if not (has_row and has_cells):
            # one plan for the row and the cells together: evict only if both then fit
            self._evict(capacity, 1, protect)
        slot = self._free_slot("a new sequence")
        start = self._alloc(capacity)
        self._reserve_window(slot)
        return slot, start

    def match_prefix(self, tokens: Any) -> int:
        """Tokens of ``tokens`` that ``create_sequence(prefix=tokens)`` would reuse now.

        No side effect: no counter, no recency, no lock; works on a read-only attachment.

        Example:
            >>> store.match_prefix(prompt)   # doctest: +SKIP
            299
        """
        self._check_open()
        return self._index.match(_prompt(tokens))[0]

    def sequence(self, seq_id: int, write: bool = False) -> Any:
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
        with self._locked():
            slot = self._slot_of(seq_id)
            row = self._row(slot)
            self._check_not_leased_by_other(row, int(seq_id))
            if row[FLAGS] & FINISHED:  # taken back (a chat's next turn): no longer evictable
                row[FLAGS] &= ~FINISHED
                self._touch(row)
            row[LEASE_START] = _segment.process_start_time(os.getpid())
            row[LEASE_TOKEN] = token
            _crash.point("lease.taken")
            row[LEASE_PID] = os.getpid()  # last: until then the old (dead) holder's lease stands
        return Sequence(self, int(seq_id), slot, write=True, token=token)

    def _writer_for(self, seq_id: int) -> Any:
        """This process's live write handle on ``seq_id`` through this store, if any."""
        for handle in list(live_writers.values()):
            if handle._store is self and handle.id == seq_id and handle._write:
                return handle
        return None

    def forward(self, seq_ids: Any, positions: Any, tokens: Any = None) -> Any:
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
        for slot in np.flatnonzero(self._table_np[:, STATE] == LIVE):
            r = self._table_np[slot].tolist()
            alive = bool(r[LEASE_PID]) and _segment.pid_alive(r[LEASE_PID], r[LEASE_START])
            out.append(SequenceInfo(r[ID], r[LENGTH], r[CAPACITY], r[START], r[LEASE_PID], alive, r[GEN],
                                    bool(r[FLAGS] & FINISHED)))
        return sorted(out, key=lambda s: s.id)

    def copy_prefix(self, src_id: int, dst_id: int, n: int) -> None:
        """Replace sequence ``dst_id``'s content with the first ``n`` tokens of ``src_id``.

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
            self._copy_prefix_rows(self._slot_of(src_id), d_slot, n)

    def _copy_prefix_rows(self, s_slot: int, d_slot: int, n: int) -> None:
        """copy_prefix between rows (lock held, ids checked): dst's content becomes src's first
        n tokens, and dst's whole blocks join the prefix index."""
        s_row, d_row = self._row(s_slot), self._row(d_slot)
        s_off = s_row[WIN_OFF]
        need = self.layout.resume_from(n)  # the oldest token a next token needs on bounded layers
        if self.layout.bounded and s_off > need:
            raise NotSupportedError(
                f"copy_prefix: the sliding/chunked layers of sequence {s_row[ID]} hold tokens {s_off}.. only; "
                f"a prefix of n={n} needs tokens from {need} on"
            )
        lo = max(s_off, n - self.layout.keep, 0)  # what the next tokens need, from what src holds
        src_win = self._wcell(s_slot, s_row[WBUF]) + lo - s_off
        with self._changing(d_row):
            if d_row[LENGTH] == 0 and n <= d_row[CAPACITY]:
                # dst holds nothing committed: its own cells and window buffer are free to write
                self._copy_cells(s_row[START], d_row[START], n)
                self._copy_window(src_win, self._wcell(d_slot, d_row[WBUF]), n - lo)
                _crash.point("copy_prefix.copied")
            else:  # never over dst's committed cells: a fresh range and dst's other window buffer
                new_start = self._alloc(max(n, d_row[CAPACITY]), evict=True, protect=s_slot)
                self._copy_cells(s_row[START], new_start, n)
                wb = 1 - d_row[WBUF]
                self._copy_window(src_win, self._wcell(d_slot, wb), n - lo)
                _crash.point("copy_prefix.copied")
                d_row[START], d_row[CAPACITY], d_row[WBUF] = new_start, max(n, d_row[CAPACITY]), wb
            d_row[WIN_OFF] = lo if self.layout.bounded else 0
            d_row[LENGTH] = n
            clean = s_row[CLEAN]
            d_row[CLEAN] = -1 if clean < 0 or clean >= n else clean
            # the copied hashes are valid for src's indexed blocks: dst's entries start from them
            d_row[IDX_BLOCKS] = min(s_row[IDX_BLOCKS], n // 16)
            d_row[FLAGS] &= ~NOINDEX
            self._index_blocks(d_slot, n, adopt=True)

    def _relocate(self, slot: int, row: memoryview, needed: int, keep: int, protect: int = -1) -> None:
        """Give a sequence at least ``needed`` cells, keeping its first ``keep`` (lock held, row changing).

        Tried in order: grow in place into the free cells after the range;
        slide down into free cells before it (plus any after); move to a free
        range elsewhere. Sizes tried: twice the capacity, then exactly ``needed``.
        """
        start, cap = row[START], row[CAPACITY]
        new_cap = min(max(needed, 2 * cap), self.layout.max_tokens)
        gaps = self._free_ranges()
        before = next((g for g in gaps if g[0] + g[1] == start), (start, 0))
        after = next((g for g in gaps if g[0] == start + cap), (start + cap, 0))
        for want in dict.fromkeys((new_cap, needed)):
            if cap + after[1] >= want:
                self._reserve(start + cap, want - cap)
                row[CAPACITY] = want
                return
            new_start = max(before[0], start + cap + after[1] - want)
            if before[1] + cap + after[1] >= want and new_start + keep <= start:
                # slide down into free cells before it, never over its own committed cells
                self._reserve(new_start, want)
                self._copy_cells(start, new_start, keep)  # overlapping: numpy buffers it
                row[START], row[CAPACITY] = new_start, want
                return
        for want in dict.fromkeys((new_cap, needed)):
            try:
                new_start = self._alloc(want, evict=want == needed, protect=protect)
            except CacheFullError:
                continue
            self._copy_cells(start, new_start, keep)
            _crash.point("grow.copied")
            row[START] = new_start
            _crash.point("grow.switched")
            row[CAPACITY] = want
            return
        raise CacheFullError(
            f"store {self.name!r}: sequence {row[ID]} needs {needed} token cells and no free range "
            f"is that large ({sum(s for _, s in gaps)} of max_tokens={self.layout.max_tokens} free): "
            "free or truncate sequences, or create the store with a larger max_tokens="
        )

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


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


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
    """Unlink the segments, then the lock file (never the lock while a segment exists)."""
    found = _segment.unlink(_segment.header_name(name))
    found = _segment.unlink(_segment.data_name(name)) or found
    try:
        os.unlink(_segment.lock_path(name))
    except FileNotFoundError:
        pass
    except PermissionError:
        raise _segment.denied(os.path.basename(_segment.lock_path(name)), "lock file") from None
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
        words = np.frombuffer(hseg.mm, np.int64, _header.FIXED_BYTES // 8)  # type: ignore[arg-type]
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


def _close_segments(hseg: Segment, dseg: Segment) -> None:
    hseg.close()
    dseg.close()


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
    try:
        words = np.frombuffer(hseg.mm, np.int64, _header.FIXED_BYTES // 8) if hseg.size >= 512 else None  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout
        while words is not None and int(words[_header.W_MAGIC]) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # the creator writes the magic last
        raw = np.frombuffer(hseg.mm, np.uint8)  # type: ignore[arg-type]
        layout, max_clients = _header.read(words if words is not None else np.zeros(64, np.int64), raw,
                                           hseg.size, name)
        persistent = bool(words[_header.W_PERSISTENT])  # type: ignore[index]
        del words, raw
        dseg = Segment.open(_segment.data_name(name), readonly)
        off = _header.offsets(layout, max_clients)
        if dseg.size < off.data_bytes:
            dseg.close()
            raise CorruptStoreError(
                f"store {name!r}: data segment is {dseg.size} bytes, the header needs {off.data_bytes}"
            )
    except StoreNotFound:
        hseg.close()
        raise StoreNotFound(
            f"no store named {name!r} (shmkv.list_stores() or `shmkv ls` lists them)"
        ) from None
    except BaseException:
        hseg.close()
        raise
    store = Store(name, hseg, dseg, layout, max_clients, creator=False, persistent=persistent,
                  lock_timeout=lock_timeout)
    if not readonly:
        try:
            store._register_client()
        except BaseException:
            store.close()
            raise
    return store


def register_client(store: Store) -> None:
    """Enter this process in ``store``'s client table (create and attach, read-write)."""
    store._register_client()


def identity(store: Store) -> int:
    """The identity word ``store``'s header held when it was opened."""
    return store._identity
