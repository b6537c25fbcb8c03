"""Sorted lists of disjoint half-open intervals ``[(a, b), ...]`` of cells: the pages a process
reserved or owes (``_engine/memory/pages.py``), the free ranges it caches (``_engine/placement/free_ranges.py``).

Each function is atomic among the threads of a process (``_LOCK``): a decode thread's ``room``
changes the reservation record without the store lock while another thread's punch or
reservation changes it under the lock, and an unguarded change could be lost (a range then
recorded as reserved that is not: a skipped fallocate, a SIGBUS on a full /dev/shm;
tests/test_intervals_threads.py)."""

from __future__ import annotations

import bisect
import threading

from shmkv._engine.locking.forks import renewed

_LOCK: threading.Lock = renewed(globals(), "_LOCK")  # (free again in a forked child)


def covers(spans: list[tuple[int, int]], a: int, b: int) -> bool:
    """Whether [a, b) lies inside one interval of a sorted list of disjoint intervals."""
    with _LOCK:
        i = bisect.bisect_right(spans, (a, 1 << 62)) - 1
        return i >= 0 and spans[i][0] <= a and b <= spans[i][1]


def clear(*lists: list[tuple[int, int]]) -> None:
    """Empty interval lists (one step for the other threads)."""
    with _LOCK:
        for spans in lists:
            spans.clear()


def overlaps(spans: list[tuple[int, int]], a: int, b: int) -> bool:
    """Whether any cell of [a, b) lies in a sorted list of disjoint intervals."""
    with _LOCK:
        i = bisect.bisect_left(spans, (b, -1))
        return i > 0 and spans[i - 1][1] > a


def take_interval(spans: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Remove [a, b) from a sorted list of disjoint intervals; return the parts it held."""
    with _LOCK:
        return _take(spans, a, b)


def _take(spans: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    i = max(bisect.bisect_right(spans, (a, 1 << 62)) - 1, 0)
    j = i
    taken, keep = [], []
    while j < len(spans) and spans[j][0] < b:
        s, e = spans[j]
        if e > a:
            taken.append((max(s, a), min(e, b)))
            if s < a:
                keep.append((s, a))
            if e > b:
                keep.append((b, e))
        else:
            keep.append((s, e))
        j += 1
    spans[i:j] = keep
    return taken


def add_interval(spans: list[tuple[int, int]], a: int, b: int) -> None:
    """Add [a, b) to a sorted list of disjoint intervals, merging what touches it."""
    with _LOCK:
        _add(spans, a, b)


def _add(spans: list[tuple[int, int]], a: int, b: int) -> None:
    i = bisect.bisect_left(spans, (a, a))
    if i and spans[i - 1][1] >= a:
        i -= 1
        a = spans[i][0]
    j = i
    while j < len(spans) and spans[j][0] <= b:
        b = max(b, spans[j][1])
        j += 1
    spans[i:j] = [(a, b)]


class Record:
    """This process's reservation record (page tables are per process): the cells whose pages it
    reserved, ``cells`` (full layers, all layers), of which ``owed`` are allocated but never
    touched here, valid at span epoch ``at`` (``pages.Pages.record``; the journal keeps ``at`` in
    step with this process's own span changes, ``share.Shares`` takes punched cells out)."""

    __slots__ = ("at", "cells", "owed")

    def __init__(self) -> None:
        self.cells: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        self.owed: list[tuple[int, int]] = []
        self.at = -1
