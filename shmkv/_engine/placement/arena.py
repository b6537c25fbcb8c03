"""Where the cells of a store go: free ranges, allocation, eviction, the window
buffers of sliding/chunked layers, encoder ranges, and cell copies (all under the store lock).
Their pages (reservation, writes through the descriptor): ``_engine/memory/pages.py``."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.table import header as _header
from shmkv._engine.table.header import (
    CAPACITY,
    SPAN_PHYS,
    SPAN_TAKEN,
    ID,
    LEASE_PID,
    LENGTH,
    START,
    ENC_SLOT,
    ENCODER,
    LIVE,
    STATE,
    FINISHED,
    FLAGS,
    IDX_BLOCKS,
    NOINDEX,
    RECENCY,
    LEADS_MASK,
    STANDIN,
    Layout,
    Offsets,
    leads,
)
from shmkv._engine.memory.intervals import add_interval, take_interval
from shmkv._engine.prefixes.index import COVERS
from shmkv._engine.prefixes.hashes import LEAD, lead_levels
from shmkv.errors import CacheFullError
from shmkv._engine.placement.free_ranges import FreeRanges
from shmkv._engine.locking.journal import Journal
from shmkv._engine.memory.pages import Pages
from shmkv._engine.prefixes.index import PrefixIndex
from shmkv._engine.spans.lending import spans_taken


class Arena:
    """The cell-placing part of a store handle, held by the engine (see the module docstring).

    Its own state is this process's free-range cache (``_engine/placement/free_ranges.py``, kept current
    by the journal too). The rest it is given, and binds once (create and free are hot): the
    table and its rows, the prefix index, the journal's row changes, the pages part's
    reservations."""

    def __init__(self, *, name: str, layout: Layout, off: Offsets, hdr: memoryview, table_np: np.ndarray,
                 meta: np.ndarray, index: PrefixIndex, row: Callable[[int], memoryview],
                 lease_holder: Callable[[memoryview], tuple[int, bool]], free: FreeRanges, journal: Journal,
                 pages: Pages, lends: bool) -> None:
        self.name, self.layout, self._off, self.hdr, self.table_np = name, layout, off, hdr, table_np
        self._unit = off.page_unit if lends else 1  # (lends: the store shares prefix pages at all, Shares.on)
        self.meta, self.index, self.row, self._lease_holder = meta, index, row, lease_holder
        self._free, self._wc = free, layout.window_cells
        self.journal = journal
        self.changing, self.log_meta, self._forget = journal.changing, journal.log_meta, journal.forget
        self._reserve, self._stage, self.reserve_window = pages.reserve, pages.stage, pages.reserve_window
        self._page_unit_reserve = pages.page_unit_reserve

    def unit_for(self, cells: int, start: int) -> int:
        """What a range of ``cells`` that replaces the one at ``start`` starts on where it can:
        the page unit when the store lends pages, the range holds a unit or more and the one it
        replaces started on a unit (a range that may lend them, docs/design.md §11), else 1."""
        u = self._unit
        return u if cells >= u and not start % u else 1

    def free_tokens(self, gaps: list[tuple[int, int]]) -> int:
        """Cells new ranges may still take, of the free ranges ``gaps``: ``max_tokens`` less
        what the ranges and spans take (the arena's alignment slack is not for tokens)."""
        return sum(s for _, s in gaps) - (self._off.cells - self.layout.max_tokens)

    def _place(self, gaps: list[tuple[int, int]], capacity: int, align: int) -> int | None:
        """The first start, a multiple of ``align``, of ``capacity`` free cells in ``gaps``, or
        None when there is none or when ``max_tokens`` has no room for them (``free_tokens``)."""
        fit = _first_fit(gaps, capacity, align)
        need = capacity + self._off.cells - self.layout.max_tokens  # free cells, the slack included
        if fit is None or need == capacity:
            return fit  # (no slack: a free range of capacity cells is the room)
        free = 0
        for _, size in reversed(gaps):  # the last gap first: mostly the largest, often enough alone
            free += size
            if free >= need:
                return fit
        return None

    def _free_slot(self, what: str, evict: bool = False, protect: int = -1, near: int = 0) -> int:
        """A free row of the sequence table (lock held), or CacheFullError: the first at or
        after row ``near`` (wrapping around).

        ``evict``: evict finished sequences (least recently used first, never row ``protect``)
        when no row is free."""
        slot = self._first_free_row(near)
        if slot < 0 and evict and self._evict(0, 1, protect):
            slot = self._first_free_row(near)
        if slot < 0:
            raise CacheFullError(
                f"store {self.name!r} has no free slot for {what}: all max_seqs={self.layout.max_seqs} rows hold "
                "sequences or encoder caches; free some, or create the store with a larger max_seqs="
            )
        return slot

    def _first_free_row(self, near: int) -> int:
        """The first free row of the table at or after row ``near``, else the first free row,
        else -1 (lock held). Two vectorized passes at most (a comparison and the first match):
        ~2 us at 256 rows, ~4 us at 4096."""
        state = self.table_np[:, STATE]
        if not 0 < near < state.size:
            near = 0
        after = state[near:] == 0
        i = int(after.argmax())
        if after[i]:
            return near + i
        if near:
            before = state[:near] == 0
            i = int(before.argmax())
            if before[i]:
                return i
        return -1

    def free_ranges(self, taken: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """Gaps between the live ranges (and ``taken`` ones being staged by a restore), in order,
        as (start, size) (lock held).

        Kept per process while current (``_engine/placement/free_ranges.py``), so a create or free costs
        the same with 16 or 4096 sequences; derived again from the table after another process's
        change or a recovery: nothing recovery must rebuild is stored."""
        if taken:
            return self._derive_free_ranges(taken)
        gaps = self._free.cached(self.hdr)
        if gaps is None:
            gaps = self._derive_free_ranges()
            self._free.derived(self.hdr, gaps)
        return gaps

    def _derive_free_ranges(self, taken: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """The free ranges derived from the table (a sort of the live rows' starts, nearly sorted
        already: cheap), ~30 us at 4096 sequences."""
        t = self.table_np
        used = t[:, STATE] != 0
        starts, caps = t[:, START][used], t[:, CAPACITY][used]  # a column first: a cheaper gather
        taken = (taken or []) + spans_taken(t)  # a span's cells: taken while a row borrows them
        if taken:
            extra = np.asarray(taken, np.int64).reshape(-1, 2)
            starts, caps = np.concatenate([starts, extra[:, 0]]), np.concatenate([caps, extra[:, 1]])
        order = np.argsort(starts, kind="stable")
        starts = starts[order]
        # gap i lies between the end of range i - 1 (0 for the first) and the start of range i
        gap_starts = np.empty(starts.size + 1, np.int64)
        gap_starts[0] = 0
        np.add(starts, caps[order], out=gap_starts[1:])
        if starts.size > 1 and not (starts[1:] >= gap_starts[1:-1]).all():
            np.maximum.accumulate(gap_starts, out=gap_starts)  # ranges never overlap: stay safe if they did
        gap_ends = np.empty_like(gap_starts)
        gap_ends[:-1] = starts
        gap_ends[-1] = self._off.cells
        sizes = gap_ends - gap_starts
        keep = np.flatnonzero(sizes > 0)
        return list(zip(gap_starts[keep].tolist(), sizes[keep].tolist(), strict=True))

    def alloc(self, capacity: int, taken: list[tuple[int, int]] | None = None, all_layers: bool = False,
               evict: bool = False, protect: int | tuple[int, ...] = -1, *, populate: bool = True,
               stage: bool = False, align: int = 1, fill: int | None = None, was: int = -1) -> int:
        """First-fit a range of ``capacity`` cells (lock held); reserve the pages of its first
        ``fill`` cells (default: all; the rest as writes need them, pages.py).

        ``evict``: evict finished sequences (least recently used first, never row ``protect``,
        or the rows of a tuple) when no free range is large enough. ``populate``: see Pages.reserve;
        ``stage``: see Pages.stage. ``align``: the range starts on a multiple of it. ``was``: the
        start of the range this one replaces (a move): when that one starts on a page unit
        (``unit_for``), the new one does too if the free range first fit picks holds it there."""
        gaps = self.free_ranges(taken)
        fit = self._place(gaps, capacity, align)
        unit = self.unit_for(capacity, was) if was >= 0 else 1
        if fit is not None and unit > align:
            fit = _on_unit(gaps, fit, capacity, unit)
        if fit is None and evict and self._evict(capacity, 0, protect, align, taken):
            gaps = self.free_ranges(taken)
            fit = self._place(gaps, capacity, align)
        if fit is not None:
            held = capacity if fill is None else min(fill, capacity)
            if stage:
                self._stage(fit, held)
            else:
                self._reserve(fit, held, all_layers, populate)
            return fit
        raise CacheFullError(
            f"store {self.name!r} has no free range of {capacity} token cells "
            f"({max(0, self.free_tokens(gaps))} of max_tokens={self.layout.max_tokens} free, fragmented or used): "
            "free or truncate sequences, or create the store with a larger max_tokens="
        )

    def _evict(self, cells: int, rows: int, protect: int | tuple[int, ...] = -1, align: int = 1,
               taken: list[tuple[int, int]] | None = None) -> bool:
        """Evict the fewest least-recently-used finished sequences after which ``cells`` free cells
        starting on a multiple of ``align`` (and room for them under ``max_tokens``) and ``rows``
        free table rows exist (lock held): the first sequences in LRU order, up to the first after
        which the operation fits. Evicts nothing and returns False when evicting every finished
        sequence would not be enough (docs/design.md §8).

        The plan follows the free ranges: each sequence in turn frees its range, its encoder's
        and its span, but the cells that a row still kept holds too (a span inside a donor's
        range, a donor's range under its borrowers' span); cells taken otherwise stay taken."""
        t = self.table_np
        kept = (protect,) if isinstance(protect, int) else protect  # the operation's own rows
        cand = [int(i) for i in np.flatnonzero((t[:, STATE] == LIVE) & ((t[:, FLAGS] & FINISHED) != 0))
                if i not in kept and not self._lease_holder(self.row(int(i)))[1]]  # never a live lease
        if not cand:
            return False
        cand.sort(key=lambda i: int(t[i, RECENCY]))
        used = np.flatnonzero(t[:, STATE] != 0)
        free_rows = self.layout.max_seqs - used.size
        # the cells each row holds: its range, and a live row's span
        spans = used[(t[used, STATE] == LIVE) & (t[used, SPAN_TAKEN] > 0)]
        owner = np.concatenate([used, spans])
        lo = np.concatenate([t[used, START], t[spans, SPAN_PHYS]])
        hi = np.concatenate([t[used, START] + t[used, CAPACITY], t[spans, SPAN_PHYS] + t[spans, SPAN_TAKEN]])
        gone = np.zeros(self.layout.max_seqs, bool)
        gaps = self.free_ranges(taken)
        room = self.free_tokens(gaps)  # what max_tokens still holds
        placed = _first_fit(gaps, cells, align) is not None  # a range for them (gaps only grow below)
        free = [(a, a + n) for a, n in gaps]
        chosen: list[int] = []
        for i in cand:
            chosen.append(i)
            enc = int(t[i, ENC_SLOT]) - 1  # an evicted sequence frees its encoder row too
            for j in (i, enc) if enc >= 0 else (i,):
                gone[j] = True
                free_rows += 1
                for a, b in zip(lo[owner == j].tolist(), hi[owner == j].tolist(), strict=True):
                    piece = [(a, b)]
                    for k in np.flatnonzero((lo < b) & (hi > a) & ~gone[owner]).tolist():
                        take_interval(piece, int(lo[k]), int(hi[k]))  # still held by a kept row
                    for p, q in piece:
                        room -= sum(y - x for x, y in take_interval(free, p, q))  # (none: held cells)
                        add_interval(free, p, q)
                        room += q - p
                        x, y = free[bisect.bisect_right(free, (p, 1 << 62)) - 1]  # the gap it joined
                        placed = placed or -(-x // align) * align + cells <= y
            if free_rows >= rows and (not cells or (placed and room >= cells)):
                break
        else:
            return False
        for i in chosen:
            self.free_row(i)
            self.hdr[_header.W_EVICTIONS] += 1
        return True

    def free_row(self, slot: int) -> None:
        """Free a sequence's row and its encoder row (lock held). Its index entries become
        invalid by themselves (see ``_engine/prefixes/index.py``)."""
        row = self.row(slot)
        enc = row[ENC_SLOT] - 1
        lost = self.index.displaced_by(slot)
        if lost:  # holders its entries stood for get entries of their own first (a crash meanwhile:
            # it still holds the rest, still marked)
            self.hdr[_header.W_INDEX_USED] += self.index.rehome(lost, exclude=slot)
        with self.changing(row):
            self.drop_encoder(row)
            _crash.point("free.row")
            row[STATE] = 0
            row[LENGTH] = 0
            row[CAPACITY] = 0
            row[LEASE_PID] = 0
            row[ID] = 0
            row[FLAGS] = 0
            row[IDX_BLOCKS] = 0
            self.log_meta(slot)
            self.meta[slot, :8] = 0
        # complete: out of the undo log, so the unit's later use of its cells stays safe (rule 4)
        self._forget(slot, *([enc] if enc >= 0 else []))

    def index_blocks(self, slot: int, upto: int, source: int = -1) -> None:
        """Index the sequence's whole blocks up to token ``upto`` (lock held); set NOINDEX when a
        block cannot be (a token id -1, tokens moved by remove or shift_left). ``source``: the row
        its blocks [0, IDX_BLOCKS) and leads were just copied from, hashes included (copy_prefix):
        they get no entries of their own; the source's entries stand for them (STANDIN), and give
        them theirs when it stops holding them (``unindexing``, ``free_row``; see ``_engine/prefixes/index.py``)."""
        row = self.row(slot)
        hdr = self.hdr
        if source >= 0 and (row[IDX_BLOCKS] or row[FLAGS] & LEADS_MASK):
            src = self.row(source)
            if not src[FLAGS] & STANDIN:
                src[FLAGS] |= STANDIN  # (not logged: a rolled-back copy leaves a harmless mark)
        if self.index.full(hdr[_header.W_INDEX_USED] + max(0, upto // 16 - row[IDX_BLOCKS]) + len(LEAD)):
            hdr[_header.W_INDEX_USED] = self.index.rebuild()
        hdr[_header.W_INDEX_USED] += self.index.index_blocks(slot, upto)
        if row[IDX_BLOCKS] < upto // 16:
            row[FLAGS] |= NOINDEX

    def unindexing(self, slot: int, n: int) -> None:
        """Row ``slot`` is about to keep only its first ``n`` tokens' blocks and leads in the index,
        or none (``n`` 0: freed, rewritten) (lock held, before the row changes): the holders its
        lost entries stood for (COVERS) get entries of their own first."""
        row = self.row(slot)
        flags = row[FLAGS]
        if not flags & COVERS:
            return
        nb, lv = n // 16, lead_levels(n)
        if nb >= row[IDX_BLOCKS] and lv >= leads(flags):
            return
        lost = self.index.displaced_by(slot, nb, lv)
        if lost:
            self.hdr[_header.W_INDEX_USED] += self.index.rehome(lost, exclude=slot)

    def wcell(self, slot: int, wbuf: int) -> int:
        """First cell of window buffer ``wbuf`` (0 or 1) of ``slot`` in the bounded layers' arrays."""
        return (2 * slot + wbuf) * self._wc

    def set_encoder(self, parent: memoryview, n: int, start: int | None = None, slot: int | None = None) -> int:
        """Give the sequence on ``parent`` a fresh encoder row of ``n`` cells (lock held, parent
        changing); the old one is freed. ``start``: a range already reserved for it.
        Returns the new range's first cell."""
        # the new row and range first, then the old encoder goes: its cells are not reused here
        if slot is None:
            slot = self._free_slot("an encoder cache")
        if start is None:
            start = self.alloc(max(n, 1), all_layers=True)
        self.drop_encoder(parent)
        row = self.row(slot)
        with self.changing(row):
            row[ID], row[START], row[CAPACITY], row[LENGTH] = parent[ID], start, max(n, 1), n
            row[STATE] = ENCODER
        parent[ENC_SLOT] = slot + 1
        return start

    def drop_encoder(self, parent: memoryview) -> None:
        if parent[ENC_SLOT]:
            row = self.row(parent[ENC_SLOT] - 1)
            with self.changing(row):
                row[STATE] = 0
                row[LENGTH] = row[CAPACITY] = row[ID] = 0
            parent[ENC_SLOT] = 0

    def new_row(self, capacity: int, protect: int = -1, near: int = 0, align: int = 1,
                skip: int = 0, *, fill: int = 0) -> tuple[int, int]:
        """A free table row (the first at or after row ``near``) and a range for a new sequence
        (lock held), evicting finished sequences other than row ``protect`` when there is no
        room. ``align``: the range starts on a multiple of it (a page unit: a donor or a
        borrower of shared pages); ``fill``: the pages of its first cells are reserved now (what
        its creator writes), the rest as its writes need them (pages.py); ``skip``: its first
        cells' K/V pages are borrowed, not reserved."""
        slot = self._first_free_row(near)
        fit = self._place(self.free_ranges(), capacity, align)
        if slot < 0 or fit is None:
            # one plan for the row and the cells together: evict only if both then fit
            self._evict(capacity, 1, protect, align)
            fit = None  # the ranges changed: _alloc looks again (and names the shortfall)
            slot = self._free_slot("a new sequence", near=near)
        # allocated, not pre-faulted: a prefill (extend) writes it through the descriptor and
        # pre-faults the rest then (Pages.write_new); a first append pre-faults it all (before_appends)
        fill = max(min(fill, capacity), skip)
        if fit is None and skip:
            fit = self.alloc(capacity, populate=False, align=align, stage=True, fill=fill)  # (only checks the room)
            self._page_unit_reserve(fit, fill, skip)
        elif fit is None:
            fit = self.alloc(capacity, populate=False, align=align, fill=fill)
        elif skip:
            self._page_unit_reserve(fit, fill, skip)
        else:  # the free ranges were just scanned: no second scan on the create path
            self._reserve(fit, fill, populate=False)
        self.reserve_window(slot)
        return slot, fit


def fits(arena: Arena, capacity: int, align: int) -> bool:
    """Whether a free row and ``capacity`` free cells starting on a multiple of ``align`` (and
    room for them under ``max_tokens``) exist now, without evicting anything."""
    return arena._first_free_row(0) >= 0 and arena._place(arena.free_ranges(), capacity, align) is not None


def _on_unit(gaps: list[tuple[int, int]], fit: int, capacity: int, unit: int) -> int:
    """``fit`` moved up to a multiple of ``unit`` inside its own free range when ``capacity``
    cells fit there, else ``fit``: a range that may lend keeps to a unit where first fit puts
    it, never splitting a later free range (the cells before it stay free)."""
    for start, size in gaps:
        if start <= fit < start + size:
            on = -(-fit // unit) * unit
            return on if on + capacity <= start + size else fit
    return fit


def _first_fit(gaps: list[tuple[int, int]], capacity: int, align: int) -> int | None:
    """The first start, a multiple of ``align``, of ``capacity`` cells inside one of ``gaps``."""
    for start, size in gaps:
        a = -(-start // align) * align
        if a + capacity <= start + size:
            return a
    return None
