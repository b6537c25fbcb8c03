"""Structural operations on one sequence through its write handle: ``truncate``,
``shift_left``, ``remove``, ``set_tokens``, and the bracket they run in (``Structural``: the store lock,
the row's seqlock generation odd while it changes, the handle's addressing refreshed after).

Each writes its result where no row points (a fresh range, the other window buffer) and
switches the row to it at the end, so a crash at any point leaves the sequence as it was
(crash recovery: see ``_engine/locking/journal.py``). They also keep the prefix-index words of the row right
(``unindex_from``; the engine's ``Rows.mark_unfaithful_from``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.checks import count
from shmkv._engine.locking.interrupts import critical
from shmkv._engine.table.header import (
    CAPACITY,
    CLEAN,
    FLAGS,
    GEN,
    IDX_BLOCKS,
    LENGTH,
    LENT,
    NOINDEX,
    START,
    WIN_OFF,
    LEADS_MASK,
    leads,
    with_leads,
)
from shmkv._engine.prefixes.index import COVERS
from shmkv._engine.prefixes.hashes import BLOCK, LEAD, lead_levels
from shmkv._sequence.mirror import Int8Mirror
from shmkv._sequence.room import mind_loans
from shmkv._sequence.writer import SeqWriter, write_rows
from shmkv.errors import InvalidArgumentError, NotSupportedError

ShiftFn = Callable[[int, np.ndarray, int], np.ndarray]
_LEAD_MAX = LEAD[-1]  # (a name: unindex_from is on the truncate path)


class Structural:
    """Context of a structural op on one sequence: store lock + seqlock bracket.

    The handle's cached range and pending counts are refreshed afterwards.
    """

    __slots__ = ("_changing", "_locked", "w")

    def __init__(self, w: SeqWriter) -> None:
        self.w = w
        self._locked = w.port.locked()
        self._changing: AbstractContextManager[None] | None = None

    @critical  # the lock path (see ``_engine/locking/lock.py``: a Ctrl-C here is raised at the release)
    def __enter__(self) -> memoryview:
        self._locked.__enter__()
        try:
            self.w.r.span_unlocked()
            self._changing = self.w.port.changing(self.w.row)
            self._changing.__enter__()
        except BaseException:
            self._locked.__exit__(None, None, None)
            raise
        return self.w.row

    @critical
    def __exit__(self, *exc: Any) -> None:
        try:
            assert self._changing is not None
            self._changing.__exit__(*exc)
            w = self.w
            w.pending, w.staged = [0] * w.L, False  # (an int8 mirror: kept by truncate, else re-read)
            row = w.row
            w.cache(row[START], row[CAPACITY], row[WIN_OFF], gen=row[GEN])
            if row[FLAGS] & LENT:  # it lends: its room stops short of cells it lent (_sequence/room.py)
                mind_loans(w)
        finally:
            self._locked.__exit__(*exc)


def structural(w: SeqWriter, what: str) -> Structural:
    """The bracket of structural operation ``what`` (the lease checked first)."""
    w.need_writer(what)
    return Structural(w)


def unindex_from(w: SeqWriter, row: memoryview, n: int) -> None:
    """The sequence keeps only its first n tokens (lock held): blocks past them leave the index
    (their entries become invalid; holders they stood for get their own first), and a mark of
    changed tokens (``Rows.mark_unfaithful_from``) past them is gone."""
    flags = row[FLAGS]
    if flags & COVERS:
        w.port.unindexing(w.slot, n)
        flags = row[FLAGS]
    blocks = n // BLOCK
    if row[IDX_BLOCKS] > blocks:  # noqa: PLR1730  (builtin min parses keywords: ~0.5 us here, per truncate)
        row[IDX_BLOCKS] = blocks
    if n < _LEAD_MAX and flags & LEADS_MASK:  # (the truncate hot path skips this)
        row[FLAGS] = flags = with_leads(flags, min(leads(flags), lead_levels(n)))
    clean = row[CLEAN]
    if clean >= 0 and n <= clean:
        row[CLEAN] = clean = -1
    if clean < 0 and flags & NOINDEX and (n == 0 or w.tokens[row[START] + n - 1] >= 0):
        # the next completed block is looked at again. Kept while the last kept token has no id
        # (a decode without ids, as the Hugging Face adapter's, rolled back by a speculative step):
        # its block still cannot be indexed, and the next id-less commit need not take the lock
        # to flag it again (writer.unindexable)
        row[FLAGS] = flags & ~NOINDEX


def check_resumable(w: SeqWriter, row: memoryview, new_len: int, what: str) -> None:
    """Refuse a change after which sliding/chunked layers would miss tokens a new one needs."""
    woff = row[WIN_OFF]
    if not woff:
        return  # (the layers hold every token: nothing to check, and this is on truncate's path)
    lay = w.port.layout
    keep = lay.keep
    if lay.bounded and new_len and new_len - woff < keep:
        raise NotSupportedError(
            f"{what}: sliding/chunked layers of sequence {w.id} hold tokens from {woff} on; "
            f"a length of {new_len} would leave them {max(new_len - woff, 0)} of the {keep} a new "
            "token needs (keep at least that many, or clear())"
        )


def truncate(w: SeqWriter, n: int) -> None:
    n = count("n", n)
    with structural(w, "truncate") as row:
        # the int8 mirror keeps tokens [0, n) when it was current and nobody changed the row since
        # (the bracket bumped its generation by one): a speculative step rebuilds nothing
        keep_mirror = w.mirror is not None and w.mirror.gen == w.gen and row[GEN] == w.gen + 1
        length = row[LENGTH]
        if n > length:  # noqa: PLR1730  (as in unindex_from)
            n = length
        check_resumable(w, row, n, "truncate")
        row[LENGTH] = n
        _crash.point("truncate.row")
        if n == 0:
            row[WIN_OFF] = 0
        unindex_from(w, row, n)
    if keep_mirror:
        assert w.mirror is not None
        w.mirror.keep(n, w.gen)


def shift_left(w: SeqWriter, n: int) -> None:
    n = count("n", n)
    rows = w.r.rows
    with structural(w, "shift_left") as row:
        length = rows.length(row)
        if n > length:
            raise InvalidArgumentError(f"shift_left: n={n} exceeds the length {length} of sequence {w.id}")
        if n == 0:
            return
        woff = rows.window(row)[0]
        keep_from = max(n, woff)  # the oldest token the window buffers keep
        if rows.covers(row):  # (before the row's hashes move) holders its entries stood for get theirs
            w.port.unindexing(w.slot, 0)
        new_start, wb = w.port.rewrite(w.slot, [(n, 0, length - n)], [(keep_from - woff, 0, length - keep_from)])
        _crash.point("shift_left.copied")
        rows.switch_range(row, new_start, wb, length - n, max(0, woff - n))
        if n:  # token 0 no longer sits at position 0: no longer a donor
            rows.mark_unfaithful_from(row, 0)


def remove(w: SeqWriter, begin: int, end: int, shift: ShiftFn | None) -> None:
    begin = count("begin", begin)
    end = count("end", end)
    if shift is not None and not callable(shift):
        raise InvalidArgumentError(f"remove: shift={shift!r} must be a function shift(layer, keys, delta) -> keys, "
                                   "or None")
    rows = w.r.rows
    with structural(w, "remove") as row:
        length, start = rows.length(row), rows.start(row)
        if not begin <= end <= length:
            raise InvalidArgumentError(
                f"remove: need 0 <= begin <= end <= length, got begin={begin} end={end} length={length}"
            )
        if begin == end:
            return
        lay = w.port.layout
        P = w.positions
        moved = length - end
        woff = rows.window(row)[0]
        if lay.bounded:
            if begin < woff:
                raise NotSupportedError(
                    f"remove: sliding/chunked layers of sequence {w.id} no longer hold tokens "
                    f"before {woff}; remove from begin >= {woff}"
                )
            if moved and shift is None:
                raise NotSupportedError(
                    "remove: moved tokens take new positions, which sliding/chunked layers attend by; "
                    "pass shift=(layer, keys, delta) -> keys to re-rotate their keys"
                )
            check_resumable(w, row, length - (end - begin), "remove")
        delta = int(P[start + begin] - P[start + end]) if moved else 0
        new_keys = []
        if shift is not None and moved:
            for layer in range(w.L):
                lo, hi = w.r.cells(layer, start, woff, end, length)
                src = np.array(w.r.view("k", layer, lo, hi), dtype=np.float32 if not w.plain else None)
                out = np.asarray(shift(layer, src, delta))
                if out.shape != src.shape or out.dtype.kind != "f" or (
                        w.dtype == "int8" and not np.isfinite(out).all()):
                    raise InvalidArgumentError(
                        f"remove: shift() returned {out.shape} {out.dtype} for layer {layer}; "
                        f"it must return float keys shaped {src.shape}"
                    )
                new_keys.append(out)
        if rows.covers(row):  # (before the row's hashes move) holders its entries stood for get theirs
            w.port.unindexing(w.slot, begin)
        # the result goes where no row points (a fresh range, the other window buffer), then the
        # row switches to it: a crash at any point leaves the sequence as it was
        new_start, wb = w.port.rewrite(w.slot, [(0, 0, begin), (end, begin, moved)],
                                  [(0, 0, begin - woff), (end - woff, begin - woff, moved)])
        new_wbase = w.port.wcell(w.slot, wb)
        if moved:
            P[new_start + begin : new_start + begin + moved] += delta
            for layer, keys in enumerate(new_keys):
                lo = new_start + begin if w.isfull[layer] else new_wbase + begin - woff
                # re-encoded: values (and their scales) stay as moved
                write_rows(w, w.Kw[layer], None if w.KS is None else w.KS[layer], lo, keys)
        _crash.point("remove.copied")
        rows.switch_range(row, new_start, wb, length - (end - begin))
        # the moved tokens were computed with the removed ones in context: not a prefix to reuse
        rows.mark_unfaithful_from(row, begin)


def set_tokens(w: SeqWriter, tokens: Any, begin: Any) -> None:
    """Sequence.set_tokens: ids for committed tokens [begin, begin + n) that have none, then their
    completed blocks into the prefix index. Everything is checked before anything is written.

    Crash recovery: the one write into committed cells, and not logged: it only turns -1 (no id)
    into the caller's ids, so a crash half-way leaves some of the true ids recorded and the rest
    -1, a state the sequence could have had anyway (the index only takes blocks without -1)."""
    w.need_writer("set_tokens")
    begin = count("begin", begin)
    a = np.asarray(tokens)
    a = a.reshape(1) if a.ndim == 0 else a
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"set_tokens: tokens must be a 1-D sequence of ints, got shape {a.shape} "
                                   f"dtype {a.dtype}")
    a = a.astype(np.int64, copy=False)
    neg = np.flatnonzero(a < 0)
    if neg.size:
        raise InvalidArgumentError(f"set_tokens: token ids must be >= 0, got {int(a[neg[0]])} at "
                                   f"tokens[{int(neg[0])}] (-1 is what commit() records without tokens=)")
    n = a.size
    with w.port.locked():
        row = w.row
        start, _, length, _ = w.r.span_unlocked()
        if begin + n > length:
            raise InvalidArgumentError(
                f"set_tokens: tokens for indexes {begin}..{begin + n - 1} reach past the committed length "
                f"{length} of sequence {w.id}: give ids of committed tokens (commit(tokens=) takes new ones)"
            )
        cells = w.tokens[start + begin : start + begin + n]
        differ = np.flatnonzero((cells >= 0) & (cells != a))
        if differ.size:
            i = int(differ[0])
            raise InvalidArgumentError(
                f"set_tokens: tokens[{i}]={int(a[i])} for index {begin + i} of sequence {w.id}, whose cell "
                f"holds token {int(cells[i])}: recorded ids are fixed (the prefix cache indexes them)"
            )
        if not n:
            return
        with w.port.changing(row):
            cells[:] = a
            w.r.rows.indexable_again(row)  # blocks from IDX_BLOCKS on may be indexable now
        Int8Mirror.moved(w, w.r.rows.generation(row))  # our own change: pending tokens stay
        w.port.index_blocks(w.slot, length)
