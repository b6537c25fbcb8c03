"""Where a sequence's cells go when it needs more than its range holds: ``Growth.relocate``
grows the range in place, slides it down, or moves it (all under the store lock, the row
changing; never over cells a row points to, journal invariant 1), a range on a page unit to
another on one where it can. The placing itself is the
arena's (``arena.py``), the copies the pages part's (``_engine/memory/pages.py``)."""

from __future__ import annotations

from typing import Any

from shmkv._engine.locking import crash as _crash
from shmkv._engine.memory.pages import Pages
from shmkv._engine.placement.arena import Arena
from shmkv._engine.table.header import CAPACITY, FLAGS, ID, LENT, START, Layout
from shmkv.errors import CacheFullError

__all__ = ["Growth"]


class Growth:
    """The growth part of a store handle, held by the engine: the arena's placing and the pages
    part's copies, bound once."""

    def __init__(self, *, name: str, layout: Layout, arena: Arena, pages: Pages) -> None:
        self.name, self.layout, self.pages = name, layout, pages
        self.alloc, self.free_ranges, self.free_tokens = arena.alloc, arena.free_ranges, arena.free_tokens
        self.unit_for = arena.unit_for

    def relocate(self, slot: int, row: memoryview, needed: int, keep: int, protect: int = -1) -> None:
        """Give a sequence at least ``needed`` cells, keeping its first ``keep`` (lock held, row changing).

        Tried in order: grow in place into the free cells after the range; slide down into free
        cells before it (plus any after); move to a free range elsewhere, evicting for exactly
        ``needed`` if need be. Sizes tried: twice the capacity, then exactly ``needed``. A range
        on a page unit (one that may lend its pages, docs/design.md §11) of at least a unit keeps
        to one where it can, at the size and in the free cells the order above picks: a slide
        to a start on a unit, a move to one inside the free range first fit picks (``was``).
        """
        start, cap = row[START], row[CAPACITY]
        new_cap = min(max(needed, 2 * cap), self.layout.max_tokens)
        gaps = self.free_ranges()
        room = self.free_tokens(gaps)  # what max_tokens still holds (the arena has alignment slack)
        before = next((g for g in gaps if g[0] + g[1] == start), (start, 0))
        after = next((g for g in gaps if g[0] == start + cap), (start + cap, 0))
        wants = list(dict.fromkeys((new_cap, needed)))
        for want in wants:
            if want - cap > room:
                continue  # (a move: alloc's own check, below)
            if cap + after[1] >= want:  # (the new cells' pages: as the appends need them, pages.py)
                row[CAPACITY] = want
                _crash.point("grow.extended")
                return
            to = self._slide_to(row, want, keep, before, after, align=1)
            if to < 0:
                continue
            unit = self.unit_for(want, start)
            if unit > 1:  # (on a unit, in the same free cells, if they hold it there)
                on_unit = self._slide_to(row, want, keep, before, after, align=unit)
                to = on_unit if on_unit >= 0 else to
            self._slide(row, want, keep, to)
            return
        for want in wants:  # (alloc keeps to a unit where it can: ``was``)
            if self._move(row, want, keep, evict=want == needed, protect=protect, was=start):
                return
        raise CacheFullError(
            f"store {self.name!r}: sequence {row[ID]} needs {needed} token cells and no free range "
            f"is that large ({max(0, self.free_tokens(gaps))} of max_tokens={self.layout.max_tokens} free): "
            "free or truncate sequences, or create the store with a larger max_tokens="
        )

    @staticmethod
    def _slide_to(row: memoryview, want: int, keep: int, before: tuple[int, int], after: tuple[int, int], *,
                  align: int) -> int:
        """Where the range could slide down to: ``want`` cells ending at most where the free cells
        after it end, starting on a multiple of ``align``, its first ``keep`` cells clear of their
        copy: never over its own committed cells (nor over cells it lent:
        tests/test_crash.py::test_random_kills...[shared] found it). -1: nowhere."""
        start = row[START]
        end = start + row[CAPACITY] + after[1]
        if align == 1:
            to = max(before[0], end - want)
        else:  # (the highest start on a unit from which it fits with its kept cells clear)
            to = min(end - want, start - keep) // align * align
            if to < before[0]:
                return -1
        return -1 if to + want > end or to + keep > start or row[FLAGS] & LENT else to

    def _slide(self, row: memoryview, want: int, keep: int, to: int) -> None:
        self.pages.reserve(to, keep)
        self.pages.copy_cells(row[START], to, keep)  # (no overlap: _slide_to)
        _crash.point("grow.slid")
        row[START], row[CAPACITY] = to, want

    def _move(self, row: memoryview, want: int, keep: int, **where: Any) -> bool:
        """Move the sequence's first ``keep`` cells to a fresh range of ``want`` (``where``: how
        ``alloc`` places it), if one is found."""
        try:
            new_start = self.alloc(want, populate=False, fill=keep, **where)
        except CacheFullError:
            return False
        self.pages.copy_cells(row[START], new_start, keep)
        self.pages.fill(new_start, want)  # the appends that made it grow go on there
        _crash.point("grow.copied")
        row[START] = new_start
        _crash.point("grow.switched")
        row[CAPACITY] = want
        return True
