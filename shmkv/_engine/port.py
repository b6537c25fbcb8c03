"""``Port``: the narrow core of a store's engine, the one way the sequence layer and snapshots reach it.

``Sequence`` and its parts (``_sequence.reader``, ``writer``, ``structural``, ``rewind``,
``waiting``) and ``_snapshot`` (save / restore) work on the shared-memory state of a store
(its arrays, table rows, locks and cell placing) through a ``Port`` and nothing else: they
touch no underscore attribute of the engine (tests/test_architecture.py checks it). ``Port``
is a ``typing.Protocol``: the engine class (``_engine.engine.Engine``, which ``Store`` holds)
implements it, and mypy --strict checks that it does wherever an engine is passed as one, so
a signature here cannot drift from the method it names ("go to definition" on a use lands
here; the implementation is named in each entry's docstring).

The hot path stays as fast as a dataclass of bound methods: a part copies what its hot path
uses (arrays, bound methods) into its own slots once per handle, and append/commit/truncate
call the engine's methods with no layer in between.

This module holds the type only (no import of ``attachment`` or ``arena``: no circle).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from shmkv._engine.table.header import Layout
    from shmkv._engine.clients.row_waiters import RowWaiters
    from shmkv._engine.table.rows import Rows
    from shmkv._engine.spans.mappings import Shares
    from shmkv._engine.table.snapshot_rows import SnapshotRows

Arrays = list[np.ndarray]
Parts = list[tuple[int, int, int]]  # (src, dst, n) cell moves of Engine.rewrite

__all__ = ["Arrays", "Parts", "Port"]


class Port(Protocol):
    """What the sequence layer and ``_snapshot`` may use of one store's engine (see the module
    docstring). The lock each method needs is said where it is defined.

    Facts of the handle:
        name, layout, readonly: the store's name, its Layout, whether attached read-only.
        closed: close() has begun (handles then raise StoreClosedError).

    Arrays (the data segment; views, never copies):
        K, V: main-arena keys and values ``[layers, max_tokens, kv_heads, head_dim]``
            (encoder ranges are addressed in every layer here).
        KS, VS: int8 stores' float32 scales ``[layers, max_tokens, kv_heads]``, else None.
        Kl, Vl: writable per-layer arrays; a sliding/chunked layer's is its window region.
        Kr, Vr: read-only views of ``Kl``, ``Vl`` (what read handles return slices of).
        KSl, VSl: per-layer ``KS``, ``VS`` (None on float stores).
        tokens, positions: token ids and positions, one int64 per cell.

    Waiting (``_sequence/waiting.py``):
        waiters: per row, the threads of read-write processes sleeping in ``Sequence.wait``
            (int64 words; changed atomically at ``waiters_addr0 + 8 * slot``, no lock); a
            commit wakes the row when nonzero.
        ro_waiters: the same for read-only attachments' sleepers (``_engine/clients/row_waiters.py``:
            counts in the liveness file, changed atomically); a commit wakes on either.
        length_addr0: the address of row 0's LENGTH word in this process (a row's is
            ``length_addr0 + slot * 8 * SEQ_WORDS``): its low half is the futex word.
        waiting: this handle's own sleepers per row (``close()`` wakes them).

    Row words off the hot path:
        rows: the row words the sequence layer reads and writes outside its hot-path slots
            (ARCHITECTURE.md lists those), as named operations (``_engine/table/rows.py``: a lease
            given back, ``finish``'s flag, the encoder range, ``rewind``'s words ...).

    For ``_snapshot``:
        snapshot_rows: the row and header words a save captures and a restore publishes, as
            named operations (``_engine/table/snapshot_rows.py``; ``_snapshot`` names no word).
        lock_path: the store lock's file.
    """

    name: str
    layout: Layout
    here: list[int]  # this process's own (non-foreign) changes per row (_engine/locking/own_changes.py)
    readonly: bool
    closed: bool
    # arrays
    K: np.ndarray
    V: np.ndarray
    KS: np.ndarray | None
    VS: np.ndarray | None
    Kl: Arrays
    Vl: Arrays
    KSl: Arrays | None
    VSl: Arrays | None
    tokens: np.ndarray
    positions: np.ndarray

    @property
    def Kr(self) -> Arrays: ...

    @property
    def Vr(self) -> Arrays: ...

    # waiting
    waiters: memoryview
    waiters_addr0: int
    ro_waiters: RowWaiters
    length_addr0: int
    waiting: dict[int, int]
    # row words off the hot path (_sequence)
    rows: Rows
    # for _snapshot
    snapshot_rows: SnapshotRows
    lock_path: str
    # shared prefix pages: a reader re-maps (``shares.sync``) when the span epoch moved (_engine/spans/mappings.py)
    shares: Shares

    # -- the table, the locks, crash recovery (attachment.Attachment, journal.Journal) ------------------

    def row(self, slot: int) -> memoryview:
        """Row ``slot`` of the sequence table as int64 words (one memoryview a slot)."""
        ...

    def settled_row(self, slot: int) -> list[int]:
        """A row's words as a rollback would leave them (under ``reading``)."""
        ...

    def locked(self, scan: bool = False) -> AbstractContextManager[None]:
        """The one way into the store lock (recovers a dead holder's transaction; ``scan``:
        also repairs odd generations)."""
        ...

    def reading(self) -> AbstractContextManager[None]:
        """What a reader waiting out a change holds (``locked``, or a shared lock on a
        read-only attachment)."""
        ...

    def lock_owned(self) -> bool:
        """Whether the calling thread holds the store lock (its own transaction's rows are odd:
        it reads them as they are, under the lock, without spinning)."""
        ...

    def changing(self, row: memoryview) -> AbstractContextManager[None]:
        """A change of one row inside the open journaled transaction (lock held)."""
        ...

    def transaction(self) -> AbstractContextManager[None]:
        """A journaled transaction of several rows (committed together, rolled back together
        on an exception or after a crash)."""
        ...

    def new_incarnation(self, row: memoryview) -> None:
        """A row made live gets a new incarnation (changing)."""
        ...

    def check_not_leased_by_other(self, row: memoryview, seq_id: int, allow_token: int = 0) -> None:
        """LeaseError if a live holder other than us (or than ``allow_token``) has the lease."""
        ...

    def check_open(self) -> None:
        """StoreClosedError, as the API raises it."""
        ...

    def check_writable(self) -> None:
        """StoreClosedError / ReadOnlyError, as the API raises them."""
        ...

    def slot_of(self, seq_id: object) -> int:
        """The table row of a live sequence id (SequenceNotFound)."""
        ...

    # -- cells and rows (arena.Arena, engine.Engine; lock held unless said) -------------------

    def relocate(self, slot: int, row: memoryview, needed: int, keep: int, protect: int = -1) -> None:
        """Give a sequence at least ``needed`` cells, keeping its first ``keep`` (growth)."""
        ...

    def lent_end(self, slot: int) -> int:
        """The end of the cells a row lends, from its start; 0 when none (lock held;
        ``_engine/spans/lending.py``)."""
        ...

    def move_lender(self, slot: int, row: memoryview, keep: int) -> None:
        """A lender to a fresh range, keeping its first ``keep`` cells (lock held, row changing;
        CacheFullError, nothing changed, when no range is free: ``_engine/spans/lending.py``)."""
        ...

    def rewrite(self, slot: int, full: Parts, window: Parts, capacity: int | None = None,
                protect: int = -1) -> tuple[int, int]:
        """New content for a sequence where no row points (truncate, remove, ...)."""
        ...

    def set_encoder(self, parent: memoryview, n: int, start: int | None = None, slot: int | None = None) -> int:
        """A fresh encoder range for a sequence; ``copy_all_layers`` fills it."""
        ...

    def copy_all_layers(self, src: int, dst: int, n: int) -> None:
        """Copy n cells of every layer's main-arena K/V (and scales): encoder ranges."""
        ...

    def drop_encoder(self, parent: memoryview) -> None:
        """Free a sequence's encoder row."""
        ...

    def wcell(self, slot: int, wbuf: int) -> int:
        """First cell of a slot's window buffer 0 or 1 (no lock)."""
        ...

    def kv_bytes(self, layers: int) -> int:
        """Bytes of K and V (and scales) of one token in ``layers`` layers (no lock)."""
        ...

    def free_row(self, slot: int) -> None:
        """Free a sequence's row and cells."""
        ...

    def get_meta(self, slot: int) -> bytes:
        """A sequence's packed metadata (the caller checks the row's seqlock)."""
        ...

    def set_meta(self, slot: int, packed: bytes) -> None:
        """Write a sequence's packed metadata (row changing)."""
        ...

    def index_blocks(self, slot: int, upto: int, source: int = -1) -> None:
        """Put completed 16-token blocks into the prefix index."""
        ...

    def unindexing(self, slot: int, n: int) -> None:
        """Before a row keeps fewer blocks in the prefix index: rows its entries stood for get theirs."""
        ...

    def touch(self, row: memoryview) -> None:
        """Mark a use (LRU eviction of finished sequences)."""
        ...

    def alloc(self, capacity: int, taken: list[tuple[int, int]] | None = None, all_layers: bool = False,
              evict: bool = False, protect: int | tuple[int, ...] = -1, *, populate: bool = True,
              stage: bool = False, align: int = 1, fill: int | None = None, was: int = -1) -> int:
        """First-fit a range of cells (starting on a multiple of ``align``; a move from ``was``:
        see Arena.alloc) and reserve the pages of its first ``fill`` (default: all)."""
        ...

    def unit_for(self, cells: int, start: int) -> int:
        """What a range of ``cells`` that may lend its pages starts on where it can (Arena.unit_for;
        ``start`` 0 for a new range)."""
        ...

    def reserve_window(self, slot: int) -> None:
        """Reserve a slot's window buffers."""
        ...

    def restored(self, slot: int, finished: bool, clean: int, meta: bytes) -> None:
        """A restored row's prefix-cache state, recency and index entries."""
        ...

    # -- pages: writes into fresh cells (pages.Pages; no lock) -------------------------------

    @property
    def page_unit(self) -> int:
        """The fewest cells that fill whole pages in every per-layer array (header.Offsets.page_unit)."""
        ...

    def room(self, start: int, lo: int, hi: int) -> None:
        """Allocate and pre-fault the pages of cells [start + lo, start + hi) before appends
        write them (pages.Pages; CacheFullError when /dev/shm is full)."""
        ...

    def before_appends(self, start: int, count: int) -> None:
        """A write handle's first write other than extend: pre-fault what is owed of its range."""
        ...

    def write_new(self, start: int, length: int, cap: int, k_all: np.ndarray, v_all: np.ndarray) -> bool:
        """``Sequence.extend`` into fresh cells through the descriptor; False when that path
        does not apply (nothing written)."""
        ...

    def file_copier(self, dst: np.ndarray) -> Callable[[int, int, int, int], None]:
        """A restore's way to fill ``dst`` from a file in the kernel: ``copy(pos, fd, offset, n)``."""
        ...

    def settle(self, start: int, length: int, count: int) -> None:
        """A restore wrote cells [start, start + length) of a staged range of ``count`` cells."""
        ...
