"""``Port``: the narrow core of a store, the one way the sequence layer and snapshots reach it.

``Sequence`` and its parts (``_seq_reader``, ``_seq_writer``, ``_seq_structural``) and
``_snapshot`` (save / restore) work on the shared-memory state of a store (its arrays, table
rows, locks and cell placing) through a ``Port`` and nothing else: they touch no underscore
attribute of ``Store``, ``Arena`` or ``Core`` (tests/test_architecture.py checks it).
``_arena.port(store)`` gives a store's port; the store builds it itself (``Arena._open_port``),
so a name added here never shows on the public ``shmkv.Store``.

Its fields are the store's own arrays and bound methods, not wrappers: a part copies what
its hot path uses into its own slots once, and append/commit/truncate call the store's
methods with no layer in between. The store holds its port weakly (``_arena.port``): the
handles keep it, and it is made again when none is left. Not frozen: its ``__init__`` is on
``store.sequence(id)``'s path then, and a frozen one costs twice as much (its fields are
never assigned after it). What each one does is said where it is defined
(``_core.Core``, ``_arena.Arena``); the lock a method needs is said there too.

This module holds the type only (no import of ``_core`` or ``_arena``: no circle).

The last group of fields is what ``_snapshot`` needs beyond the others; the sequence layer
does not use them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shmkv._engine.row_waiters import RowWaiters

Arrays = list[np.ndarray]
Parts = list[tuple[int, int, int]]  # (src, dst, n) cell moves of Arena._rewrite

__all__ = ["Arrays", "Port"]


class SetEncoder(Protocol):
    """``Arena._set_encoder``: a restore passes the range and row it staged."""

    def __call__(self, parent: memoryview, n: int, start: int | None = ..., slot: int | None = ...) -> int: ...


class CheckLease(Protocol):
    """``Core._check_not_leased_by_other``: a restore allows its own lease token."""

    def __call__(self, row: memoryview, seq_id: int, allow_token: int = ...) -> None: ...


@dataclass(slots=True, kw_only=True, weakref_slot=True)
class Port:
    """What the sequence layer and ``_snapshot`` may use of one store handle (see the module
    docstring).

    Arrays (the data segment; views, never copies):
        K, V: main-arena keys and values ``[layers, max_tokens, kv_heads, head_dim]``
            (encoder ranges are addressed in every layer here).
        KS, VS: int8 stores' float32 scales ``[layers, max_tokens, kv_heads]``, else None.
        Kl, Vl: writable per-layer arrays; a sliding/chunked layer's is its window region.
        Kr, Vr: read-only views of ``Kl``, ``Vl`` (what read handles return slices of).
        KSl, VSl: per-layer ``KS``, ``VS`` (None on float stores).
        tokens, positions: token ids and positions, one int64 per cell.

    The table, the locks and crash recovery (``_core.Core``):
        row: row ``slot`` of the sequence table as int64 words (one memoryview a slot).
        settled_row: a row's words as a rollback would leave them (under ``reading``).
        locked: the one way into the store lock (``_journal``: recovers a dead holder's
            transaction; ``locked(scan=True)`` also repairs odd generations).
        reading: what a reader waiting out a change holds (``locked``, or a shared lock
            on a read-only attachment).
        lock_owned: whether the calling thread holds the store lock (its own transaction's
            rows are odd: it reads them as they are, under the lock, without spinning).
        changing: a change of one row inside the open journaled transaction (lock held).
        transaction: a journaled transaction of several rows (committed together, rolled
            back together on an exception or after a crash).
        new_incarnation: a row made live gets a new incarnation (changing).
        check_not_leased_by_other: LeaseError if a live holder other than us has the lease.

    Cells and rows (``_arena.Arena``, lock held):
        relocate: give a sequence more cells, keeping its first ones (growth).
        rewrite: new content for a sequence where no row points (truncate, remove, ...).
        set_encoder: a fresh encoder range for a sequence; copy_all_layers fills it.
        wcell: first cell of a slot's window buffer 0 or 1.
        kv_bytes: bytes of K and V (and scales) of one token in n layers.
        free_row: free a sequence's row and cells.
        get_meta, set_meta: a sequence's packed metadata.
        index_blocks: put completed 16-token blocks into the prefix index.
        touch: mark a use (LRU eviction of finished sequences).

    Waiting (``_sequence/waiting.py``):
        waiters: per row, the threads of read-write processes sleeping in ``Sequence.wait``
            (int64 words; changed under ``locked``); a commit wakes the row when nonzero.
        ro_waiters: the same for read-only attachments' sleepers (``_engine/row_waiters.py``:
            counts in the liveness file, changed atomically); a commit wakes on either.
        length_addr0: the address of row 0's LENGTH word in this process (a row's is
            ``length_addr0 + slot * 8 * SEQ_WORDS``): its low half is the futex word.
        waiting: this handle's own sleepers per row (``close()`` wakes them).

    For ``_snapshot``:
        hdr: the fixed header as int64 words (``_header.W_*``: next id, undo count, ...).
        table_np: the sequence table as an int64 array ``[max_seqs, SEQ_WORDS]`` (a live view).
        lock_path: the store lock's file (a save takes it shared, a restore exclusively).
        check_open, check_writable: StoreClosedError / ReadOnlyError, as the API raises them.
        slot_of: the table row of a live sequence id (SequenceNotFound).
        alloc: first-fit a range of cells and reserve its pages (``Arena._alloc``'s keywords).
        reserve_window: reserve a slot's window buffers.
        drop_encoder: free a sequence's encoder row.
        restored: a restored row's prefix-cache state, recency and index entries.
    """

    # arrays
    K: np.ndarray
    V: np.ndarray
    KS: np.ndarray | None
    VS: np.ndarray | None
    Kl: Arrays
    Vl: Arrays
    Kr: Arrays
    Vr: Arrays
    KSl: Arrays | None
    VSl: Arrays | None
    tokens: np.ndarray
    positions: np.ndarray
    # the table, the locks, crash recovery
    row: Callable[[int], memoryview]
    settled_row: Callable[[int], list[int]]
    locked: Callable[..., AbstractContextManager[None]]
    reading: Callable[[], AbstractContextManager[None]]
    lock_owned: Callable[[], bool]
    changing: Callable[[memoryview], AbstractContextManager[None]]
    transaction: Callable[[], AbstractContextManager[None]]
    new_incarnation: Callable[[memoryview], None]
    check_not_leased_by_other: CheckLease
    # cells and rows
    relocate: Callable[[int, memoryview, int, int], None]
    rewrite: Callable[[int, Parts, Parts], tuple[int, int]]
    set_encoder: SetEncoder
    copy_all_layers: Callable[[int, int, int], None]
    wcell: Callable[[int, int], int]
    kv_bytes: Callable[[int], int]
    free_row: Callable[[int], None]
    get_meta: Callable[[int], bytes]
    set_meta: Callable[[int, bytes], None]
    index_blocks: Callable[[int, int], None]
    touch: Callable[[memoryview], None]
    # waiting
    waiters: memoryview
    ro_waiters: RowWaiters
    length_addr0: int
    waiting: dict[int, int]
    # for _snapshot (see the module docstring): what it needs beyond the fields above
    hdr: memoryview
    table_np: np.ndarray
    lock_path: str
    check_open: Callable[[], None]
    check_writable: Callable[[], None]
    slot_of: Callable[[object], int]
    alloc: Callable[..., int]  # (capacity, taken=None, *, all_layers=False, ...): keywords grow (issue 16)
    reserve_window: Callable[[int], None]
    drop_encoder: Callable[[memoryview], None]
    restored: Callable[[int, bool, int, bytes], None]
