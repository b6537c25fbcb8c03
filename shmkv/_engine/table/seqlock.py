"""The one seqlock read of the sequence table, with the retry policy as a parameter.

A structural operation makes a row's generation odd for the whole change and even (higher)
when its journaled transaction ends (ARCHITECTURE.md invariant 4; ``journal.Journal.changing``).
A lock-free reader reads the generation, what it needs, and the generation again; it keeps
what it read only if the generation was even and the same both times, and tries again
otherwise (invariant 5). ``read()`` may therefore see a torn row: it must not raise on one,
and its caller validates what it returns (e.g. that the sequence is live) afterwards.

How long a reader keeps trying and what it does when it gives up depends on who reads; each
reader names its policy here, and ``seqlocked`` is the loop they all run:

=========  =====  ===========================  ==========================================
policy     tries  between tries                when they are used up (``fallback``)
=========  =====  ===========================  ==========================================
HANDLE     2000   spin 51, then sched_yield    the row read under the store's reading lock
                                               (``_sequence.reader.SeqReader``: views, reads)
SAVE       200    spin 21, then sleep 0.2 ms   ``_Busy``: the save captures again under the
                                               lock (``_snapshot.save._capture``)
VERIFY     100    spin                         0: a prefix match misses this donor
                                               (``prefix.PrefixIndex._verify``)
=========  =====  ===========================  ==========================================
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")

__all__ = ["HANDLE", "SAVE", "SMALL_TABLE", "VERIFY", "Retry", "odd_rows", "seqlocked"]


@dataclass(frozen=True, slots=True)
class Retry:
    """A seqlock reader's retry policy (see the module docstring)."""

    tries: int  # reads of an odd or moved generation before the fallback
    spin: int  # tries made back to back; each one after them first sleeps ``pause``
    pause: float  # seconds (0: give the CPU up, sched_yield)


HANDLE = Retry(tries=2000, spin=51, pause=0.0)
SAVE = Retry(tries=200, spin=21, pause=0.0002)
VERIFY = Retry(tries=100, spin=100, pause=0.0)


def seqlocked(words: memoryview, gen: int, read: Callable[[], T], policy: Retry, fallback: Callable[[], T], *,
              hold: Callable[[], AbstractContextManager[None]] | None = None,
              mine: Callable[[], bool] | None = None) -> T:
    """``read()`` between two reads of the generation word ``words[gen]`` (a row's GEN), returned
    once the generation was even and the same after it; after ``policy.tries`` tries,
    ``fallback()`` (under ``hold()`` when given: a lock that waits the change out).

    ``mine``: whether this thread holds the store lock; then an odd row met at the first try is
    its own open transaction's (``journal``, invariant 3): the fallback at once, no spinning.
    """
    g = words[gen]  # the first try, on its own: what nearly every read is (no row changing)
    if not g & 1:
        value = read()
        if words[gen] == g:
            return value
    if not (g & 1 and mine is not None and mine()):
        spin, pause = policy.spin, policy.pause
        for i in range(1, policy.tries):
            if i > spin:
                time.sleep(pause)
            g = words[gen]
            if not g & 1:
                value = read()
                if words[gen] == g:
                    return value
    if hold is None:
        return fallback()
    with hold():
        return fallback()


# A table of at most this many rows is scanned in Python lists: numpy's first ufunc in a fresh or
# forked process costs ~0.1 ms, more than the whole scan (the recovery scan, the client check).
SMALL_TABLE = 1024


def odd_rows(gens: np.ndarray) -> list[int]:
    """The rows whose generation (``gens``: the table's GEN column) is odd: changing, or left so
    by a dead process. A small table in Python: numpy's first ``&`` in a fresh or forked process
    costs ~0.1 ms, which an attach's recovery scan would pay."""
    if len(gens) <= SMALL_TABLE:
        return [slot for slot, g in enumerate(gens.tolist()) if g & 1]
    return [int(slot) for slot in (gens & 1).nonzero()[0]]
