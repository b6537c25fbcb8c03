"""The engine a ``Store`` holds: ``Attachment`` (its one base: the mappings, the sequence table, clients,
leases, closing) and the parts it composes, wired in ``Engine.__init__``: ``journal``
(``Journal``: the one way into the lock, journaled transactions, crash recovery), ``pages``
(``Pages``: reservation, writes through the descriptor, cell copies), ``arena`` (``Arena``:
where cells go: free ranges, allocation, eviction, rows, encoder ranges), ``growth``
(``Growth``: a sequence's range grown in place, slid down or moved), ``spans``
(``Sharing``: shared prefix pages), ``rows`` (``Rows``: the row and header words the store
layer sets and reads, as named operations: ``store/`` indexes no row itself) and
``snapshot_rows`` (``SnapshotRows``: those a snapshot saves and restores). Each part is
given what it uses in its constructor; the one call up, the journal's ``settle_span`` at the
end of a change of a borrowing or lending row, is a hook passed in too. This class adds the
cell moves of a sequence (copy_prefix between rows, the fresh ranges
truncate/remove/shift_left rewrite into), all under the store lock and never over cells a row
points to (journal invariant 1), a sequence's meta record and recency, and binds the parts'
operations that the sequence layer, snapshots and the store use as its own attributes, once:
it implements ``port.Port`` with no call layer on the hot path.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.table import header as _header
from shmkv._engine.clients import liveness as _liveness
from shmkv._engine.memory import segment as _segment
from shmkv._engine.placement.arena import Arena
from shmkv._engine.placement.growth import Growth
from shmkv._engine.attachment import Closed, Attachment, release_views
from shmkv._engine.placement.free_ranges import FreeRanges
from shmkv._engine.table.header import (
    C_FLAGS,
    C_KEY,
    C_PID,
    LIVE,
    SEQ_WORDS,
    STATE,
    Layout,
    CAPACITY,
    CLEAN,
    FINISHED,
    FLAGS,
    ID,
    IDX_BLOCKS,
    LENGTH,
    LENT,
    NOINDEX,
    START,
    WBUF,
    WIN_OFF,
    leads,
    with_leads,
)
from shmkv._engine.locking.journal import Journal
from shmkv._engine.memory.pages import Pages
from shmkv._engine.prefixes.hashes import lead_levels
from shmkv._engine.table.rows import Rows, live_slot
from shmkv._engine.memory.segment import Segment
from shmkv._engine.table.seqlock import SMALL_TABLE
from shmkv._engine.spans.lending import Sharing
from shmkv._engine.table.snapshot_rows import SnapshotRows
from shmkv.errors import CorruptStoreError, InvalidArgumentError, NotSupportedError, SequenceNotFound

__all__ = ["Engine"]


# What an attach does not build, in two groups, each set in one statement at its first use
# (``Engine.__getattr__``): what a reader reads through (the data views of
# ``Attachment.data_views`` and the rows part: a read handle needs no more), and the other parts
# but the journal with their bound operations (what a writer, a structural operation or a prefix
# lookup uses; wired to the first group, so the first use of one builds both).
_READER = frozenset(("K", "V", "tokens", "positions", "_hashes", "meta", "index", "Kl", "Vl", "KS", "VS", "KSl",
                     "VSl", "rows", "touch"))
_PARTS = frozenset((
    "pages", "arena", "growth", "spans", "snapshot_rows",
    "room", "settle", "any_owed", "before_appends", "file_copier", "write_new", "reserve_window",
    "free_tokens", "free_ranges", "alloc", "new_row", "free_row", "wcell", "index_blocks", "unindexing",
    "set_encoder", "drop_encoder", "lend", "borrow", "lent_end", "move_lender",
    "shared_cells", "held_cells", "retained_cells", "committed_held", "relocate", "unit_for",
))
_LAZY = _READER | _PARTS


def _first_bad_client(rows: np.ndarray) -> int:
    """The first client row whose pid or key no process has (-1: none). A small table (the
    default's 128 rows) is cleared by min and max over two lists: no numpy ufunc to set up in a
    fresh process (tens of microseconds each, cold), the whole check a few microseconds."""
    pids, keys = rows[:, C_PID], rows[:, C_KEY]
    if len(rows) <= SMALL_TABLE:
        p = pids.tolist()
        if min(p) >= 0 and max(p) <= _segment.MAX_PID and min(keys.tolist()) >= 0:
            return -1
    bad = (pids < 0) | (pids > _segment.MAX_PID) | (keys < 0)  # (one pass, not a row a call)
    i = int(bad.argmax())  # (the first bad row, or row 0 when none is)
    return i if bad[i] else -1


class Engine(Attachment):
    """A store's engine (see the module docstring): this class adds the cell moves."""

    def __init__(self, name: str, hseg: Segment, dseg: Segment, layout: Layout, max_clients: int, *,
                 creator: bool, persistent: bool, lock_timeout: float,
                 live: _liveness.Liveness | None = None) -> None:
        super().__init__(name, hseg, dseg, layout, max_clients, creator=creator, persistent=persistent,
                         lock_timeout=lock_timeout, live=live)

        # Built now: what joining the store uses (the journal: the lock entry, the recovery check,
        # the span sync). The rest is built at its first use (``__getattr__``, ``_LAZY``), or at
        # the end here for the store's creator.
        self._free = free = FreeRanges()  # this process's free ranges: the placing part's, kept by the journal too
        self.journal = journal = Journal(
            readonly=self.readonly, lock_timeout=self.lock_timeout, layout=layout, hdr=self.hdr,
            table_np=self.table_np, undo_np=self._undo_np, undo=self._undo, meta_w=self._meta_w,
            meta_mv=self._meta_mv, lock=self._lock, row=self.row, row_slot=self._row_slot,
            slot_hint=self._slot_hint, here=self.here, free=free, waiters=self.waiters,
            ro_waiters=self.ro_waiters, length_addr0=self.length_addr0, shares=self.shares, record=self._rec,
            check_open=self.check_open, check_writable=self.check_writable, settle_span=self._settle_span)
        # What the sequence layer, snapshots and the store call, bound once: the same names as
        # before the parts, and no call layer on the hot path (a handle copies these).
        self.locked, self.reading, self.settled_row = journal.locked, journal.reading, journal.settled_row
        self.transaction, self.changing, self.log_meta = journal.transaction, journal.changing, journal.log_meta
        self.new_incarnation = journal.new_incarnation
        self.page_unit, self.cells = self._off.page_unit, self._off.cells
        if creator:  # about to make sequences: its first create_sequence does not build them
            self._build_parts()
            self.Kr, self.Vr  # noqa: B018  (nor the read-only views every handle reads through)

    def _settle_span(self, slot: int, row: memoryview, was: tuple[int, int, int], was_len: int) -> None:
        self.spans.settle_span(slot, row, was, was_len)  # the journal's one call up, to the sharing part

    def __getattr__(self, attr: str) -> Any:
        """An attribute not set yet: one of ``_READER`` builds what a reader reads through, one of
        ``_PARTS`` the other parts (on the reader's), once, and is returned; any other: AttributeError."""
        if attr not in _LAZY:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
        if self.__dict__.get("shut"):
            return Closed(self.name)  # (what release() leaves in place of the views)
        if attr in _READER:
            self._build_reader()
        else:
            self._build_parts()
        return object.__getattribute__(self, attr)

    def _build_reader(self) -> None:
        """What a reader reads through: the data views (``Attachment.data_views``) and the rows part,
        set in one statement with no call in it (a Ctrl-C leaves all or none: the next use builds them)."""
        v = self.data_views()
        rows = Rows(layout=self.layout, hdr=self.hdr, table_np=self.table_np, meta=v.meta, clients_np=self.clients_np,
                    journal=self.journal, any_owed=self._any_owed, page_unit=self._off.page_unit)
        (self.K, self.V, self.tokens, self.positions, self._hashes, self.meta, self.index, self.Kl, self.Vl,
         self.KS, self.VS, self.KSl, self.VSl, self.rows, self.touch) = (*v, rows, rows.touch)

    def _any_owed(self, start: int, capacity: int) -> bool:
        return self.any_owed(start, capacity)  # (the rows part's one call to the pages part, built at its first use)

    def _build_parts(self) -> None:
        """The parts a structural operation, a writer or a prefix lookup uses, wired to each
        other, to what a reader reads through (built first if need be: ``_build_reader``) and to the journal,
        and their operations bound as the engine's own: worked out into locals, then set in one
        statement with no call in it, so a Ctrl-C leaves all of them or none (the next use
        builds them again). Two threads that both find them missing may both build: the parts
        keep no state of their own but the sharing part's lent-end hint (``free``, the record
        and the journal are shared), so whichever set a caller holds works on the same rows and
        pages."""
        if "touch" not in self.__dict__:  # (set with all of the reader's, or none)
            self._build_reader()
        name, layout, off, t, journal, free = self.name, self.layout, self._off, self.table_np, self.journal, self._free
        dseg = self._dseg
        pages = Pages(
            layout=layout, off=off, dseg=dseg, hdr=self.hdr, record=self._rec, Kl=self.Kl, Vl=self.Vl,
            KS=self.KS, VS=self.VS, tokens=self.tokens, positions=self.positions, hashes=self._hashes,
            full=self._full, shares=self.shares, dbase=self._dbase)
        arena = Arena(
            name=name, layout=layout, off=off, hdr=self.hdr, table_np=t, meta=self.meta, index=self.index,
            row=self.row, lease_holder=self._lease_holder, free=free, journal=journal, pages=pages,
            lends=self.shares.on)
        spans = Sharing(
            name=name, off=off, hdr=self.hdr, table_np=t, row=self.row, dseg=dseg, shares=self.shares,
            free=free, journal=journal, pages=pages, alloc=arena.alloc)
        snapshot_rows = SnapshotRows(hdr=self.hdr, table_np=t, row=self.row, shares=self.shares,
                                     reading=journal.reading, settled_row=journal.settled_row)
        growth = Growth(name=name, layout=layout, arena=arena, pages=pages)
        (self.pages, self.arena, self.growth, self.spans, self.snapshot_rows, self.relocate, self.unit_for,
         self.room, self.settle, self.any_owed, self.before_appends,
         self.file_copier, self.write_new, self.reserve_window,
         self.free_tokens, self.free_ranges, self.alloc, self.new_row, self.free_row, self.wcell,
         self.index_blocks, self.unindexing, self.set_encoder, self.drop_encoder,
         self.lend, self.borrow, self.lent_end, self.move_lender,
         self.shared_cells, self.held_cells, self.retained_cells, self.committed_held) = (
            pages, arena, growth, spans, snapshot_rows, growth.relocate, arena.unit_for,
            pages.room, pages.settle, pages.any_owed, pages.before_appends,
            pages.file_copier, pages.write_new, pages.reserve_window,
            arena.free_tokens, arena.free_ranges, arena.alloc, arena.new_row, arena.free_row, arena.wcell,
            arena.index_blocks, arena.unindexing, arena.set_encoder, arena.drop_encoder,
            spans.lend, spans.borrow, spans.lent_end, spans.move_lender,
            spans.shared_cells, spans.held_cells, spans.retained_cells, spans.committed_held)

    def release(self) -> None:
        """Drop every reference the parts and this handle hold into the mappings (``Attachment.release``)."""
        for attr in ("journal", "pages", "arena", "growth", "spans", "rows", "snapshot_rows"):
            part = self.__dict__.get(attr)  # (a part never built holds nothing)
            # (a release cut short and run again: Attachment.release closed it)
            if part is not None and not isinstance(part, Closed):
                release_views(part, self.name)
        super().release()

    # -- clients ---------------------------------------------------------------

    def join(self) -> None:
        """What a read-write attachment (the creator's too) does to join the store, each step
        once, in one hold of the store lock: 1. the recovery check (a dead holder's transaction
        rolled back, odd generations made even: a cold entry scans every row); 2. the span sync
        (the table's shared prefix pages mapped here); 3. the client table's check; 4. the
        liveness registration (the first free byte of the liveness file locked, a key drawn,
        the slot's client row written). 1 and 2 are the lock entry's (``locked(scan=True)``)."""
        with self.locked(scan=True):  # 1, 2
            i = _first_bad_client(self.clients_np)
            if i >= 0:
                rows = self.clients_np
                pid, key = int(rows[i, C_PID]), int(rows[i, C_KEY])
                raise CorruptStoreError(
                    f"store {self.name!r}: client table row {i} holds pid {pid}, key {key}, "
                    "which no process has: the header was overwritten by something other than shmkv; "
                    f"check it with `shmkv verify {self.name}`, save what you need and create the store anew"
                )
            self._fill_client_row()  # 4

    def _fill_client_row(self) -> None:
        live = self._live
        key = live.key or live.register(self._max_clients)
        row = self.clients_np[_liveness.slot_of(key)]
        row[C_KEY] = key
        row[C_FLAGS] = 1
        row[C_PID] = live.pid  # (as it registered) for display only: no meaning in another PID namespace

    def client_key(self) -> int:
        """This attachment's client key, for a lease; a forked child registers a slot of its own
        first (the parent's descriptor was dropped at fork, see liveness)."""
        live = self._live
        if live.key and live.pid == os.getpid():
            return live.key
        with self.locked():
            live.reopen_in_child()
            if not live.key:
                self._fill_client_row()
        return live.key

    # -- the sequence table ----------------------------------------------------

    def slot_of(self, seq_id: object) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise InvalidArgumentError(f"sequence id {seq_id!r} must be an int (Sequence.id)")
        seq_id = int(seq_id)
        # A created sequence lives in row id % max_seqs (Store.create_sequence picks its id so);
        # one a restore placed elsewhere is found once by a scan, then by a hint: ids are never
        # reused, so a remembered slot is right exactly when its row still holds that id, live.
        own = seq_id % self.layout.max_seqs
        b = own * SEQ_WORDS
        if self._table[b + ID] == seq_id and self._table[b + STATE] == LIVE:
            return own
        slot = self._slot_hint.get(seq_id)
        if slot is not None:
            b = slot * SEQ_WORDS
            if self._table[b + ID] == seq_id and self._table[b + STATE] == LIVE:
                return slot
        found = live_slot(self.table_np, seq_id)
        if found >= 0:
            if len(self._slot_hint) > 4 * self.layout.max_seqs:
                self._slot_hint.clear()
            self._slot_hint[seq_id] = found
        if found < 0 and self.hdr[_header.W_UNDO_COUNT] and not self.journal.depth:
            # a transaction is in the undo log (a dead writer's, or a live one's): look at the
            # rows as its rollback would leave them (``_engine/locking/journal.py``, invariant 7)
            with self.reading():
                for slot in range(self.layout.max_seqs):
                    w = self.settled_row(slot)
                    if w[ID] == seq_id and w[STATE] == LIVE:
                        return slot
        if found < 0:
            raise SequenceNotFound(
                f"store {self.name!r} has no sequence {seq_id!r}: it was freed or never created "
                "(store.sequences() lists the live ones)"
            )
        return found

    # -- a sequence's meta record, recency and restore bookkeeping (lock held) ----------------

    def set_meta(self, slot: int, packed: bytes) -> None:
        """Write a sequence's packed metadata (lock held, row changing)."""
        self.log_meta(slot)
        rec = self.meta[slot]
        rec[8 : 8 + len(packed)] = np.frombuffer(packed, np.uint8)
        rec[:8] = np.frombuffer(len(packed).to_bytes(8, "little"), np.uint8)

    def get_meta(self, slot: int) -> bytes:
        """A sequence's packed metadata, as stored (the caller checks the row's seqlock); while
        another process's transaction logged it, as its rollback leaves it (``_engine/locking/journal.py``, 7)."""
        j = self.journal
        rec = j.settled_meta(slot) if self.hdr[_header.W_UNDO_COUNT] and not j.depth else self.meta[slot]
        n = int.from_bytes(rec[:8].tobytes(), "little")
        return bytes(rec[8 : 8 + min(n, _header.META_BYTES)].tobytes())

    def restored(self, slot: int, finished: bool, clean: int, meta: bytes) -> None:
        """A sequence a snapshot restore just published (lock held; called oldest use first):
        its prefix-cache state, a fresh recency, and its blocks in the index."""
        row = self.row(slot)
        # finished (evictable) only while nobody holds its lease: a restore over a sequence this
        # process writes keeps it the writer's
        row[FLAGS] = FINISHED if finished and not self._lease_holder(row)[1] else 0
        row[CLEAN] = clean
        row[IDX_BLOCKS] = 0
        with self.changing(row):
            self.set_meta(slot, meta)
        self.touch(row)
        self.index_blocks(slot, row[LENGTH])

    def copy_all_layers(self, src: int, dst: int, n: int) -> None:
        """Copy n cells of every layer's main-arena K/V (and scales): encoder ranges."""
        for arr in (self.K, self.V, self.KS, self.VS):
            if arr is not None and n:
                for layer in range(self.layout.layers):
                    np.copyto(arr[layer, dst : dst + n], arr[layer, src : src + n])

    def _copy_window(self, a: int, b: int, n: int) -> None:
        """Copy n cells from cell a to cell b of every bounded layer's window array."""
        if n <= 0 or a == b:
            return
        for layer in self.layout.bounded:
            for arr in (self.Kl[layer], self.Vl[layer]):
                np.copyto(arr[b : b + n], arr[a : a + n])

    def rewrite(self, slot: int, full: list[tuple[int, int, int]], window: list[tuple[int, int, int]],
                 capacity: int | None = None, protect: int = -1) -> tuple[int, int]:
        """New content for a sequence, written where no row points (crash recovery, rule 1):
        ``full`` parts (src token, dst token, n) into a fresh range of ``capacity`` cells (default:
        the same), ``window`` parts (src, dst, n) as offsets into the slot's active and other window
        buffers. Returns (new start, new WBUF) for the caller to switch the row to (lock held)."""
        row = self.row(slot)
        start, wb = row[START], row[WBUF]
        cap = row[CAPACITY] if capacity is None else capacity
        new_start = self.alloc(cap, evict=True, protect=protect, populate=False, was=start,
                               fill=max((dst + n for _, dst, n in full), default=0))  # pages for what it copies
        for src, dst, n in full:
            self.pages.copy_cells(start + src, new_start + dst, n)
        self.pages.fill(new_start, cap)
        a0, b0 = self.wcell(slot, wb), self.wcell(slot, 1 - wb)
        for src, dst, n in window:
            self._copy_window(a0 + src, b0 + dst, n)
        return new_start, 1 - wb

    def copy_prefix_rows(self, s_slot: int, d_slot: int, n: int, *, held: bool = False, share: int = 0,
                         reserved: bool = False) -> None:
        """copy_prefix between rows (lock held, ids checked): dst's content becomes src's first
        n tokens, and dst's whole blocks join the prefix index.

        Sliding/chunked layers: ``held=False`` (a reused prefix) copies only what a next token
        needs (``keep`` tokens); ``held=True`` (``Store.copy_prefix``, so ``fork`` and
        ``regather``) every token src holds below n, so a copy of a whole sequence holds exactly
        what src holds on every layer (a batch of copies stays one ``[B, T]`` batch, and a crop
        the source could take, the copy can take too: tests/test_rewind.py, and beam search on
        sliding models in tests/test_transformers_windows.py). ``reserved``: the pages of dst's
        first n cells are (``new_row(fill=n, skip=share)`` on the create path)."""
        s_row, d_row = self.row(s_slot), self.row(d_slot)
        s_off = s_row[WIN_OFF]
        need = self.layout.resume_from(n)  # the oldest token a next token needs on bounded layers
        if self.layout.bounded and n and s_off > need:  # (a prefix of 0 tokens needs none)
            raise NotSupportedError(
                f"copy_prefix: the sliding/chunked layers of sequence {s_row[ID]} hold tokens {s_off}.. only; "
                f"a prefix of n={n} needs tokens from {need} on"
            )
        # what the next tokens need (or, held=True, everything), from what src holds
        lo = min(s_off if held else max(s_off, n - self.layout.keep, 0), n)  # (n = 0: nothing, from 0)
        src_win = self.wcell(s_slot, s_row[WBUF]) + lo - s_off
        with self.changing(d_row):
            if d_row[LENGTH] == 0 and n <= d_row[CAPACITY] and not d_row[FLAGS] & LENT:
                # dst holds nothing committed: its own cells and window buffer are free to write
                # (their pages allocated first: a range has them only as its writes need them),
                # unless it lends cells it no longer holds (_engine/spans/lending.py)
                if not reserved:
                    self.pages.page_unit_reserve(d_row[START], n, share)
                self.pages.copy_cells(s_row[START], d_row[START], n, kv_from=share)  # share: borrowed (_borrow)
                self._copy_window(src_win, self.wcell(d_slot, d_row[WBUF]), n - lo)
                _crash.point("copy_prefix.copied")
            else:  # never over dst's committed cells: a fresh range and dst's other window buffer
                self.unindexing(d_slot, 0)  # its content goes: rows its entries stood for get theirs
                # never evict the operation's own rows (a finished, unleased src or dst is a candidate)
                new_start = self.alloc(max(n, d_row[CAPACITY]), evict=True, protect=(s_slot, d_slot),
                                        populate=False, fill=n, was=d_row[START])
                self.pages.copy_cells(s_row[START], new_start, n)
                self.pages.fill(new_start, max(n, d_row[CAPACITY]))
                wb = 1 - d_row[WBUF]
                self._copy_window(src_win, self.wcell(d_slot, wb), n - lo)
                _crash.point("copy_prefix.copied")
                d_row[START], d_row[CAPACITY], d_row[WBUF] = new_start, max(n, d_row[CAPACITY]), wb
            d_row[WIN_OFF] = lo if self.layout.bounded else 0
            d_row[LENGTH] = n
            clean = s_row[CLEAN]
            d_row[CLEAN] = -1 if clean < 0 or clean >= n else clean
            # the copied hashes are valid for src's indexed blocks: dst's entries start from them
            d_row[IDX_BLOCKS] = min(s_row[IDX_BLOCKS], n // 16)
            d_row[FLAGS] = with_leads(d_row[FLAGS], min(leads(s_row[FLAGS]), lead_levels(n))) & ~NOINDEX
            self.index_blocks(d_slot, n, source=s_slot)  # src's entries stand for dst's copied blocks
