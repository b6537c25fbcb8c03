"""Shared prefix pages, the table side (docs/design.md §11; the mappings: ``_engine/spans/mappings.py``).

A reuse of a cached prefix (``create_sequence(prefix=)``) borrows the donor's first ``m`` cells
(``m`` a multiple of the page unit) instead of copying them: ``lend`` plans it, ``borrow``
records the span in the new row (a journaled change) and maps it (or, when this process cannot
map it, out of ``vm.max_map_count``, copies it instead, in the same transaction: a process at
its map limit gets a plain copy, never a ShareError it can avoid). ``settle_span`` runs at the
end of every change of a row that borrows or lends (``Journal._Change``) and keeps shared cells
unwritten:

* a borrower freed, or whose range moved (growth, remove, shift_left, copy_prefix into it,
  restore: each wrote a private copy), drops its span (its last borrower gone, a span's cells
  are free: nothing else holds them, the free ranges are derived from the table);
* a borrower whose length fell below its span (truncate, clear, rewind) keeps the whole pages
  below its length and gets private copies of the rest (copy-on-write) before it writes again.
  The span's cells under the committed cells it copied stay taken (``SPAN_TAKEN``: the whole
  page units below its length, a row word) until it is freed or moves: another attachment may
  still map the span there until its next read, and a view it holds of those committed cells
  keeps showing them (docs/stores.md, what invalidates a view). Only cells past the new
  length are given up; a later truncate gives up those past its length the same way;
* a donor whose length fell below cells it lent moves to a fresh range (its appends would
  otherwise write over them). With no free range (a full store) it stays where it is, lending
  cells it no longer holds: its write handle's room stops at its length, and its next write
  there moves it first (``move_lender``; CacheFullError while no range is free, nothing
  written). Its borrowers are never changed by it: another attachment may hold views of a
  borrower's span, mapped on the donor's pages until it next maps the table, so those cells
  must stay as they are while anyone borrows them or keeps them taken (what it lent: the
  most any row keeps taken, ``_lent_from``).

A borrower's span and its donor's flag, as the journal states its objects (each arrow a
journaled change of the row, ``settle_span`` at its end)::

    borrower  no span --create_sequence(prefix=), fork, copy_prefix into an empty row (borrow)-->
                         mapping m cells: SPAN_CELLS = SPAN_TAKEN = m at SPAN_PHYS
              mapping --truncate / clear / rewind below m (_unshare: copy-on-write)--> mapping
                         the whole units below its length, keeping taken those under its
                         committed cells (SPAN_TAKEN >= SPAN_CELLS; 0 mapped: taken only)
              mapping, taken --a later truncate (_give_up_past)--> taking fewer
              mapping, taken --freed, or its range moved (growth, remove, shift_left,
                         copy_prefix into it, restore)--> no span: its cells free, views void
    donor     own --a borrow of its cells--> LENT
              LENT --its change ends with nobody borrowing from its start, or it moved or was
                     freed--> own
              LENT, length below what it lent --its truncate: moves to a fresh range
                     (_move_lender), or stays while no range is free and moves before its next
                     write there (``_sequence/room.py``)--> own, elsewhere
              (a freed donor's lent cells stay taken by the spans until their last borrower goes)

``_engine/table/audit.py`` states what these words promise at rest, and ``shmkv verify`` checks it.

What a span keeps taken is bounded by what it borrowed: ``SPAN_CELLS <= SPAN_TAKEN <=`` the
cells it borrowed, rounded to page units below its length; ``stats().retained_cells`` counts
the cells taken only that way (no range, no mapped span holds them).

Crash points: ``share.borrowed``, ``share.unshared``, ``share.released``, ``share.moved``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.table import header as _header
from shmkv._engine.table.header import (CAPACITY, FINISHED, FLAGS, ID, LENGTH, LENT, LIVE, SPAN_CELLS, SPAN_PHYS,
                                        SPAN_TAKEN, START, STATE)
from shmkv._engine.placement.free_ranges import FreeRanges, mark_pages
from shmkv._engine.table.header import Offsets
from shmkv._engine.locking.journal import Journal
from shmkv._engine.memory.pages import Pages
from shmkv._engine.memory.segment import Segment
from shmkv._engine.spans.mappings import Shares, max_borrowers
from shmkv.errors import CacheFullError, ShareError


class Sharing:
    """The span-keeping part of a store handle, a part the engine holds (see the module
    docstring; lock held throughout). Its own state is one per-process hint (``_lent_seen``);
    it changes rows through the journal, writes private copies through the pages part, and
    takes fresh ranges for a lender that moves through ``alloc``, the placing part's."""

    def __init__(self, *, name: str, off: Offsets, hdr: memoryview, table_np: np.ndarray,
                 row: Callable[[int], memoryview], dseg: Segment, shares: Shares, free: FreeRanges,
                 journal: Journal, pages: Pages, alloc: Callable[..., int]) -> None:
        self.name, self._off, self.hdr, self.table_np, self.row = name, off, hdr, table_np, row
        self._dseg, self.shares, self._free = dseg, shares, free
        self.journal, self.pages, self.alloc = journal, pages, alloc
        self.changing, self._spans_odd = journal.changing, journal.spans_odd
        self._lent_seen: tuple[int, int, int] = (-1, -1, 0)  # (span epoch, start, lent end): _lent_from

    def lend(self, donor: int, n: int) -> tuple[int, int, int]:
        """(physical first cell, cells, owner row or -1) a reuse of ``n`` tokens of row ``donor``
        may borrow; cells 0 when it must copy (too short, unaligned, no full layer, too many
        borrowers for vm.max_map_count). Chains resolve to the physical cells."""
        u = self._off.page_unit
        pieces = self.shares.pieces
        if not pieces or n < u:
            return 0, 0, -1
        d = self.row(donor)
        if d[SPAN_CELLS]:
            phys, have = d[SPAN_PHYS], d[SPAN_CELLS]
        else:
            phys, have = d[START], d[LENGTH]
        m = min(n, have) // u * u
        t = self.table_np
        if not m or phys % u or int((t[:, SPAN_CELLS] > 0).sum()) >= max_borrowers(len(pieces)):
            return 0, 0, -1
        if not d[SPAN_CELLS]:
            owner = donor
        else:
            found = np.flatnonzero((t[:, STATE] == LIVE) & (t[:, START] == phys) & (t[:, SPAN_CELLS] == 0))
            owner = int(found[0]) if found.size else -1
        if owner >= 0:
            o = self.row(owner)
            if not o[FLAGS] & FINISHED:
                # A live (leased, decoding) owner may still roll back: never lend its last page
                # unit, so a speculative truncate by less than a unit never moves it.
                m = min(m, max(0, o[LENGTH] - u) // u * u)
                if not m:
                    return 0, 0, -1
        return phys, m, owner

    def borrow(self, slot: int, phys: int, m: int, owner: int, *, mark: int | None = None) -> bool:
        """Make row ``slot`` (just created, its cells from ``m`` on copied from its donor)
        borrow cells [phys, phys + m): punch its own pages there, record the span, map it.
        ``mark``: the page mark (``free_ranges.mark_pages``) as it was before the row got its
        range; a span at or above it has no pages of its own to punch.

        If this process cannot map the span (the kernel refuses: ``vm.max_map_count``), the
        borrow is undone and the physical cells [phys, phys + m) are copied instead, in the same
        transaction: returns False (the row borrows nothing). They are an owner's own cells, never
        a span, so they are readable here even when the donor is a borrower this process could not
        map either. ShareError only when the refused mapping cannot be undone
        here: the transaction then rolls back (tests/test_sharing_map_limits.py)."""
        row = self.row(slot)
        hdr = self.hdr
        allocs = hdr[_header.W_ALLOCS]
        current = self._free.tag == allocs  # this process's free ranges (_engine/placement/free_ranges.py)
        with self.changing(row):
            self._spans_odd()  # before the words change: every process re-maps after this transaction
            start = row[START]
            self.shares.punch(start, m, holes=mark is not None and start >= mark)
            row[SPAN_PHYS] = phys
            row[SPAN_CELLS] = row[SPAN_TAKEN] = m
            _crash.point("share.borrowed")
            try:
                self.shares.set(slot, (start, phys, m))
            except ShareError:
                if not self.shares.drop_refused(slot):
                    raise  # its cells here may show the donor's pages: no copy into them
                row[SPAN_PHYS] = row[SPAN_CELLS] = row[SPAN_TAKEN] = 0
                self._copy_span(start, phys, m)
                return False
        if owner >= 0:
            o = self.row(owner)
            if not o[FLAGS] & LENT:
                with self.changing(o, foreign=True):  # a decoding owner commits meanwhile (journal 10)
                    o[FLAGS] |= LENT
        if current and hdr[_header.W_ALLOCS] == allocs + 1:
            # The span lies inside its owner's range or inside the span it borrows on (``lend``),
            # cells taken already: the free ranges are what they were. The epoch step above made
            # them stale (and ``settle_span``); with nothing else changed (one step of the
            # counter: any range or span change steps it), they stay current here, so the next
            # create does not derive them again from the table.
            self._free.tag = allocs + 1
        return True

    def _copy_span(self, start: int, src: int, m: int) -> None:
        """A span this process could not map (``borrow``), copied instead: K, V and int8 scales
        of cells [src, src + m) (the span's physical cells) into cells [start, start + m) (token
        ids, positions and hashes are copied already), their pages allocated first (punched out,
        or never reserved: a full /dev/shm is CacheFullError) and written through the descriptor."""
        shares = self.shares
        pieces = shares.pieces
        mark_pages(self.hdr, start + m)  # (inside its range: marked already)
        self._dseg.reserve([(off + start * cb, m * cb) for off, cb in pieces], populate=False)
        raw = shares.anchor
        for off, cb in pieces:
            self._dseg.write(off + start * cb, memoryview(raw[off + src * cb : off + (src + m) * cb]))  # type: ignore[arg-type]  # a buffer

    def settle_span(self, slot: int, row: memoryview, was: tuple[int, int, int], was_len: int) -> None:
        """The end of a change of a row that borrows or lends (see the module docstring;
        ``was``: its (state, start, capacity) and ``was_len`` its length before the change). A
        lender moves off its loans only in the change that took its length below them (its
        truncate, clear, rewind): one that stayed below them in a full store moves at its next
        write (``_sequence/room.py`` leave_loans), never inside another change of its row (its
        meta, set_tokens, set_encoder: their handles keep the range's addressing, and such a
        change never evicts)."""
        m = row[SPAN_CELLS]
        if row[SPAN_TAKEN] and (row[STATE] != LIVE or row[START] != was[1]):
            row[SPAN_PHYS] = row[SPAN_CELLS] = row[SPAN_TAKEN] = 0  # freed or moved: views of it are void
            _crash.point("share.released")
            self.shares.set(slot, None)
        elif m and row[LENGTH] < m:
            self._unshare(slot, row, row[LENGTH])
        elif row[SPAN_TAKEN] > m and row[LENGTH] < was_len:
            self._give_up_past(row, row[LENGTH])
        if row[FLAGS] & LENT:
            start = row[START]
            lent = self._lent_from(start)
            if row[STATE] != LIVE or start != was[1] or not lent:
                row[FLAGS] &= ~LENT  # moved away or nobody borrows any more: its cells are its own again
            elif row[LENGTH] < lent and row[LENGTH] < was_len:
                self._move_lender(slot, row)
        self._free.tag = -1  # the spans changed what is free: derived again

    def _unshare(self, slot: int, row: memoryview, keep: int) -> None:
        """Copy-on-write: the borrower keeps tokens [0, keep) (keep <= its span); its span shrinks
        to the whole page units below ``keep`` and the rest gets private
        pages, filled from the span through the descriptor (its own pages there are not mapped
        here yet)."""
        start, phys, m = row[START], row[SPAN_PHYS], row[SPAN_CELLS]
        m2 = keep // self._off.page_unit * self._off.page_unit
        pieces = self.shares.pieces
        mark_pages(self.hdr, start + m)  # (inside its range: marked already)
        self._dseg.reserve([(off + (start + m2) * cb, (m - m2) * cb) for off, cb in pieces], populate=False)
        if keep > m2:
            raw = self.shares.anchor
            for off, cb in pieces:
                src = raw[off + (phys + m2) * cb : off + (phys + keep) * cb]
                self._dseg.write(off + (start + m2) * cb, memoryview(src))  # type: ignore[arg-type]  # a buffer
        _crash.point("share.unshared")
        row[SPAN_CELLS] = m2
        self._give_up_past(row, keep)
        self.shares.set(slot, (start, phys, m2) if m2 else None)

    def _give_up_past(self, row: memoryview, keep: int) -> None:
        """The span's cells a borrower keeps taken: the whole page units under its first ``keep``
        cells (at least what it maps; those past them no view may still need: docs/stores.md)."""
        u = self._off.page_unit
        row[SPAN_TAKEN] = max(row[SPAN_CELLS], min(row[SPAN_TAKEN], -(-keep // u) * u))
        if not row[SPAN_TAKEN]:
            row[SPAN_PHYS] = 0

    def _move_lender(self, slot: int, row: memoryview) -> None:
        """A donor shorter than the cells it lent: its content to a fresh range (its appends go
        there), the lent cells left to their borrowers. No free range: it stays (see the module
        docstring; a truncate never fails for want of room because of sharing)."""
        length = row[LENGTH]
        try:
            new_start = self._lender_range(slot, row, length)
        except CacheFullError:
            return  # its next write past its length moves it (_sequence/room.py leave_loans)
        self._lender_moves(row, new_start, length)
        row[FLAGS] &= ~LENT

    def lent_end(self, slot: int) -> int:
        """The end of the cells row ``slot`` lends (relative to its start; 0: none)."""
        row = self.row(slot)
        if not row[FLAGS] & LENT:
            return 0
        return self._lent_from(row[START])

    def _lent_from(self, start: int) -> int:
        """The most cells any live row borrows, or keeps taken, from cell ``start`` on (0: none;
        lock held). A scan of the table once per span epoch and start: only a transaction that
        changes spans changes it, and that moves the epoch (odd meanwhile: ``Journal.spans_odd``,
        also on a rollback and a recovery), so a lending donor's speculative step scans nothing
        """
        e = self.hdr[_header.W_SPANS]
        seen = self._lent_seen
        if seen[0] == e and seen[1] == start and not e & 1:
            return seen[2]
        t = self.table_np
        lent = t[(t[:, STATE] == LIVE) & (t[:, SPAN_TAKEN] > 0) & (t[:, SPAN_PHYS] == start), SPAN_TAKEN]
        end = int(lent.max()) if lent.size else 0
        self._lent_seen = (e, start, end)
        return end

    def move_lender(self, slot: int, row: memoryview, keep: int) -> None:
        """Move a lender to a fresh range of its capacity, keeping its first ``keep`` cells (lock
        held, row changing; its LENT flag goes at the change's end: ``settle_span``).
        CacheFullError when no range is free, nothing changed."""
        self._lender_moves(row, self._lender_range(slot, row, keep), keep)

    def _lender_range(self, slot: int, row: memoryview, keep: int) -> int:
        """A fresh range for a lender (its first ``keep`` cells' pages allocated), or
        CacheFullError naming the loan."""
        cap = row[CAPACITY]
        try:
            return self.alloc(cap, evict=True, protect=slot, populate=False, fill=keep, was=row[START])
        except CacheFullError as e:
            raise CacheFullError(
                f"store {self.name!r}: sequence {row[ID]} lent its first {self.lent_end(slot)} cells to other "
                f"sequences and now holds {row[LENGTH]} tokens; its next tokens need a fresh range of {cap} "
                "cells (those cells stay its borrowers') and none is free: free or truncate sequences, or "
                "create the store with a larger max_tokens= (nothing was written)"
            ) from e

    def _lender_moves(self, row: memoryview, new_start: int, keep: int) -> None:
        self.pages.copy_cells(row[START], new_start, keep)
        self.pages.fill(new_start, row[CAPACITY])
        _crash.point("share.moved")
        row[START] = new_start

    def shared_cells(self) -> tuple[int, int]:
        """(cells borrowed by live rows, distinct physical cells those spans cover)."""
        t = self.table_np
        b = t[(t[:, STATE] == LIVE) & (t[:, SPAN_CELLS] > 0)]
        if not b.size:
            return 0, 0
        distinct = 0
        end = -1
        for phys, m in sorted(zip(b[:, SPAN_PHYS].tolist(), b[:, SPAN_CELLS].tolist(), strict=True)):
            distinct += max(0, phys + m - max(phys, end))
            end = max(end, phys + m)
        return int(b[:, SPAN_CELLS].sum()), distinct

    def held_cells(self) -> int:
        """Cells whose K/V pages the live sequences hold: their ranges but the borrowed cells, and
        every span once (a span whose donor is gone is held by its borrowers alone)."""
        t = self.table_np
        live = t[t[:, STATE] == LIVE]
        own = zip((live[:, START] + live[:, SPAN_CELLS]).tolist(), (live[:, START] + live[:, CAPACITY]).tolist(),
                  strict=True)
        return _covered(list(own) + [(a, a + m) for a, m in spans_taken(t)])

    def retained_cells(self) -> int:
        """Cells taken only because a borrower keeps them for views of its committed cells
        (``SPAN_TAKEN`` past what it maps, see the module docstring): no range and no mapped span
        holds them. They are given back when that borrower is freed or moves."""
        t = self.table_np
        used = t[t[:, STATE] != 0]
        live = used[used[:, STATE] == LIVE]
        kept = live[live[:, SPAN_TAKEN] > live[:, SPAN_CELLS]]
        if not kept.size:
            return 0
        ranges = list(zip(used[:, START].tolist(), (used[:, START] + used[:, CAPACITY]).tolist(), strict=True))
        spans = [(a, a + m) for a, m in zip(live[:, SPAN_PHYS].tolist(), live[:, SPAN_CELLS].tolist(), strict=True)]
        extra = [(a, a + m) for a, m in zip(kept[:, SPAN_PHYS].tolist(), kept[:, SPAN_TAKEN].tolist(), strict=True)]
        return _covered(ranges + spans + extra) - _covered(ranges + spans)

    def committed_held(self) -> int:
        """Cells whose committed K/V the live sequences hold: every row's own committed cells
        past its span, and every span's committed part once, however many rows read it and
        whether or not its donor still lives."""
        t = self.table_np
        live = t[t[:, STATE] == LIVE]
        span = np.minimum(live[:, SPAN_CELLS], live[:, LENGTH])
        parts = list(zip((live[:, START] + span).tolist(), (live[:, START] + live[:, LENGTH]).tolist(), strict=True))
        b = span > 0
        parts += zip(live[b, SPAN_PHYS].tolist(), (live[b, SPAN_PHYS] + span[b]).tolist(), strict=True)
        return _covered(parts)


def spans_taken(t: np.ndarray) -> list[tuple[int, int]]:
    """(start, cells) of what every live span of table ``t`` keeps taken (``SPAN_TAKEN``),
    whoever else holds the cells."""
    b = t[(t[:, STATE] == LIVE) & (t[:, SPAN_TAKEN] > 0)]
    return list(zip(b[:, SPAN_PHYS].tolist(), b[:, SPAN_TAKEN].tolist(), strict=True))


def _covered(parts: list[tuple[int, int]]) -> int:
    """Cells inside at least one of the ``[a, b)`` ``parts``."""
    n, end = 0, -1
    for a, b in sorted(parts):
        n += max(0, b - max(a, end))
        end = max(end, b)
    return n
