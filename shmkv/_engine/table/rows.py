"""The row and header words the store layer (``store/``) sets and reads, as named operations: a
new sequence's id and row, a write lease taken over or given back, the prefix statistics, the
step of a fresh row's seqlock that sends its first write down the checked path, and typed
readers of what a store reports; and those the sequence layer (``_sequence``, through
``Port.rows``) reads and writes off its hot path (``finish``'s flag, the encoder range,
``rewind``'s words ...). Neither indexes a row or the header there: the column names stay in
``_engine`` (``header.py`` holds the layout), and so does the order of the words that a crash
point or a reader relies on.

Lock held, unless said; each write of a row's words is inside the caller's ``changing(row)``
(journaled: all of its words or none), as the operation's docstring says.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import NamedTuple

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.spans import mappings as share
from shmkv._engine.table.audit import span_problems
from shmkv._engine.table.header import (
    CAPACITY,
    CLEAN,
    ENC_SLOT,
    ENCODER,
    FINISHED,
    FLAGS,
    GEN,
    ID,
    IDX_BLOCKS,
    LEASE_CLIENT,
    LEASE_PID,
    LEASE_TOKEN,
    LENGTH,
    LENT,
    LIVE,
    NOINDEX,
    RECENCY,
    SPAN_CELLS,
    SPAN_PHYS,
    SPAN_TAKEN,
    START,
    STATE,
    W_CLOCK,
    W_EVICTIONS,
    W_SPANS,
    W_GENERATION,
    W_NEXT_ID,
    W_PAGE_MARK,
    W_PERSISTENT,
    W_PREFIX_HITS,
    W_PREFIX_MISSES,
    W_PREFIX_REUSED,
    W_UNDO_COUNT,
    W_UNDO_PID,
    WBUF,
    WIN_OFF,
    Layout,
    leads,
    with_leads,
)
from shmkv._engine.locking.journal import Journal
from shmkv._engine.prefixes.index import COVERS
from shmkv._engine.prefixes.hashes import BLOCK, lead_levels
from shmkv._engine.table.seqlock import HANDLE, seqlocked

__all__ = ["Counters", "Occupancy", "Rows", "SequenceRow", "TableRow"]

# SequenceRow's columns but the last (an array: numpy takes columns by one faster than by a list)
_LISTED = np.array([ID, LENGTH, CAPACITY, START, LEASE_PID, LEASE_CLIENT, GEN])


def live_slot(table: np.ndarray, seq_id: int) -> int:
    """The row of ``table`` (max_seqs x SEQ_WORDS) that holds live sequence ``seq_id``, -1 when
    none does (a scan: ``Engine.slot_of`` looks at the id's own row and a hint first)."""
    hits = np.flatnonzero((table[:, ID] == seq_id) & (table[:, STATE] == LIVE))
    return int(hits[0]) if hits.size else -1


class SequenceRow(NamedTuple):
    """A live sequence's row as ``store.sequences()`` lists it."""

    id: int
    length: int
    capacity: int
    start: int
    lease_pid: int
    lease_client: int
    generation: int
    finished: bool


class TableRow(NamedTuple):
    """A row of the sequence table as ``shmkv verify`` checks it."""

    kind: str  # "free", "live" (a sequence), "encoder" (a sequence's encoder cache), "unknown" (no such state)
    id: int
    start: int
    capacity: int
    length: int
    generation: int
    window_offset: int


_KINDS = {0: "free", LIVE: "live", ENCODER: "encoder"}


class Occupancy(NamedTuple):
    """The table's sums at one moment (``store.stats()``)."""

    sequences: int  # live rows
    tokens: int  # their committed tokens
    reserved: int  # their cells
    window_tokens: int  # tokens the bounded layers hold (0 without bounded layers)
    finished: int
    encoder_tokens: int
    encoder_cells: int


class Counters(NamedTuple):
    """The header's counters (``store.stats()``)."""

    generation: int
    prefix_hits: int
    prefix_misses: int
    prefix_tokens_reused: int
    evictions: int


class Rows:
    """The store layer's (and the sequence layer's, off its hot path) operations on row and header
    words, a part the engine holds (see the module docstring). No state of its own: the header,
    table, meta and client-table views, and the journal's and the pages' operations it calls."""

    def __init__(self, *, layout: Layout, hdr: memoryview, table_np: np.ndarray, meta: np.ndarray,
                 clients_np: np.ndarray, journal: Journal, any_owed: Callable[[int, int], bool],
                 page_unit: int) -> None:
        self.layout = layout
        self.hdr = hdr
        self.table_np = table_np
        self.meta = meta
        self.clients_np = clients_np
        self.journal = journal
        self._any_owed = any_owed
        self._page_unit = page_unit

    def touch(self, row: memoryview) -> None:
        """Mark a use of a sequence for LRU eviction: the recency clock's next value (lock held)."""
        clock = self.hdr[W_CLOCK] + 1
        self.hdr[W_CLOCK] = clock
        row[RECENCY] = clock

    # -- a new sequence --------------------------------------------------------------------

    def next_id_and_page_mark(self) -> tuple[int, int]:
        """(the next sequence id, the page mark) as a create reads them before it places its row:
        the id's row is where the search for a free row starts; a span at or above the mark has
        no pages to punch (``Sharing.borrow``)."""
        hdr = self.hdr
        return hdr[W_NEXT_ID], hdr[W_PAGE_MARK]

    def init_row(self, slot: int, row: memoryview, start: int, capacity: int, *, client: int, token: int) -> int:
        """Claim the next id of row ``slot`` and write the row of a new, empty sequence leased to
        (``client``, ``token``) of this process, its meta record empty and its recency fresh
        (row changing); return its id. The id is the next id of that row (ids skip the rows in
        use: a sequence lives in row ``id % max_seqs``) and is never reused: the next id moves
        past it at once, so a rolled-back create skips one."""
        hdr = self.hdr
        next_id = hdr[W_NEXT_ID]
        seq_id = next_id + (slot - next_id) % self.layout.max_seqs
        hdr[W_NEXT_ID] = seq_id + 1
        self.journal.new_incarnation(row)
        row[ID] = seq_id
        row[START] = start
        row[CAPACITY] = capacity
        row[LENGTH] = 0
        row[WIN_OFF] = 0
        row[WBUF] = 0
        row[ENC_SLOT] = 0
        _crash.point("create.row")
        row[FLAGS] = 0
        row[IDX_BLOCKS] = 0
        row[CLEAN] = -1
        row[SPAN_PHYS] = row[SPAN_CELLS] = row[SPAN_TAKEN] = 0
        self.journal.log_meta(slot)
        self.meta[slot, :8] = 0
        clock = hdr[W_CLOCK] + 1  # (touch, written out: one call less a create)
        hdr[W_CLOCK] = clock
        row[RECENCY] = clock
        row[LEASE_CLIENT] = client
        row[LEASE_TOKEN] = token
        row[LEASE_PID] = os.getpid()
        row[STATE] = LIVE
        return int(seq_id)

    def count_prefix(self, donor: int, n: int) -> None:
        """A create with a prompt reused ``n`` tokens of row ``donor`` (a hit: the donor's
        recency is fresh) or none (``n`` 0: a miss), in the header's statistics."""
        hdr = self.hdr
        if n:
            clock = hdr[W_CLOCK] + 1  # (touch of the donor's row, written out)
            hdr[W_CLOCK] = clock
            self.table_np[donor, RECENCY] = clock
            hdr[W_PREFIX_HITS] += 1
            hdr[W_PREFIX_REUSED] += n
        else:
            hdr[W_PREFIX_MISSES] += 1

    def owe_first_touch(self, row: memoryview) -> None:
        """A new row whose range is allocated but not pre-faulted (``Arena.new_row``): a step of
        its seqlock (after its handle was made) sends the handle's first write down its checked
        path, where a prefill (extend) writes through the descriptor and appends pre-fault the
        range first."""
        if self._any_owed(row[START], row[CAPACITY]):
            row[GEN] += 2

    # -- a write lease ---------------------------------------------------------------------

    def take_lease_words(self, row: memoryview, client: int, token: int) -> None:
        """The lease of ``row`` to (``client``, ``token``) of this process (row changing: a crash
        or an exception before the end puts back the old lease and the FINISHED flag); a
        finished sequence taken back (a chat's next turn) is no longer evictable and gets a
        fresh recency."""
        if row[FLAGS] & FINISHED:
            row[FLAGS] &= ~FINISHED
            self.touch(row)
        row[LEASE_CLIENT] = client
        row[LEASE_TOKEN] = token
        _crash.point("lease.taken")
        row[LEASE_PID] = os.getpid()

    def lease_token(self, row: memoryview) -> int:
        """The token of the handle that holds (or last held) ``row``'s lease."""
        return int(row[LEASE_TOKEN])

    def release_lease(self, row: memoryview) -> None:
        """Give ``row``'s lease back, as a handle's release() does (no lock needed: one word)."""
        row[LEASE_PID] = 0

    def release_own_lease(self, row: memoryview, token: int) -> None:
        """Give ``row``'s lease back if the handle ``token`` of this process holds it, as
        ``Sequence.release`` does (no lock needed: one word)."""
        if row[LEASE_TOKEN] == token and row[LEASE_PID] == os.getpid():
            row[LEASE_PID] = 0

    # -- a sequence's words off its hot path (``_sequence``) -------------------------------

    def mark_finished(self, row: memoryview) -> None:
        """``seq.finish()``'s words (row changing): the FINISHED flag (evictable, a cached
        prefix), then a fresh recency; the crash point ``finish.flagged`` between them."""
        row[FLAGS] |= FINISHED
        _crash.point("finish.flagged")
        self.touch(row)

    def encoder_range(self, words: memoryview | list[int],
                      words_of: Callable[[int], memoryview | list[int]]) -> tuple[int, int] | None:
        """(first cell, length) of the encoder range of the sequence whose row holds ``words``,
        its encoder's row read from ``words_of`` (``Port.row``; ``settled_row`` under ``reading``,
        ``words`` then its own settled words too: the caller reads them under the row's seqlock
        or the lock); None when it has none."""
        enc = words[ENC_SLOT]
        if not enc:
            return None
        e = words_of(enc - 1)
        return e[START], e[LENGTH]

    def encoder_seqlocked(self, row: memoryview, slot: int, row_of: Callable[[int], memoryview],
                          hold: Callable[[], AbstractContextManager[None]]) -> tuple[int, int] | None:
        """``encoder_range`` of ``row`` (row ``slot``; ``row_of``: ``Port.row``) read under its
        seqlock, a reader's way (``seq.encoder_kv``): a structural change running all along is
        waited out under ``hold`` and read as a rollback leaves it, never a silently empty result."""
        settled = self.journal.settled_row
        return seqlocked(row, GEN, lambda: self.encoder_range(row_of(slot), row_of), HANDLE,
                         lambda: self.encoder_range(settled(slot), settled), hold=hold)

    def settled_words(self, slot: int) -> tuple[int, int, int, int, int, int, int]:
        """(state, id, start, capacity, length, window offset, window buffer) of row ``slot`` as
        a rollback leaves it (under ``reading``: a reader's fallback, ``SeqReader.settled_words``)."""
        r = self.journal.settled_row(slot)
        return r[STATE], r[ID], r[START], r[CAPACITY], r[LENGTH], r[WIN_OFF], r[WBUF]

    def rewound(self, row: memoryview, n: int, window: tuple[int, int] | None) -> None:
        """``seq.rewind``'s row words (row changing): the length ``n``; with ``window`` (buffer,
        offset), the switch to the window written into that buffer first (WBUF, WIN_OFF, then
        the length), without it the crash point ``rewind.truncated`` after the length; a length
        of 0 holds no window offset."""
        if window is None:
            row[LENGTH] = n
            _crash.point("rewind.truncated")
        else:
            row[WBUF] = window[0]
            row[WIN_OFF] = window[1]
            row[LENGTH] = n
        if n == 0:
            row[WIN_OFF] = 0

    def switch_range(self, row: memoryview, start: int, wbuf: int, length: int, woff: int | None = None) -> None:
        """A structural operation's switch of ``row`` to the content it wrote where no row points
        (row changing; the crash point before it is the operation's): its range's first cell
        and window buffer, then its window offset (when given), then its length."""
        row[START], row[WBUF] = start, wbuf
        if woff is not None:
            row[WIN_OFF] = woff
        row[LENGTH] = length

    def mark_unfaithful_from(self, row: memoryview, n: int) -> None:
        """Tokens from ``n`` on are no faithful prefix computation any more (row changing):
        ``CLEAN`` at most ``n``, no index blocks or leads past it, no block from here on
        indexable (NOINDEX) until a truncate below it."""
        clean = row[CLEAN]
        row[CLEAN] = n if clean < 0 else min(clean, n)
        row[IDX_BLOCKS] = min(row[IDX_BLOCKS], n // BLOCK)
        row[FLAGS] = with_leads(row[FLAGS], min(leads(row[FLAGS]), lead_levels(n))) | NOINDEX

    def indexable_again(self, row: memoryview) -> None:
        """Ids given to tokens that had none (``set_tokens``, row changing): blocks from the
        row's indexed ones on may be indexable now (NOINDEX cleared)."""
        row[FLAGS] &= ~NOINDEX

    # -- readers ---------------------------------------------------------------------------

    def length(self, row: memoryview) -> int:
        """The committed length of ``row``'s sequence."""
        return int(row[LENGTH])

    def capacity(self, row: memoryview) -> int:
        """The cells of ``row``'s range."""
        return int(row[CAPACITY])

    def start(self, row: memoryview) -> int:
        """The first cell of ``row``'s range."""
        return int(row[START])

    def placement(self, row: memoryview) -> tuple[int, int, int]:
        """(first cell, capacity, window offset) of ``row``: what a write handle's addressing is
        worked out from (``SeqWriter.cache``)."""
        return row[START], row[CAPACITY], row[WIN_OFF]

    def lends(self, row: memoryview) -> bool:
        """Whether ``row`` is flagged LENT (it may lend cells to borrowers: ``_engine/spans/lending.py``)."""
        return bool(row[FLAGS] & LENT)

    def covers(self, row: memoryview) -> bool:
        """Whether ``row``'s prefix-index entries may stand for other holders (``prefix.COVERS``)."""
        return bool(row[FLAGS] & COVERS)

    def window(self, row: memoryview) -> tuple[int, int]:
        """(window offset, window buffer) of ``row``: the oldest token its sliding/chunked layers
        hold and which of its slot's two buffers holds them."""
        return row[WIN_OFF], row[WBUF]

    def generation(self, row: memoryview) -> int:
        """``row``'s seqlock generation (odd while a structural operation changes it)."""
        return int(row[GEN])

    def faithful(self, row: memoryview) -> int:
        """How many of ``row``'s leading tokens are a faithful computation from position 0 (what a
        prefix may reuse: ``mark_unfaithful_from``), -1 for all of them."""
        return int(row[CLEAN])

    def lease_pid(self, row: memoryview) -> int:
        """The pid holding ``row``'s write lease, 0 when none (for display: ``seq.lease_pid``)."""
        return int(row[LEASE_PID])

    def may_borrow_into(self, row: memoryview, n: int) -> bool:
        """Whether ``row`` may borrow a donor's first ``n`` cells as a reused prompt does (fork,
        regather): sharing is on, the row is empty, keeps no span's cells taken, lends nothing,
        holds ``n`` cells and starts on a page unit."""
        return bool(share.ENABLED and not row[LENGTH] and not row[SPAN_TAKEN] and not row[FLAGS] & LENT
                    and n <= row[CAPACITY] and not row[START] % self._page_unit)

    def client_rows(self) -> list[tuple[int, int]]:
        """(pid, client key) of each row of the client table that names a process (a pid and a
        key), in slot order; whether it is alive is the liveness file's to say (``Attachment.alive``)."""
        return [(pid, key) for pid, key, _flags, _ in self.clients_np.tolist() if pid and key > 0]

    def persistent(self) -> bool:
        """Whether the store outlives its creator's close (a header word set at create)."""
        return bool(self.hdr[W_PERSISTENT])

    def listed_sequences(self) -> list[SequenceRow]:
        """The live sequences' rows, in table order, as a listing reads them
        (``store.sequences()``): as they are; while a transaction is in the undo log, as its
        rollback leaves them (``_engine/locking/journal.py``, 7)."""
        j = self.journal
        make = partial(tuple.__new__, SequenceRow)  # (a C call a row: SequenceRow._make is a Python one)
        if self.hdr[W_UNDO_COUNT] and not j.depth:
            with j.reading():
                rows = [j.settled_row(slot) for slot in range(self.layout.max_seqs)]
            return [make((r[ID], r[LENGTH], r[CAPACITY], r[START], r[LEASE_PID], r[LEASE_CLIENT], r[GEN],
                          bool(r[FLAGS] & FINISHED)))
                    for r in rows if r[STATE] == LIVE]
        t = self.table_np
        # (one copy: the columns below are read from it, at one moment; taken by index, which
        # costs half what a boolean mask's indexing does over a table of thousands of rows)
        live = t[(t[:, STATE] == LIVE).nonzero()[0]]
        columns = live[:, _LISTED].T.tolist()
        finished = (live[:, FLAGS] & FINISHED != 0).tolist()
        return list(map(make, zip(*columns, finished, strict=True)))

    def occupancy(self) -> Occupancy:
        """The table's sums, read at one moment (no lock: a figure, not a decision)."""
        t = self.table_np
        live = t[t[:, STATE] == LIVE]
        encoders = t[t[:, STATE] == ENCODER]
        kept = int((live[:, LENGTH] - live[:, WIN_OFF]).sum()) if self.layout.bounded else 0
        return Occupancy(
            sequences=int(live.shape[0]), tokens=int(live[:, LENGTH].sum()), reserved=int(live[:, CAPACITY].sum()),
            window_tokens=kept, finished=int(((live[:, FLAGS] & FINISHED) != 0).sum()),
            encoder_tokens=int(encoders[:, LENGTH].sum()), encoder_cells=int(encoders[:, CAPACITY].sum()))

    def counters(self) -> Counters:
        """The header's counters: the store generation and the prefix and eviction statistics."""
        hdr = self.hdr
        return Counters(int(hdr[W_GENERATION]), int(hdr[W_PREFIX_HITS]), int(hdr[W_PREFIX_MISSES]),
                        int(hdr[W_PREFIX_REUSED]), int(hdr[W_EVICTIONS]))

    def table_rows(self, cells: int) -> tuple[list[TableRow], list[str]]:
        """Every row of the sequence table, in table order, and what its span words break of
        their rules at rest (``_engine/table/audit.py``), both from one copy of the table read
        without the lock (a check of what is there: ``shmkv verify``)."""
        table = self.table_np.tolist()  # (a copy: plain ints)
        spans = span_problems(table, int(self.hdr[W_SPANS]), self._page_unit, cells)
        return [TableRow(_KINDS.get(r[STATE], "unknown"), r[ID], r[START], r[CAPACITY], r[LENGTH], r[GEN], r[WIN_OFF])
                for r in table], spans

    def undo_log(self) -> tuple[int, int]:
        """(the rows the undo log holds, the pid of the process whose transaction logged them):
        (0, ...) when no transaction is open or left by a dead process."""
        hdr = self.hdr
        return int(hdr[W_UNDO_COUNT]), int(hdr[W_UNDO_PID])

    def next_id(self) -> int:
        """The next sequence id a create gives (every id given is below it)."""
        return int(self.hdr[W_NEXT_ID])
