"""A write handle's room: the pages its appends write into, allocated a chunk at a time.

A range's capacity is reserved as cells, its pages only as writes need them
(``_engine/memory/pages.py``). A write handle knows a token index, ``room``, below which its range's
pages are allocated (every array's: K/V, token ids, positions, hashes, int8 scales); its
per-layer limits (``SeqWriter.lim``) stop there, so the append fast path stays one
comparison and a token that would cross the room goes down the checked path, which calls
``make_room`` first: the next chunk's pages are allocated and pre-faulted (CacheFullError,
nothing written, when /dev/shm is full), then the append writes.

The room starts, for a new handle, a range that moved or any change made by someone else
(``SeqWriter.refresh``), at what is written (the committed and pending tokens: their pages
exist); pages once allocated stay, so it only grows while the handle's own changes keep the
range where it is (a borrow punches only cells below the borrower's length, never written
again: ``_engine/spans/mappings.py``).

The chunk: at least ``MIN_CHUNK`` cells and a page unit, and an eighth of the capacity up to
``MAX_CHUNK_BYTES``, so a decode pays one allocation per many tokens (at most about eight over
a range's capacity, more for one of several GiB), holds at most an eighth of its capacity
beyond what it wrote, and never stalls a step for more than 64 MiB of fresh pages (the kernel
zeroes each page it allocates: about 4 ms a 16 MiB here, see tools/bench.py decode's first pass).

A sequence that lent cells to others and truncated below them when no range was free to move
to (``_engine/spans/lending.py``) still holds those cells' pages but may not write them: its room
stops at its length (``mind_loans``, after each of its structural changes), and before its
next write past the length it moves to a fresh range (``leave_loans``: CacheFullError while
none is free, nothing written).

A sliding or chunked layer's room is its window buffer: when an append would run past it,
``compact`` copies the tokens the layer keeps (and the pending ones) to the start of the row's
other buffer and switches to it, a structural change (the committed tokens stay intact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.port import Port
from shmkv._engine.table.header import CAPACITY, GEN, LENGTH, START, WBUF, WIN_OFF
from shmkv._sequence.mirror import Int8Mirror
from shmkv.errors import CacheFullError

if TYPE_CHECKING:
    from shmkv._sequence.reader import SeqReader

__all__ = ["MAX_CHUNK_BYTES", "MIN_CHUNK", "GrowingWriter", "chunk", "compact", "grow", "leave_loans", "limits",
           "make_room", "mind_loans"]

MIN_CHUNK = 64  # cells
MAX_CHUNK_BYTES = 64 << 20


class GrowingWriter(Protocol):
    """What of a write handle (``SeqWriter``) these functions use."""

    port: Port
    r: SeqReader  # (its ``rows``: the engine's rows part, the row's words)
    row: memoryview
    id: int
    slot: int
    start: int
    room: int
    gen: int
    pending: list[int]
    mirror: Int8Mirror | None
    wc: int
    isfull: list[bool]
    lim: list[int]
    Kw: list[np.ndarray]  # (writable per-layer bases: compact's copies)
    Vw: list[np.ndarray]
    lent_past: bool
    cached: tuple[int, int, int, int] | None

    def cache(self, start: int, cap: int, woff: int, *, gen: int | None = None, fresh: bool = False) -> None: ...


def chunk(capacity: int, page_unit: int, cell_bytes: int) -> int:
    """Cells allocated at a time ahead of a write handle's appends, for a range of ``capacity``
    cells of ``cell_bytes`` bytes each (see the module docstring)."""
    return max(MIN_CHUNK, page_unit, min(capacity // 8, MAX_CHUNK_BYTES // max(cell_bytes, 1)))


def limits(w: GrowingWriter, cap: int, woff: int, room: int | None = None) -> list[int]:
    """The token index limit of each layer: the capacity bounds every layer (token ids and
    positions need a cell even where only sliding/chunked layers hold K/V), the window buffer
    bounds those, and the room (pages allocated: ``room``, or the handle's) bounds them all."""
    room = w.room if room is None else room
    full = min(cap, room)
    win = min(woff + w.wc, cap, room)
    return [full if f else win for f in w.isfull]


def make_room(w: GrowingWriter, end: int) -> None:
    """Allocate the pages for tokens up to ``end`` (within the capacity) and the chunk after
    them, before an append writes there (CacheFullError from here: nothing written)."""
    row, rows = w.row, w.r.rows
    cap = rows.capacity(row)
    lo = max(w.room, rows.length(row))
    if end <= lo:
        hi = lo
    else:
        p = w.port
        hi = min(cap, max(end, lo + chunk(cap, p.page_unit, p.kv_bytes(p.layout.layers))))
        w.port.room(w.start, lo, hi)
    # room and lim change together, with no call between (a Ctrl-C lands only at a call: one
    # inside limits() between them left lim below room, and every later append of the handle
    # skipped make_room into compact, CacheFullError on a full layer; tests/test_sharing_interrupts.py)
    c = w.cached
    if c is not None:
        lim = limits(w, c[1], c[2], hi)
        w.room, w.lim = hi, lim
    else:
        w.room = hi


def mind_loans(w: GrowingWriter) -> None:
    """After the handle's own structural change of a row that lends (lock held): when it now
    holds fewer tokens than it lent cells (it could not move: ``_engine/spans/lending.py``), its
    room stops at its length, so its next append goes through ``leave_loans`` first."""
    length = w.r.rows.length(w.row)  # (lock held: it stays)
    if w.port.lent_end(w.slot) > length:  # (no scan on a speculative step: cached per span epoch)
        w.lent_past = True
        if w.room > length:
            c = w.cached
            if c is not None:  # (together, as in make_room: lim above room would write past it)
                lim = limits(w, c[1], c[2], length)
                w.room, w.lim = length, lim
            else:
                w.room = length


def grow(w: GrowingWriter, needed: int) -> None:
    """Give the sequence room for ``needed`` tokens (a structural change; pending tokens stay)."""
    p = w.port
    if needed > p.layout.max_tokens:  # refused before anything moves or grows
        raise CacheFullError(
            f"sequence {w.id} would hold {needed} tokens, more than store {p.name!r}'s "
            f"max_tokens={p.layout.max_tokens}: truncate or shift_left it, or create the store with "
            "a larger max_tokens= (nothing was written)"
        )
    rows = w.r.rows
    keep = rows.length(w.row) + max(w.pending)
    with p.locked():
        row = w.row
        try:
            with p.changing(row):
                p.relocate(w.slot, row, needed, keep)
        finally:  # our own change (or none): pending tokens stay valid; the addressing before
            # the generation (a Ctrl-C between them: see leave_loans)
            w.cache(*rows.placement(row))
            Int8Mirror.moved(w, rows.generation(row))


def leave_loans(w: GrowingWriter) -> None:
    """Before a write past the length of a row flagged LENT: when cells it lent lie there, move
    it to a fresh range first (CacheFullError while none is free: nothing written, nothing
    moved). Its pending tokens move with it."""
    p = w.port
    rows = w.r.rows
    with p.locked():
        row = w.row
        keep = rows.length(row) + max(w.pending)
        if not rows.lends(row) or p.lent_end(w.slot) <= rows.length(row):
            w.lent_past = False  # until its own next structural change (mind_loans) or someone else's
            return
        try:
            with p.changing(row):
                p.move_lender(w.slot, row, keep)
            w.lent_past = False
        finally:  # our own change (or none): pending tokens stay valid. The addressing first, the
            # generation last: a Ctrl-C between them leaves a generation that sends the next write
            # through need_writer
            w.cache(*rows.placement(row))
            Int8Mirror.moved(w, rows.generation(row))


def compact(w: GrowingWriter, layer: int, end: int) -> None:
    """Make room in ``w``'s window buffers (sliding/chunked layers): keep the last ``keep``
    committed tokens (and every layer's pending ones) at the buffer's start. A structural change."""
    lay = w.port.layout
    keep_n = lay.keep
    with w.port.locked():
        row = w.row
        length, woff = row[LENGTH], row[WIN_OFF]
        new_off = max(woff, length - keep_n)
        if end - new_off > w.wc:
            raise CacheFullError(
                f"append: {end - length} new tokens on sliding/chunked layer {layer} exceed the "
                f"{w.wc - keep_n} a window buffer takes between commits; commit in smaller steps, "
                f"or create the store with a larger memory= (now {lay.step})"
            )
        with w.port.changing(row):
            # into the other buffer, then switch: the committed tokens stay intact (crash recovery)
            wb = row[WBUF]
            a0, b0 = w.port.wcell(w.slot, wb) + new_off - woff, w.port.wcell(w.slot, 1 - wb)
            for lay_i in lay.bounded:
                n = length - new_off + w.pending[lay_i]
                for arr in (w.Kw[lay_i], w.Vw[lay_i]):
                    np.copyto(arr[b0 : b0 + n], arr[a0 : a0 + n])
            _crash.point("compact.copied")
            row[WBUF] = 1 - wb
            row[WIN_OFF] = new_off
        w.cache(row[START], row[CAPACITY], new_off, gen=row[GEN])
