"""The pages under a store's cells: reservation, pre-faulting, and writes through the data
segment's descriptor into fresh ranges (a prefill, a load, a move; ``Arena`` places the cells).

A range's pages are allocated (posix_fallocate: a full /dev/shm is CacheFullError, never a
SIGBUS) before anything is written into them, and only ahead of what is written (memory on
demand, the bench's ``prefix_memory_ratio``): a range's capacity is reserved as cells (address
space, ``max_tokens``), its pages as its content needs them. A new range gets pages for the
cells its creator writes (a reused prefix); ``write_new`` for an extend's tokens, exactly;
appends through the mapping a chunk at a time (``room``, from the write handle's checked path
when a token would cross what it knows is allocated: ``_sequence/room.py``); a move or a
rewrite for the cells it copies. Pages once allocated stay (but for a borrower's punched span:
``record``). What fills them decides the rest:

* appends write through the mapping: the pages are pre-faulted first (MADV_POPULATE_WRITE,
  which zeroes them), so the hot path never takes a page fault;
* a prefill, a load, a move or a copy into a fresh range write through the descriptor
  (``os.pwrite``, ``os.sendfile``): tmpfs then fills the new pages without zeroing them and
  without mapping them, about one copy's cost, where zeroing + mapping + memcpy is two.

Cells allocated but never touched by this process are *owed* (``Record.owed``, per process:
page tables are per process): the next writer through the mapping pre-faults them
(``fill``), a writer through the descriptor takes them off. It is a record of cost only:
every path is correct whatever it says (the pages exist).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from shmkv._engine.table import header as _header
from shmkv._engine.placement.free_ranges import mark_pages
from shmkv._engine.table.header import Layout, Offsets
from shmkv._engine.memory.intervals import Record, add_interval, clear, covers, overlaps, take_interval
from shmkv._engine.memory.segment import Segment
from shmkv._engine.spans.mappings import Shares

__all__ = ["Pages", "add_interval", "covers", "take_interval"]


class Pages:
    """Reservation and fresh-range writes of a store handle, a part the engine holds (see the
    module docstring): the reservation record is its state; the data segment, the arrays it
    writes and the span mappings (``shares``, whose cells a copy reads) are passed in."""

    def __init__(self, *, layout: Layout, off: Offsets, dseg: Segment, hdr: memoryview, record: Record,
                 Kl: list[np.ndarray], Vl: list[np.ndarray], KS: np.ndarray | None, VS: np.ndarray | None,
                 tokens: np.ndarray, positions: np.ndarray, hashes: np.ndarray, full: list[int],
                 shares: Shares, dbase: int) -> None:
        self.layout, self._off, self._dseg, self.hdr = layout, off, dseg, hdr
        self._rec, self._reserved, self._owed = record, record.cells, record.owed
        self.Kl, self.Vl, self.KS, self.VS = Kl, Vl, KS, VS
        self.tokens, self.positions, self._hashes = tokens, positions, hashes
        self._full, self._wc = full, layout.window_cells  # full: the layers that are not sliding/chunked
        self._dbase = dbase  # address of the data segment's byte 0
        self.shares = shares

    def record(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This process's reservation record, dropped when the span epoch moved: a borrow in any
        process (or one rolled back) punches its range's pages out, in a transaction that moves
        the epoch, and a range recorded here might be one of them. Re-reserving allocated pages
        is one cheap fallocate; writing into a hole on a full /dev/shm is a SIGBUS."""
        e = self.hdr[_header.W_SPANS]
        if e != self._rec.at:
            clear(*self._reserved)  # (atomic for this process's other threads: intervals)
            self._rec.at = e
        return self._reserved

    def reserve(self, start: int, count: int, all_layers: bool = False, populate: bool = True) -> None:
        """Reserve the pages of cells [start, start + count) (all layers' for an encoder range).

        Pages, once allocated, stay (but for a borrower's punched span: ``record``), so cells
        this process has reserved before are skipped: a fresh range written by copy_prefix or a move (crash
        recovery never writes over committed cells) is often one reserved by an earlier move.

        ``populate=False`` (full layers only) allocates without pre-faulting: the cells are
        then *owed* (``_owed``) until written through the descriptor (``put``, which skips
        the zeroing a pre-fault does, see Segment.write) or pre-faulted by ``fill`` before
        writes through the mapping. Either way no SIGBUS: the pages exist."""
        if count <= 0:
            return
        done = self.record()[all_layers]
        if covers(done, start, start + count):
            if populate:
                self.fill(start, count)
            return
        defer = not (populate or all_layers)
        mark_pages(self.hdr, start + count)  # (a write handle's own range: marked already)
        self._dseg.reserve(self.cell_ranges(start, count, all_layers), populate=not defer)
        add_interval(done, start, start + count)
        if defer:
            add_interval(self._owed, start, start + count)
        else:
            take_interval(self._owed, start, start + count)

    def room(self, start: int, lo: int, hi: int) -> None:
        """Allocate and pre-fault the pages of cells [start + lo, start + hi) before a write
        handle's appends write them through the mapping (CacheFullError, nothing written, when
        /dev/shm or memory is full; ``_sequence/room.py`` decides the chunk)."""
        self.reserve(start + lo, hi - lo)

    def stage(self, start: int, count: int) -> None:
        """A range a restore fills through the descriptor: the room is checked now; the writes
        allocate the pages of the arrays they fill (a full /dev/shm is then CacheFullError from
        the write, in cells no row points to) and ``_settle`` the rest."""
        mark_pages(self.hdr, start + count)  # the writes allocate pages there
        if not covers(self.record()[False], start, start + count):
            self._dseg.check_room(self.cell_ranges(start, count))

    def settle(self, start: int, length: int, count: int) -> None:
        """After a restore wrote the arrays of cells [start, start + length) of a staged range of
        ``count`` cells: reserve the rest of those cells' pages (token ids, positions), pre-faulted
        for the writes through the mapping that follow (the cells after ``length``: as the
        appends need them, see the module docstring)."""
        done = self.record()[False]
        if not length:
            return
        if not covers(done, start, start + length):
            self._dseg.reserve(self.cell_ranges(start, length, kv=False))
            add_interval(done, start, start + length)
            take_interval(self._owed, start, start + length)
        else:
            take_interval(self._owed, start, start + length)
            self.fill(start, count)

    def cell_ranges(self, start: int, count: int, all_layers: bool = False,
                     kv: bool = True, small: bool = True) -> list[tuple[int, int]]:
        """The data segment's (offset, length) byte ranges of cells [start, start + count):
        ``kv``: K and V of the full layers (every layer's with ``all_layers``); ``small``: token
        ids, positions, hashes and int8 scales."""
        off = self._off
        cb = off.cell_bytes
        ranges = []
        if kv:
            layers = range(self.layout.layers) if all_layers else self._full
            ranges += [(base + layer * off.layer_stride + start * cb, count * cb)
                       for base in (off.k_off, off.v_off) for layer in layers]
        if small:
            ranges += [(base + start * 8, count * 8) for base in (off.tokens_off, off.positions_off, off.hashes_off)]
            sb = self.layout.kv_heads * 4
            ranges += [(base + layer * off.scale_stride + start * sb, count * sb)
                       for base in (off.ks_off, off.vs_off) for layer in range(self.layout.layers) if off.scale_stride]
        return ranges

    def fill(self, start: int, count: int) -> None:
        """Pre-fault the owed cells of [start, start + count) (see reserve) for writes through
        the mapping: appends after a prefill, the rest of a moved range."""
        for a, b in take_interval(self._owed, start, start + count):
            self._dseg.populate(self.cell_ranges(a, b - a))

    def before_appends(self, start: int, count: int) -> None:
        """A write handle's first write other than extend: pre-fault what is owed of its range."""
        if self.any_owed(start, count):
            self.fill(start, count)

    def any_owed(self, start: int, count: int) -> bool:
        """Whether any cell of [start, start + count) is owed (see reserve)."""
        return overlaps(self._owed, start, start + count)

    def fresh(self, start: int, count: int) -> bool:
        """Whether cells [start, start + count) are all owed: allocated, never touched here."""
        return covers(self._owed, start, start + count)

    def put(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Write ``src`` into ``dst``, a C-contiguous view of the data segment, through the
        descriptor (Segment.write: no zeroing of new pages; CacheFullError when full)."""
        src = np.ascontiguousarray(src, dst.dtype)
        if src.shape != dst.shape or not dst.flags.c_contiguous:
            raise ValueError(f"put: {src.shape} into {dst.shape}")
        if src.nbytes:
            self._dseg.write(dst.ctypes.data - self._dbase, memoryview(src).cast("B"))  # type: ignore[arg-type]  # an ndarray is a buffer

    def file_copier(self, dst: np.ndarray) -> Callable[[int, int, int, int], None]:
        base, seg = dst.ctypes.data - self._dbase, self._dseg

        def copy(pos: int, fd: int, offset: int, n: int) -> None:
            if pos < 0 or pos + n > dst.nbytes:
                raise ValueError(f"a copy of {n} bytes at {pos} into an array of {dst.nbytes}")
            seg.copy_in(fd, offset, base + pos, n)
        return copy

    def write_new(self, start: int, length: int, cap: int, k_all: np.ndarray, v_all: np.ndarray) -> bool:
        """Sequence.extend into fresh cells: K and V of tokens [length, length + n) of the
        range at ``start`` written through the descriptor into pages allocated for exactly them,
        then what is owed of the range pre-faulted for the appends that follow. False (nothing
        written) when this path does not apply: cells touched before, sliding/chunked layers, a
        quantized dtype, growth, or less than a page of each array (a decode step's extend:
        tmpfs zeroes the rest of a page a write starts, so the descriptor would save no zeroing
        and cost 2 * layers writes and a fallocate per array each step, where the appends
        through the mapping pay one pre-faulted chunk per many tokens)."""
        lay = self.layout
        n = k_all.shape[1]
        a = start + length
        if (lay.bounded or self.KS is not None or lay.dtype == "bfloat16" or not n or length + n > cap
                or n * self._off.cell_bytes < mmap.PAGESIZE
                or k_all.dtype.kind not in "fiu" or v_all.dtype.kind not in "fiu"):
            return self._not_new(start, cap)
        self.reserve(a, n, populate=False)  # exactly its pages (a full /dev/shm: nothing written)
        if not self.fresh(a, n):
            return self._not_new(start, cap)
        for arrs, src in ((self.Kl, k_all), (self.Vl, v_all)):
            for layer in range(lay.layers):
                self.put(arrs[layer][a : a + n], src[layer])
        take_interval(self._owed, a, a + n)  # written: the commit's token ids first-touch their few pages
        self.fill(start, cap)
        return True

    def _not_new(self, start: int, cap: int) -> bool:
        """write_new does not apply: the appends that write instead go through the mapping."""
        if self.any_owed(start, cap):
            self.fill(start, cap)
        return False

    def reserve_window(self, slot: int) -> None:
        """Reserve a slot's buffer in every bounded layer (its size never changes)."""
        off, wc = self._off, self._wc
        if not wc:
            return
        cb = off.cell_bytes
        self._dseg.reserve([(base + j * off.w_stride + 2 * slot * wc * cb, 2 * wc * cb)  # both buffers
                            for base in (off.wk_off, off.wv_off) for j in range(len(self.layout.bounded))])

    def page_unit_reserve(self, start: int, count: int, skip: int) -> None:
        """Reserve the first ``count`` cells of a borrower's range: every array's pages but those
        of its first ``skip`` cells: K/V and scales there are borrowed, and their token ids,
        positions and hashes are written through the descriptor by the copy that follows
        (``copy_cells`` with ``kv_from``: pwrite allocates their pages, and a full /dev/shm is
        CacheFullError from it, never a SIGBUS; three fallocate calls fewer a create).
        What ``reserve(start + skip, count - skip, populate=False)`` does."""
        off = self._off  # (their room is checked as a reservation's would be: a clear refusal first)
        self._dseg.check_room([(base + start * 8, skip * 8) for base in (off.tokens_off, off.positions_off,
                                                                          off.hashes_off)])
        done = self.record()[False]
        if count <= skip or covers(done, start + skip, start + count):
            return
        mark_pages(self.hdr, start + count)
        self._dseg.reserve(self.cell_ranges(start + skip, count - skip), populate=False)
        add_interval(done, start + skip, start + count)
        add_interval(self._owed, start + skip, start + count)

    def copy_cells(self, src: int, dst: int, n: int, kv_from: int = 0) -> None:
        """Copy n cells of every layer, token id and position (lock held; overlap-safe); K, V and
        scales from cell ``kv_from`` on only (the cells before it are borrowed: _engine/spans/lending.py)."""
        if n <= 0 or src == dst:
            return
        tok_src, tok_dst, tok_n = src, dst, n
        src, dst, n = src + kv_from, dst + kv_from, n - kv_from
        if n > 0:  # (none: a reuse that borrows all it copies)
            # into fresh cells (a new range): through the descriptor, which skips zeroing them
            fresh = self.fresh(dst, n) and (src + n <= dst or dst + n <= src)
            # cells of a span not mapped here: read where they physically are, never as holes
            parts = self.shares.sources(src, src + n) if self.shares.unmapped else [(src, src, n)]
            # one layer at a time: a 4-D slice over all layers spans overlapping address
            # extents, and numpy would then copy through a temporary (half the bandwidth)
            for arrs in ([self.Kl[i] for i in self._full], [self.Vl[i] for i in self._full], self.KS, self.VS):
                for layer in arrs if arrs is not None else ():
                    for at, read, c in parts:
                        to = dst + at - src
                        if fresh:
                            self.put(layer[to : to + c], layer[read : read + c])
                        else:
                            np.copyto(layer[to : to + c], layer[read : read + c])
            if fresh:
                take_interval(self._owed, dst, dst + n)
        src, dst, n = tok_src, tok_dst, tok_n
        for arr in (self.tokens, self.positions, self._hashes):
            if kv_from:  # a borrower's fresh range: their pages are allocated by this write
                self.put(arr[dst : dst + n], arr[src : src + n])  # (page_unit_reserve)
            else:
                arr[dst : dst + n] = arr[src : src + n]
