"""The prefix index's searches of the sequence table (``_engine/prefixes/index.py``): which live rows hold
a prefix hash, found from their hashes region rather than from index entries (the rows copied
from a source that stands for them have none: see _prefix, STANDIN). One numpy pass each.
"""

from __future__ import annotations

import numpy as np

from shmkv._engine.table.header import (FLAGS, ID, IDX_BLOCKS, LEADS_MASK, LEADS_SHIFT, LENGTH, LIVE, RECENCY,
                                        SEQ_WORDS, START, STATE)
from shmkv._engine.prefixes.hashes import BLOCK, LEAD

LEADMARK = 1 << 61  # in an entry's block word: a lead entry, j in the low bits


def table_holders(rows: np.ndarray, hashes: np.ndarray, need: list[tuple[int, int]],
                   exclude: int, every: bool = False, *, slots: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """For each (hash, block or LEADMARK | j) of ``need`` that a live row other than ``exclude``
    holds, (its index in ``need``, the most recent such row, how many there are): one pass over
    the table (or over rows ``slots`` only). A row holds block blk when it indexed it and the
    hash sits at the block's last cell; lead j when it has that many leads and the hash sits at
    cell j - 1. ``every``: (index, row, 1) for every such row."""
    if slots is None:
        live = rows[:, STATE] == LIVE
        if 0 <= exclude < len(rows):
            live[exclude] = False
        cand = np.flatnonzero(live)
    else:
        cand = slots[(rows[slots, STATE] == LIVE) & (slots != exclude)]
    if not cand.size:
        return []
    hs = np.array([h for h, _ in need], np.int64)
    mark = np.array([b for _, b in need], np.int64)
    lead = (mark & LEADMARK) != 0
    j = np.where(lead, mark & ~LEADMARK, 0)
    nblk = np.where(lead, 0, mark)
    level = np.searchsorted(np.array(LEAD), j, side="right")
    c = rows[cand]
    have = (c[:, FLAGS] & LEADS_MASK) >> LEADS_SHIFT
    ok = np.where(lead[None, :], have[:, None] >= level[None, :], c[:, IDX_BLOCKS][:, None] > nblk[None, :])
    cells = c[:, START][:, None] + np.where(lead, j - 1, (nblk + 1) * BLOCK - 1)[None, :]
    ok &= (cells >= 0) & (cells < len(hashes))
    ok &= hashes[np.where(ok, cells, 0)] == hs[None, :]
    if every:
        return [(int(k), int(cand[i]), 1) for i, k in zip(*np.nonzero(ok), strict=True)]
    recency = np.where(ok, c[:, RECENCY][:, None], -1)
    return [(k, int(cand[int(np.argmax(recency[:, k]))]), int(ok[:, k].sum()))
            for k in np.flatnonzero(ok.any(axis=0)).tolist()]


def copies(r: memoryview, hashes: np.ndarray, tokens: np.ndarray, key: tuple[int, int], *, t: np.ndarray,
            n: int) -> list[tuple[int, int]]:
    """(id, slot) of the live rows holding ``key`` (hash, block or LEADMARK | j) whose token n is
    ``t[n]``, most recent first (read without the lock: each is verified under its seqlock).

    The token test comes first, over the whole table (a gather of one cell a row): it leaves
    few rows or none (a request's own tokens after a shared system prompt differ from every
    other's), and only those are asked for ``key`` (about a tenth of the cost of asking every
    row: it ran on every create over a prefix that some request had gone on past)."""
    if n >= len(t):
        return []
    rows = np.frombuffer(r, np.int64).reshape(-1, SEQ_WORDS)
    cell = rows[:, START] + n
    np.maximum(np.minimum(cell, len(tokens) - 1, out=cell), 0, out=cell)  # (out of range: checked below)
    ok = tokens[cell] == t[n]
    ok &= rows[:, LENGTH] > n
    if not ok.any():
        return []
    got = table_holders(rows, hashes, [key], -1, every=True, slots=np.flatnonzero(ok))
    if not got:
        return []
    slots = np.array([s for _, s, _ in got], np.int64)
    # (again: the words were read without the lock and may have changed since)
    cell = rows[slots, START] + n
    ok = (rows[slots, LENGTH] > n) & (cell >= 0) & (cell < len(tokens))
    ok[ok] &= tokens[cell[ok]] == t[n]
    slots = slots[ok]
    slots = slots[np.argsort(-rows[slots, RECENCY], kind="stable")]
    return [(int(rows[s, ID]), int(s)) for s in slots.tolist()]
