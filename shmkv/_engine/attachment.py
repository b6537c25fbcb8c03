"""A process's attachment to a store: its mappings, the sequence table and its seqlocks, the
store lock, clients and leases, closing. ``engine.Engine``, what ``Store`` (the API) holds, builds on
it and composes the parts that work on these (journal, pages, arena, spans).

Concurrency (docs/design.md §3; the numbered invariants 1-5 of ARCHITECTURE.md): the
hot path publishes a sequence's length after its cells; structural operations hold the store
lock and keep a row's seqlock generation odd while they change it.

* Structural operations change rows inside journaled transactions (``_engine/locking/journal.py``: the one
  way into the lock, the undo log, rollback and crash recovery).
* Liveness: every read-write attachment holds a slot of the client table and
  that slot's byte of the liveness file (a kernel lock, see ``liveness``); a lease
  names its holder's client key and can be taken once that byte is free.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import types
import weakref
from typing import Any, NamedTuple, NoReturn

import numpy as np

from shmkv._engine.table import dtypes as _dtypes
from shmkv._engine.clients import futex as _futex
from shmkv._engine.table import header as _header
from shmkv._engine.clients import liveness as _liveness
from shmkv._engine.locking import lock as _lock
from shmkv._engine.clients import row_waiters as _row_waiters
from shmkv._engine.memory import segment as _segment
from shmkv._engine.table.header import (
    C_KEY, CLIENT_WORDS, LEASE_CLIENT, LENGTH, LEASE_PID, LEASE_TOKEN,
    SEQ_WORDS, INDEX_WORDS, Layout,
)
from shmkv._engine.locking.own_changes import counts_here
from shmkv._engine.clients.lease import live_writers
from shmkv._engine.memory.intervals import Record
from shmkv._engine.prefixes.index import PrefixIndex
from shmkv._engine.clients.row_waiters import RowWaiters
from shmkv._engine.memory.segment import Segment
from shmkv._engine.spans.mappings import Shares
from shmkv.errors import (
    LeaseError,
    ReadOnlyError,
    StoreClosedError,
)


def _words(mm: Any, offset: int, count: int) -> memoryview:
    """An int64 memoryview of ``count`` words at ``offset``: item reads give Python ints."""
    return memoryview(mm)[offset : offset + 8 * count].cast("q")


def _address(mm: Any, view: np.ndarray, at: int) -> int:
    """The address of mapping ``mm``'s byte 0 in this process; ``view``: a view of it from byte
    ``at``, asked when the mapping is read-only (ctypes takes only a writable buffer)."""
    if view.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(mm))
    addr: int = view.ctypes.data - at
    return addr


def read_only_view(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _close_segments(hseg: Segment, dseg: Segment, live: _liveness.Liveness) -> None:
    live.close()
    hseg.close()
    dseg.close()


class DataViews(NamedTuple):
    """What ``Attachment.data_views`` maps (see there)."""

    K: np.ndarray
    V: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    hashes: np.ndarray
    meta: np.ndarray
    prefix_index: PrefixIndex
    Kl: list[np.ndarray]
    Vl: list[np.ndarray]
    KS: np.ndarray | None
    VS: np.ndarray | None
    KSl: list[np.ndarray] | None
    VSl: list[np.ndarray] | None


class Attachment:
    """What a store handle maps and the rules for touching it (see the module docstring): the
    base of ``engine.Engine``, which ``Store`` holds; ``Sequence``, ``_snapshot`` and ``Batch``
    reach the shared-memory state through the engine as a ``port.Port``."""

    # The data views (``data_views``), set with the rows part at their first use
    # (``Engine._build_reader``); an attach that only joins maps none of them.
    K: np.ndarray
    V: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    _hashes: np.ndarray
    meta: np.ndarray
    index: PrefixIndex
    Kl: list[np.ndarray]
    Vl: list[np.ndarray]
    KS: np.ndarray | None
    VS: np.ndarray | None
    KSl: list[np.ndarray] | None
    VSl: list[np.ndarray] | None

    def __init__(self, name: str, hseg: Segment, dseg: Segment, layout: Layout, max_clients: int, *,
                 creator: bool, persistent: bool, lock_timeout: float,
                 live: _liveness.Liveness | None = None) -> None:
        self.name = name
        self.layout = layout
        self.readonly = hseg.readonly
        self.lock_timeout = float(lock_timeout)
        self.creator = creator
        self._persistent = persistent
        self._pid = os.getpid()
        self._fork_epoch = _segment.fork_epoch
        self.shut = False  # closed for use: check_open raises (the last steps of close() set it)
        self.closed = False  # close() has begun: what Store.closed says, and what handles check
        self._hseg, self._dseg = hseg, dseg
        self.lock_path = _segment.lock_path(name)
        self._lock = _lock.StoreLock(self.lock_path, name, readonly=hseg.readonly)
        try:
            self._live = live if live is not None else _liveness.Liveness(name, hseg.readonly)
        except BaseException:
            self._lock.close()
            raise
        off = self._off = _header.offsets(layout, max_clients)
        hmm, dmm = hseg.mm, dseg.mm
        assert hmm is not None and dmm is not None
        self._max_clients = max_clients
        self.hdr = _words(hseg.mm, 0, _header.FIXED_BYTES // 8)
        self.identity = self.hdr[_header.W_IDENTITY]
        self._table = _words(hseg.mm, off.seq_off, layout.max_seqs * SEQ_WORDS)
        # every array over a mapping is an np.ndarray over one np.frombuffer of it (which holds the
        # mmap's export), never np.ndarray over the mmap itself: close() would unmap under live views
        # (tests/test_lifecycle.py::test_a_view_outliving_close...); one array each, not a reshape too
        hbuf = np.frombuffer(hmm, np.uint8)
        ms = layout.max_seqs
        self.table_np = np.ndarray((ms, SEQ_WORDS), np.int64, hbuf, off.seq_off)
        self.clients_np = np.ndarray((max_clients, CLIENT_WORDS), np.int64, hbuf, off.client_off)
        L = layout.layers
        bounded = layout.bounded  # (a property: asked once, not once a layer)
        self._full = [i for i in range(L) if i not in bounded]  # the layers that are not sliding/chunked
        dbuf = np.frombuffer(dmm, np.uint8)  # (the data views: ``data_views``, at their first use)
        self._slot_hint: dict[int, int] = {}  # sequence id -> table row, checked on use (see _slot_of)
        self._rows: dict[int, memoryview] = {}  # slot -> its row (see _row)
        self._row_slot: dict[int, int] = {}  # id(row) -> slot
        # the undo log and the meta records, as the journal reads and writes them (_engine/locking/journal.py)
        self._undo_np = np.ndarray((ms, _header.UNDO_WORDS), np.int64, hbuf, off.undo_off)
        self._meta_w = np.ndarray((ms, _header.META_RECORD // 8), np.int64, hbuf, off.meta_off)
        self._undo = _RowViews(hmm, off.undo_off, _header.UNDO_WORDS)  # memoryviews: fast to copy into
        self._meta_mv = _RowViews(hmm, off.meta_off, _header.META_RECORD // 8)
        self.waiters = _words(hmm, off.wait_off, layout.max_seqs)  # Sequence.wait's sleepers per row
        # ... of read-only attachments (_engine/clients/row_waiters.py)
        self.ro_waiters = RowWaiters(name, layout.max_seqs)
        hbase = _address(hmm, self.table_np, off.seq_off)
        self.length_addr0 = hbase + off.seq_off + 8 * LENGTH  # futex words (_sequence/waiting.py)
        self.waiters_addr0 = hbase + off.wait_off  # (changed atomically)
        self.waiting: dict[int, int] = {}  # slot -> this handle's threads waiting on it
        self.here = counts_here(name, layout.max_seqs)  # (writer.kept)
        # cell intervals this process reserved (pages.Pages.reserve)
        self._rec = Record()
        self._dbase = _address(dmm, dbuf, 0)  # address of the data segment's byte 0
        # shared prefix pages (docs/design.md §11): what a span covers, and what this process has mapped
        pieces = [(base + i * off.layer_stride, off.cell_bytes) for base in (off.k_off, off.v_off) for i in self._full]
        if off.scale_stride:
            pieces += [(base + i * off.scale_stride, layout.kv_heads * 4) for base in (off.ks_off, off.vs_off)
                       for i in range(L)]
        self.shares = Shares(self.hdr, self.table_np, dmm, dseg.fileno(), pieces, readonly=hseg.readonly,
                             reserved=self._rec.cells, owed=self._rec.owed, base=self._dbase)
        # A dropped handle closes its descriptors; it never removes the store (only close or exit do).
        self._finalizer: weakref.finalize[[Segment, Segment, _liveness.Liveness], Attachment] | None = \
            weakref.finalize(self, _close_segments, hseg, dseg, self._live)
        self._finalizer.atexit = False  # at exit the process closes them anyway

    def data_views(self) -> DataViews:
        """The views of the data segment (K, V, tokens, positions, hashes, per-layer views, int8
        scales), the meta records and the prefix index. Only a sequence's data, a prefix lookup
        and a structural operation read them, so an attach does not build them:
        ``Engine.__getattr__`` sets them, with the rows part, at the first use of any of them."""
        layout, off = self.layout, self._off
        hmm, dmm = self._hseg.mm, self._dseg.mm
        assert hmm is not None and dmm is not None
        hbuf, dbuf = np.frombuffer(hmm, np.uint8), np.frombuffer(dmm, np.uint8)
        ms = layout.max_seqs
        dt = _dtypes.storage(layout.dtype)
        L, T, H, D = layout.layers, off.cells, layout.kv_heads, layout.head_dim  # T: max_tokens and the slack
        it = np.dtype(dt).itemsize
        kv_strides = (off.layer_stride, H * D * it, D * it, it)  # layers page-aligned (docs/design.md §11)
        K = np.ndarray((L, T, H, D), dt, dbuf, off.k_off, kv_strides)
        V = np.ndarray((L, T, H, D), dt, dbuf, off.v_off, kv_strides)
        tokens = np.ndarray((T,), np.int64, dbuf, off.tokens_off)
        positions = np.ndarray((T,), np.int64, dbuf, off.positions_off)
        hashes = np.ndarray((T,), np.int64, dbuf, off.hashes_off)
        index = PrefixIndex(_words(hmm, off.index_off, off.index_slots * INDEX_WORDS), self._table,
                            tokens, positions, hashes, layout=layout)
        # Per-layer views: slicing one is cheaper than a 4-D index. A sliding or chunked
        # layer's view is its window region instead: a buffer of window_cells per slot.
        Kl, Vl = list(K), list(V)
        bounded = layout.bounded
        nb, WT = len(bounded), 2 * layout.max_seqs * layout.window_cells  # two buffers a slot
        if nb:
            WK = np.ndarray((nb, WT, H, D), dt, dbuf, off.wk_off)
            WV = np.ndarray((nb, WT, H, D), dt, dbuf, off.wv_off)
            for j, layer in enumerate(bounded):
                Kl[layer], Vl[layer] = WK[j], WV[j]
        # int8 stores: one float32 scale per (layer, cell, head) for K and for V
        S = L * T * H if layout.dtype == "int8" else 0
        s_strides = (off.scale_stride, H * 4, 4)
        KS = np.ndarray((L, T, H), np.float32, dbuf, off.ks_off, s_strides) if S else None
        VS = np.ndarray((L, T, H), np.float32, dbuf, off.vs_off, s_strides) if S else None
        # what every Sequence handle reads through (Kr, Vr) is built once, at the first handle, not
        # per handle (a handle is made per request) nor by an attach that makes none
        return DataViews(K, V, tokens, positions, hashes, np.ndarray((ms, _header.META_RECORD), np.uint8, hbuf,
                                                                     off.meta_off),
                         index, Kl, Vl, KS, VS, list(KS) if KS is not None else None,
                         list(VS) if VS is not None else None)

    @functools.cached_property  # (stored on the instance at the first use: later reads are plain lookups)
    def Kr(self) -> list[np.ndarray]:
        """Read-only views of ``Kl``, built at the first use (see ``__init__``)."""
        return [read_only_view(a) for a in self.Kl]

    @functools.cached_property
    def Vr(self) -> list[np.ndarray]:
        """Read-only views of ``Vl``, built at the first use."""
        return [read_only_view(a) for a in self.Vl]

    def check_open(self) -> None:
        if self.shut:
            raise StoreClosedError(f"store {self.name!r} is closed: attach again with shmkv.attach({self.name!r})")

    def check_writable(self) -> None:
        if self.shut:
            self.check_open()  # raises
        if self.readonly:
            raise ReadOnlyError(
                f"store {self.name!r} is attached read-only: attach with shmkv.attach({self.name!r}) to modify it"
            )

    def kv_bytes(self, layers: int) -> int:
        """Bytes of K and V (and int8 scales) of one token in ``layers`` layers."""
        scales = self.layout.kv_heads * 4 if self.KS is not None else 0
        return 2 * layers * (self._off.cell_bytes + scales)

    # -- closing (Store.close runs these steps; each may be cut short and run again) ----------

    def lock_owned(self) -> bool:
        """Whether the calling thread holds the store lock (its own transaction's rows are odd)."""
        return self._lock.owned()

    def quiesce(self, timeout: float) -> bool:
        """Wait out another thread's hold of the store lock before closing (see StoreLock.quiesce)."""
        return self._lock.quiesce(timeout)

    def unquiesce(self) -> None:
        self._lock.unquiesce()

    def inherited(self) -> bool:
        """Whether this handle came to this process by fork (its leases and client row are the parent's)."""
        return self._fork_epoch != _segment.fork_epoch or self._pid != os.getpid()

    def drop_waiters(self) -> None:
        """Take this handle's sleepers in Sequence.wait off the rows' waiter counts (they end
        with StoreClosedError without touching the store again): the header's counts on a
        read-write attachment, the liveness file's on a read-only one, atomically either way
        (``waiting`` read under its lock: a count raised just now too)."""
        if not _futex.AVAILABLE:
            return
        if not self.readonly:
            with _row_waiters.LOCK:
                for slot, n in self.waiting.items():
                    _futex.atomic_add(self.waiters_addr0 + 8 * slot, -n)
        elif self.ro_waiters.writable:
            self.ro_waiters.drop(self.waiting)

    def shut_down(self, wake: bool) -> None:
        """Give up the client row (and its byte of the liveness file: no lock taken) and refuse
        further use; ``wake``: this handle's sleepers in Sequence.wait look again and see
        StoreClosedError."""
        self.unregister_client()
        self.shut = True
        if wake:
            for slot in list(self.waiting):
                _futex.wake(self.length_addr0 + slot * 8 * SEQ_WORDS)

    def release(self) -> None:
        """Drop every reference this handle holds into its mappings (arrays, memoryviews, and the
        objects and containers made of them), then close the descriptors, so that closing the
        segments unmaps them at once. What the caller still holds (views, Sequence handles)
        keeps its own pages mapped and valid until it is collected (never a segfault); a closed
        handle only checks it is closed."""
        release_views(self, self.name)
        self._live.close()
        self._lock.close()
        self._hseg.close()  # unmapped now, unless views (or handles) the caller keeps hold them
        self._dseg.close()
        if self._finalizer is not None:
            self._finalizer.detach()

    # -- clients ---------------------------------------------------------------

    def alive(self, key: int) -> bool:
        """Whether client key ``key`` (a lease's, the creator's) is alive: its byte is locked."""
        slot = _liveness.slot_of(key)
        if key <= 0 or slot >= self._max_clients:
            return False
        return self._live.alive(key, int(self.clients_np[slot, C_KEY]))

    def unregister_client(self) -> None:
        live = self._live
        if live.key and live.pid == os.getpid():
            row = self.clients_np[_liveness.slot_of(live.key)]
            if int(row[C_KEY]) == live.key:
                row[:] = 0  # ours while we hold the byte: no lock needed
        live.close()

    # -- the sequence table ----------------------------------------------------

    def row(self, slot: int) -> memoryview:
        """Row ``slot`` of the sequence table (one memoryview a slot, reused: the journal's changing() knows it)."""
        row = self._rows.get(slot)
        if row is None:
            row = self._table[slot * SEQ_WORDS : (slot + 1) * SEQ_WORDS]
            # the slot first: a Ctrl-C at the id() call must not leave a row the journal cannot name
            # (tests/test_journal.py::test_sigints_never_leave_the_lock_held found it)
            self._row_slot[id(row)] = slot
            self._rows[slot] = row
        return row

    def _lease_holder(self, row: memoryview) -> tuple[int, bool]:
        """(pid, alive) of the lease on ``row``; alive means it may not be taken. A lease of this
        process is alive while its handle is; another's while its client key is (liveness)."""
        pid = row[LEASE_PID]
        if pid == 0:
            return 0, False
        key = row[LEASE_CLIENT]
        if key in _liveness.own_keys:
            return pid, row[LEASE_TOKEN] in live_writers
        return pid, self.alive(key)

    def check_not_leased_by_other(self, row: memoryview, seq_id: int, allow_token: int = 0) -> None:
        pid, alive = self._lease_holder(row)
        if alive and not (allow_token and row[LEASE_TOKEN] == allow_token):
            own = row[LEASE_CLIENT] in _liveness.own_keys
            who = "another handle in this process" if own else f"live process {pid}"
            raise LeaseError(
                f"sequence {seq_id} of store {self.name!r} is leased by {who}: "
                "its writer must release() it first (or exit)"
            )


class _RowViews:
    """Lazily made int64 memoryviews of fixed-size records ``i`` of a region (undo log, meta)."""

    def __init__(self, mm: Any, offset: int, words: int) -> None:
        self._mm, self._offset, self._words = mm, offset, words
        self._views: dict[int, memoryview] = {}

    def __getitem__(self, i: int) -> memoryview:
        v = self._views.get(i)
        if v is None:
            v = self._views[i] = _words(self._mm, self._offset + i * self._words * 8, self._words)
        return v


class Closed:
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


def release_views(obj: object, name: str) -> None:
    """Replace every attribute of ``obj`` that is, or holds, a view of a mapping with ``Closed``."""
    closed = Closed(name)
    for attr, value in list(vars(obj).items()):
        t = type(value)
        if t in _VIEWS or (t not in _LEAVES and _holds_views(value)):
            setattr(obj, attr, closed)


# (exact types that are views, and exact types that neither are nor hold one: most of a handle's
# attributes, answered by one lookup; tests/test_lifecycle.py checks the leaves hold none)
_VIEWS = frozenset((np.ndarray, memoryview, mmap.mmap))
_LEAVES = frozenset((int, float, bool, str, bytes, type(None), Closed, types.MethodType,
                     _header.Layout, _header.Offsets, Record, _lock.StoreLock, _liveness.Liveness))


def _holds_views(value: object, depth: int = 2) -> bool:
    """Whether ``value`` is, or holds (``depth`` levels down: list and tuple items, dict values,
    an object's ``__dict__`` values), a view of a mapping. Callers skip the ``_LEAVES`` first (a
    lookup, not a call)."""
    if isinstance(value, (np.ndarray, memoryview, mmap.mmap)):
        return True
    if isinstance(value, Closed):  # (a close() that is finishing an interrupted one)
        return False
    if depth <= 0 or isinstance(value, (str, bytes, int, float, Segment)):
        return False
    items: Any
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        fields = getattr(value, "__dict__", None)
        if not isinstance(fields, dict):
            return False
        items = fields.values()
    leaves = _LEAVES
    # (a loop with the views and the leaves answered by a lookup here: any() over a generator costs
    # a frame and a call a value)
    for v in items:
        t = type(v)
        if t in _VIEWS or (t not in leaves and _holds_views(v, depth - 1)):
            return True
    return False
