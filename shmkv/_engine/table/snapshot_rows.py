"""The row and header words a snapshot reads and writes (``_snapshot``: save and restore), as
named operations: the rows a save captures (as a rollback would leave them, or seqlocked), the
undo log's count that sends a lock-free save under the lock, the span mappings a save brings
up to the rows, the free and live rows a restore places its sequences in, the words it
publishes and the next id it raises. ``_snapshot`` indexes no row or header word itself: the
column names stay in ``_engine`` (``header.py`` holds the layout).

A restore calls the writers inside its journaled transaction (``transaction()``, each row's
words inside ``changing(row)``: all of them or none), in the order it wrote them itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np

from shmkv._engine.table.header import (
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
    W_NEXT_ID,
    W_SPANS,
    W_UNDO_COUNT,
    WBUF,
    WIN_OFF,
)
from shmkv._engine.table.rows import live_slot
from shmkv._engine.table.seqlock import SAVE, seqlocked

if TYPE_CHECKING:
    from shmkv._engine.spans.mappings import Shares

T = TypeVar("T")

__all__ = ["SavedRow", "SnapshotRows"]


class SavedRow(NamedTuple):
    """A sequence's row as a snapshot saves it, and its encoder range's place."""

    id: int
    length: int
    capacity: int
    start: int
    generation: int
    window_offset: int
    encoder_length: int
    encoder_start: int
    finished: bool
    recency: int
    clean: int
    wbuf: int


def _saved(r: Sequence[int], erow: Sequence[int] | None) -> SavedRow:
    """What a save keeps of row words ``r`` (a row, or its settled copy), and of its encoder
    row's ``erow`` (None: it has none)."""
    e_start, e_len = (erow[START], erow[LENGTH]) if erow is not None else (0, 0)
    return SavedRow(r[ID], r[LENGTH], r[CAPACITY], r[START], r[GEN], r[WIN_OFF], e_len, e_start,
                    bool(r[FLAGS] & FINISHED), r[RECENCY], r[CLEAN], r[WBUF])


class SnapshotRows:
    """The snapshot's operations on row and header words, a part the engine holds (see the
    module docstring). No state of its own: the header and table views, ``row``, the span
    mappings, and the journal's ``reading`` and ``settled_row``."""

    def __init__(self, *, hdr: memoryview, table_np: np.ndarray, row: Callable[[int], memoryview],
                 shares: Shares, reading: Callable[[], AbstractContextManager[None]],
                 settled_row: Callable[[int], list[int]]) -> None:
        self.hdr = hdr
        self.table_np = table_np
        self.row = row
        self.shares = shares
        self.reading = reading
        self.settled_row = settled_row

    # -- saving ----------------------------------------------------------------------------

    def undo_pending(self) -> bool:
        """Whether the undo log holds rows (a transaction is open, or a dead one's is left):
        a lock-free save may have read some of them changing, and saves again under the lock."""
        return bool(self.hdr[W_UNDO_COUNT])

    def live_slots(self) -> list[int]:
        """The rows of live sequences, in table order, as they are now (no lock: the save reads
        each one seqlocked after)."""
        return [int(i) for i in np.flatnonzero(self.table_np[:, STATE] == LIVE)]

    def settled_rows(self) -> dict[int, SavedRow]:
        """Each live row (slot -> what a save keeps of it), as a rollback would leave it
        (``settled_row``: the store lock, or a read-only attachment's shared lock, held): a
        dead process's transaction is never captured. In table order."""
        rows = [self.settled_row(slot) for slot in range(len(self.table_np))]
        return {slot: _saved(r, rows[r[ENC_SLOT] - 1] if r[ENC_SLOT] else None)
                for slot, r in enumerate(rows) if r[STATE] == LIVE}

    def read_seqlocked(self, slot: int, read: Callable[[SavedRow], T],
                       busy: Callable[[], tuple[bool, T]]) -> tuple[bool, T]:
        """(whether row ``slot`` holds a live sequence, ``read`` of its words: what a save keeps,
        and what it reads beside them, tokens and meta), kept only if the row's generation was
        even and unchanged around it (``seqlock.SAVE``); ``busy()`` when it stays odd or moving.
        ``read`` may be given a torn row: it must not raise on one (the caller checks ``live``)."""
        row = self.row(slot)
        row_of = self.row

        def words() -> tuple[bool, T]:
            enc = row[ENC_SLOT]
            return row[STATE] == LIVE, read(_saved(row, row_of(enc - 1) if enc else None))

        return seqlocked(row, GEN, words, SAVE, busy)

    def unchanged(self, slot: int, seq_id: int, generation: int) -> bool:
        """Whether row ``slot`` still holds sequence ``seq_id`` at ``generation`` (no structural
        change since a save read it)."""
        row = self.row(slot)
        return bool(row[GEN] == generation and row[ID] == seq_id)

    def map_spans(self) -> None:
        """The shared prefix pages mapped here as the rows say (``Shares.sync`` when the span
        epoch moved since they were mapped)."""
        shares = self.shares
        if self.hdr[W_SPANS] != shares.applied:
            shares.sync(self.reading, self.settled_row)

    # -- restoring (lock held) ---------------------------------------------------------------

    def free_slots(self) -> list[int]:
        """The free rows, in table order."""
        return [int(i) for i in np.flatnonzero(self.table_np[:, STATE] == 0)]

    def live_slot_of(self, seq_id: int) -> int:
        """The row of live sequence ``seq_id``, -1 when there is none."""
        return live_slot(self.table_np, seq_id)

    def restore_buffer(self, row: memoryview, *, fresh: bool) -> int:
        """The window buffer a restored row's window goes into (row changing): a fresh row's
        buffer 0, a live row's other one (its own stays intact until ``publish`` switches the
        row to it, which also sets the word)."""
        return 0 if fresh else 1 - row[WBUF]

    def publish(self, row: memoryview, start: int, capacity: int, length: int, *, window_offset: int, wbuf: int,
                new_id: int | None) -> None:
        """Switch ``row`` to a restored sequence's range and window buffer (row changing); with
        ``new_id``, a fresh row made live as that sequence, unleased, with no encoder row."""
        row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF] = start, capacity, length, window_offset
        row[WBUF] = wbuf
        if new_id is not None:
            row[ID], row[LEASE_PID], row[ENC_SLOT] = new_id, 0, 0
            row[STATE] = LIVE

    def raise_next_id(self, past: int) -> None:
        """The next sequence id raised to at least ``past`` (inside the restore's transaction:
        after a crash its rows are back and no id it gave is reused; the next id itself is never
        rolled back, ``journal.py``)."""
        hdr = self.hdr
        hdr[W_NEXT_ID] = max(hdr[W_NEXT_ID], past)
