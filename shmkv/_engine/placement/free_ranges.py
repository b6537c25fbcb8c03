"""A process's cache of a store's free ranges (create_sequence and free flat in the
number of sequences; the ranges were derived by sorting every live row at each allocation).

The free ranges are the gaps between the ranges of the rows in use: the table is the truth,
and nothing about them is stored in shared memory (recovery has nothing to rebuild). Each
process keeps the gaps it derived, with the value of the store's allocation counter (header
word ``W_ALLOCS``) at that time. Every change of a row's (state, start, capacity) bumps the
counter, in the bracket that makes it (``Journal.changing``, lock held), and recovery bumps it
too. So a cache whose counter value is current is exact; this process's own changes update
the gaps as they bump the counter (they stay current), and another process's change makes
the next use derive them again.
"""

from __future__ import annotations

from shmkv._engine.table import header as _header
from shmkv._engine.table.header import CAPACITY, START, STATE
from shmkv._engine.memory.intervals import add_interval, take_interval

__all__ = ["FreeRanges", "mark_pages"]


class FreeRanges:
    """One store handle's cached gaps (sorted ``[start, end)``) and the brackets in progress."""

    __slots__ = ("brackets", "gaps", "tag")

    def __init__(self) -> None:
        self.gaps: list[tuple[int, int]] = []
        self.tag = -1  # the allocation counter's value the gaps are right at
        # slot -> (state, start, capacity) at the start of its outermost bracket in progress
        # (brackets of one row may nest: the outermost counts)
        self.brackets: dict[int, tuple[int, int, int]] = {}

    def cached(self, hdr: memoryview) -> list[tuple[int, int]] | None:
        """The gaps as (start, size) while they are current (lock held), else None."""
        if self.tag != hdr[_header.W_ALLOCS]:
            return None
        return [(a, b - a) for a, b in self.gaps]

    def derived(self, hdr: memoryview, ranges: list[tuple[int, int]]) -> None:
        """Keep ``ranges`` (start, size), just derived from the table (lock held)."""
        self.gaps = [(a, a + n) for a, n in ranges]
        self.tag = hdr[_header.W_ALLOCS]

    def changed(self, was: tuple[int, int, int], row: memoryview, hdr: memoryview) -> None:
        """The outermost bracket of a row ends with its range or state changed from ``was``
        (lock held; ``Journal.changing`` keeps ``brackets``, inlined: it is on the truncate path):
        bump the counter, and follow the change when the gaps were current."""
        now = (row[STATE], row[START], row[CAPACITY])
        if now[0] and now[1] + now[2] > hdr[_header.W_PAGE_MARK]:
            hdr[_header.W_PAGE_MARK] = now[1] + now[2]  # (see mark_pages)
        current = self.tag == hdr[_header.W_ALLOCS]
        hdr[_header.W_ALLOCS] += 1
        if not current:
            return
        if was[0] and was[2] > 0:
            add_interval(self.gaps, was[1], was[1] + was[2])
        if now[0] and now[2] > 0:
            take_interval(self.gaps, now[1], now[1] + now[2])
        self.tag = hdr[_header.W_ALLOCS]

    def unknown(self, hdr: memoryview) -> None:
        """Rows were put back outside a bracket (recovery, lock held): every process derives its
        gaps again."""
        hdr[_header.W_ALLOCS] += 1
        self.tag = -1
        self.brackets.clear()


def mark_pages(hdr: memoryview, end: int) -> None:
    """Cells below ``end`` may get pages now (lock held): raise the store's page mark to it.

    The page mark (header word ``W_PAGE_MARK``) bounds the cells that may hold pages of the
    arrays a span covers (K/V of full layers, int8 scales): pages are allocated only in a
    row's range, or in a range staged by a restore, and every such range's end is marked
    under the lock, when a row's range changes (``FreeRanges.changed``) and before a
    reservation under the lock allocates anything (``Pages.reserve``, ``stage``; a crash
    between the two leaves it marked). A write handle's reservations (lock-free, ``room``)
    stay inside its row's range, marked already. It never falls: a rolled-back range may have
    pages. So a borrower whose span starts at or above the mark as its create found it has no
    pages of its own there to punch (``Sharing.borrow``: 16 fallocate calls a create
    in an 8-layer store). A store written by an older shmkv (no mark kept: the word was
    reserved, 0) is never attached: its header version is below 6 (tests/test_safety.py)."""
    if end > hdr[_header.W_PAGE_MARK]:  # noqa: PLR1730  (never a store when not above: see room)
        hdr[_header.W_PAGE_MARK] = end
