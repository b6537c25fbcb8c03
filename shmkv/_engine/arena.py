"""Where the cells of a store go: free ranges, allocation, eviction, relocation, the window
buffers of sliding/chunked layers, encoder ranges, and cell copies (all under the store lock).
Their pages (reservation, writes through the descriptor): ``_pages``."""

from __future__ import annotations

import weakref

import numpy as np

from shmkv._engine import crash as _crash
from shmkv._engine import header as _header
from shmkv._engine.port import Port
from shmkv._engine.header import (
    WBUF,
    CAPACITY,
    ID,
    LEASE_PID,
    LENGTH,
    START,
    ENC_SLOT,
    ENCODER,
    LIVE,
    STATE,
    WIN_OFF,
    CLEAN,
    FINISHED,
    FLAGS,
    IDX_BLOCKS,
    NOINDEX,
    RECENCY,
    leads,
    with_leads,
)
from shmkv._engine.prefix_hash import LEAD, lead_levels
from shmkv.errors import CacheFullError, NotSupportedError
from shmkv._engine.pages import Pages, take_interval


def port(store: Arena) -> Port:
    """``store``'s narrow core: what ``Sequence`` and its parts work through (see ``_port``)."""
    ref = store._port
    p = ref() if ref is not None else None
    return p if p is not None else store._open_port()


class Arena(Pages):
    """The cell-placing half of a store handle (the table and the lock are ``Core``'s)."""

    # Its Port, made once and kept while a handle holds it: the store holds it weakly, as the
    # port holds the store's bound methods (a cycle would leave a dropped store to the cyclic GC).
    _port: weakref.ref[Port] | None = None

    def _open_port(self) -> Port:
        p = Port(K=self._K, V=self._V, KS=self._KS, VS=self._VS, Kl=self._Kl, Vl=self._Vl, Kr=self._Kr, Vr=self._Vr,
                 KSl=self._KSl, VSl=self._VSl, tokens=self._tokens, positions=self._positions,
                 row=self._row, settled_row=self._settled_row, locked=self._locked, reading=self._reading,
                 lock_owned=self._lock.owned,
                 changing=self._changing, transaction=self._transaction,
                 new_incarnation=self._new_incarnation, check_not_leased_by_other=self._check_not_leased_by_other,
                 relocate=self._relocate, rewrite=self._rewrite, set_encoder=self._set_encoder,
                 copy_all_layers=self._copy_all_layers, wcell=self._wcell, kv_bytes=self._kv_bytes,
                 free_row=self._free_row, get_meta=self._get_meta, set_meta=self._set_meta,
                 index_blocks=self._index_blocks, touch=self._touch,
                 waiters=self._waiters, ro_waiters=self._ro_waiters, length_addr0=self._length_addr0,
                 waiting=self._waiting,
                 hdr=self._hdr, table_np=self._table_np, lock_path=self._lock_path, check_open=self._check_open,
                 check_writable=self._check_writable, slot_of=self._slot_of, alloc=self._alloc,
                 reserve_window=self._reserve_window, drop_encoder=self._drop_encoder, restored=self._restored)
        self._port = weakref.ref(p)
        return p

    def _kv_bytes(self, layers: int) -> int:
        """Bytes of K and V (and int8 scales) of one token in ``layers`` layers."""
        scales = self.layout.kv_heads * 4 if self._KS is not None else 0
        return 2 * layers * (self._off.cell_bytes + scales)

    def _free_slot(self, what: str, evict: bool = False, protect: int = -1, near: int = 0) -> int:
        """A free row of the sequence table (lock held), or CacheFullError: the first at or
        after row ``near`` (wrapping around).

        ``evict``: evict finished sequences (least recently used first, never row ``protect``)
        when no row is free."""
        free = np.flatnonzero(self._table_np[:, STATE] == 0)
        if free.size == 0 and evict and self._evict(0, 1, protect):
            free = np.flatnonzero(self._table_np[:, STATE] == 0)
        if free.size == 0:
            raise CacheFullError(
                f"store {self.name!r} has no free slot for {what}: all max_seqs={self.layout.max_seqs} rows hold "
                "sequences or encoder caches; free some, or create the store with a larger max_seqs="
            )
        i = int(np.searchsorted(free, near)) if near else 0
        return int(free[i if i < free.size else 0])

    def _free_ranges(self, taken: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """Gaps between the live ranges (and ``taken`` ones being staged by a restore), in order,
        as (start, size) (lock held).

        Kept per process while current (``_engine/free_ranges.py``), so a create or free costs
        the same with 16 or 4096 sequences; derived again from the table after another process's
        change or a recovery: nothing recovery must rebuild is stored."""
        if taken:
            return self._derive_free_ranges(taken)
        gaps = self._free.cached(self._hdr)
        if gaps is None:
            gaps = self._derive_free_ranges()
            self._free.derived(self._hdr, gaps)
        return gaps

    def _derive_free_ranges(self, taken: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """The free ranges derived from the table (a sort of the live rows' starts, nearly sorted
        already: cheap), ~30 us at 4096 sequences."""
        t = self._table_np
        used = t[:, STATE] != 0
        starts, caps = t[:, START][used], t[:, CAPACITY][used]  # a column first: a cheaper gather
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
        gap_ends[-1] = self.layout.max_tokens
        sizes = gap_ends - gap_starts
        keep = np.flatnonzero(sizes > 0)
        return list(zip(gap_starts[keep].tolist(), sizes[keep].tolist(), strict=True))

    def _alloc(self, capacity: int, taken: list[tuple[int, int]] | None = None, all_layers: bool = False,
               evict: bool = False, protect: int | tuple[int, ...] = -1, *, populate: bool = True,
               stage: bool = False) -> int:
        """First-fit a range of ``capacity`` cells (lock held); reserve its pages.

        ``evict``: evict finished sequences (least recently used first, never row ``protect``,
        or the rows of a tuple) when no free range is large enough. ``populate``: see _reserve;
        ``stage``: see _stage."""
        gaps = self._free_ranges(taken)
        fit = next((start for start, size in gaps if size >= capacity), None)
        if fit is None and evict and self._evict(capacity, 0, protect):
            gaps = self._free_ranges(taken)
            fit = next((start for start, size in gaps if size >= capacity), None)
        if fit is not None:
            if stage:
                self._stage(fit, capacity)
            else:
                self._reserve(fit, capacity, all_layers, populate)
            return fit
        raise CacheFullError(
            f"store {self.name!r} has no free range of {capacity} token cells "
            f"({sum(s for _, s in gaps)} of max_tokens={self.layout.max_tokens} free, fragmented or used): "
            "free or truncate sequences, or create the store with a larger max_tokens="
        )

    def _evict(self, cells: int, rows: int, protect: int | tuple[int, ...] = -1) -> bool:
        """Evict the fewest least-recently-used finished sequences after which a free range of
        ``cells`` cells and ``rows`` free table rows exist (lock held). Evicts nothing and returns
        False when evicting every finished sequence would not be enough (DESIGN §8)."""
        t = self._table_np
        kept = (protect,) if isinstance(protect, int) else protect  # the operation's own rows
        cand = [int(i) for i in np.flatnonzero((t[:, STATE] == LIVE) & ((t[:, FLAGS] & FINISHED) != 0))
                if i not in kept and not self._lease_holder(self._row(int(i)))[1]]  # never a live lease
        if not cand:
            return False
        cand.sort(key=lambda i: int(t[i, RECENCY]))
        enc = {i: int(t[i, ENC_SLOT]) - 1 for i in cand}  # an evicted sequence frees its encoder row too
        used = [int(i) for i in np.flatnonzero(t[:, STATE] != 0)]
        free_rows = self.layout.max_seqs - len(used)

        def fits(gone: set[int]) -> bool:
            if free_rows + len(gone) < rows:
                return False
            if not cells:
                return True
            live = sorted((int(t[i, START]), int(t[i, CAPACITY])) for i in used if i not in gone)
            pos = 0
            for start, cap in live:
                if start - pos >= cells:
                    return True
                pos = max(pos, start + cap)
            return self.layout.max_tokens - pos >= cells

        every = set(cand) | {e for e in enc.values() if e >= 0}
        if not fits(every):
            return False
        gone: set[int] = set()
        chosen = []
        for i in cand:
            chosen.append(i)
            gone.add(i)
            if enc[i] >= 0:
                gone.add(enc[i])
            if fits(gone):
                break
        for i in chosen:
            self._free_row(i)
            self._hdr[_header.W_EVICTIONS] += 1
        return True

    def _free_row(self, slot: int) -> None:
        """Free a sequence's row and its encoder row (lock held). Its index entries become
        invalid by themselves (see _prefix)."""
        row = self._row(slot)
        enc = row[ENC_SLOT] - 1
        lost = self._index.displaced_by(slot)
        with self._changing(row):
            self._drop_encoder(row)
            _crash.point("free.row")
            row[STATE] = 0
            row[LENGTH] = 0
            row[CAPACITY] = 0
            row[LEASE_PID] = 0
            row[ID] = 0
            row[FLAGS] = 0
            row[IDX_BLOCKS] = 0
            self._log_meta(slot)
            self._meta[slot, :8] = 0
        # complete: out of the undo log, so the unit's later use of its cells stays safe (rule 4)
        self._forget(slot, *([enc] if enc >= 0 else []))
        if lost:  # holders this one displaced from the index get their entries back if need be
            self._hdr[_header.W_INDEX_USED] += self._index.rehome(lost)

    def _set_meta(self, slot: int, packed: bytes) -> None:
        """Write a sequence's packed metadata (lock held, row changing)."""
        self._log_meta(slot)
        rec = self._meta[slot]
        rec[8 : 8 + len(packed)] = np.frombuffer(packed, np.uint8)
        rec[:8] = np.frombuffer(len(packed).to_bytes(8, "little"), np.uint8)

    def _get_meta(self, slot: int) -> bytes:
        """A sequence's packed metadata, as stored (the caller checks the row's seqlock); while
        another process's transaction logged it, as its rollback leaves it (_journal, 7)."""
        rec = self._settled_meta(slot) if self._hdr[_header.W_UNDO_COUNT] and not self._depth else self._meta[slot]
        n = int.from_bytes(rec[:8].tobytes(), "little")
        return bytes(rec[8 : 8 + min(n, _header.META_BYTES)].tobytes())

    def _touch(self, row: memoryview) -> None:
        """Mark a use of a sequence for LRU eviction (lock held)."""
        clock = self._hdr[_header.W_CLOCK] + 1
        self._hdr[_header.W_CLOCK] = clock
        row[RECENCY] = clock

    def _index_blocks(self, slot: int, upto: int, adopt: bool = False) -> None:
        """Index the sequence's whole blocks up to token ``upto`` (lock held); set NOINDEX when a
        block cannot be (a token id -1, tokens moved by remove or shift_left). ``adopt``: also
        add entries for its blocks [0, IDX_BLOCKS), whose hashes came with copied cells."""
        row = self._row(slot)
        hdr = self._hdr
        if self._index.full(hdr[_header.W_INDEX_USED] + upto // 16 + len(LEAD)):
            hdr[_header.W_INDEX_USED] = self._index.rebuild()
        if adopt:
            hdr[_header.W_INDEX_USED] += self._index.adopt(slot)
        hdr[_header.W_INDEX_USED] += self._index.index_blocks(slot, upto)
        if row[IDX_BLOCKS] < upto // 16:
            row[FLAGS] |= NOINDEX

    def _restored(self, slot: int, finished: bool, clean: int, meta: bytes) -> None:
        """A sequence a snapshot restore just published (lock held; called oldest use first):
        its prefix-cache state, a fresh recency, and its blocks in the index."""
        row = self._row(slot)
        # finished (evictable) only while nobody holds its lease: a restore over a sequence this
        # process writes keeps it the writer's
        row[FLAGS] = FINISHED if finished and not self._lease_holder(row)[1] else 0
        row[CLEAN] = clean
        row[IDX_BLOCKS] = 0
        with self._changing(row):
            self._set_meta(slot, meta)
        self._touch(row)
        self._index_blocks(slot, row[LENGTH])

    def _wcell(self, slot: int, wbuf: int) -> int:
        """First cell of window buffer ``wbuf`` (0 or 1) of ``slot`` in the bounded layers' arrays."""
        return (2 * slot + wbuf) * self._wc

    def _set_encoder(self, parent: memoryview, n: int, start: int | None = None, slot: int | None = None) -> int:
        """Give the sequence on ``parent`` a fresh encoder row of ``n`` cells (lock held, parent
        changing); the old one is freed. ``start``: a range already reserved for it.
        Returns the new range's first cell."""
        # the new row and range first, then the old encoder goes: its cells are not reused here
        if slot is None:
            slot = self._free_slot("an encoder cache")
        if start is None:
            start = self._alloc(max(n, 1), all_layers=True)
        self._drop_encoder(parent)
        row = self._row(slot)
        with self._changing(row):
            row[ID], row[START], row[CAPACITY], row[LENGTH] = parent[ID], start, max(n, 1), n
            row[STATE] = ENCODER
        parent[ENC_SLOT] = slot + 1
        return start

    def _drop_encoder(self, parent: memoryview) -> None:
        if parent[ENC_SLOT]:
            row = self._row(parent[ENC_SLOT] - 1)
            with self._changing(row):
                row[STATE] = 0
                row[LENGTH] = row[CAPACITY] = row[ID] = 0
            parent[ENC_SLOT] = 0

    def _copy_all_layers(self, src: int, dst: int, n: int) -> None:
        """Copy n cells of every layer's main-arena K/V (and scales): encoder ranges."""
        for arr in (self._K, self._V, self._KS, self._VS):
            if arr is not None and n:
                for layer in range(self.layout.layers):
                    np.copyto(arr[layer, dst : dst + n], arr[layer, src : src + n])

    def _copy_window(self, a: int, b: int, n: int) -> None:
        """Copy n cells from cell a to cell b of every bounded layer's window array."""
        if n <= 0 or a == b:
            return
        for layer in self.layout.bounded:
            for arr in (self._Kl[layer], self._Vl[layer]):
                np.copyto(arr[b : b + n], arr[a : a + n])

    def _rewrite(self, slot: int, full: list[tuple[int, int, int]], window: list[tuple[int, int, int]],
                 capacity: int | None = None, protect: int = -1) -> tuple[int, int]:
        """New content for a sequence, written where no row points (crash recovery, rule 1):
        ``full`` parts (src token, dst token, n) into a fresh range of ``capacity`` cells (default:
        the same), ``window`` parts (src, dst, n) as offsets into the slot's active and other window
        buffers. Returns (new start, new WBUF) for the caller to switch the row to (lock held)."""
        row = self._row(slot)
        start, wb = row[START], row[WBUF]
        cap = row[CAPACITY] if capacity is None else capacity
        new_start = self._alloc(cap, evict=True, protect=protect, populate=False)
        for src, dst, n in full:
            self._copy_cells(start + src, new_start + dst, n)
        self._fill(new_start, cap)
        a0, b0 = self._wcell(slot, wb), self._wcell(slot, 1 - wb)
        for src, dst, n in window:
            self._copy_window(a0 + src, b0 + dst, n)
        return new_start, 1 - wb

    def _copy_cells(self, src: int, dst: int, n: int) -> None:
        """Copy n cells of every layer, token id and position (lock held; overlap-safe)."""
        if n <= 0 or src == dst:
            return
        # into fresh cells (a new range): through the descriptor, which skips zeroing them
        fresh = self._fresh(dst, n) and (src + n <= dst or dst + n <= src)
        # one layer at a time: a 4-D slice over all layers spans overlapping address
        # extents, and numpy would then copy through a temporary (half the bandwidth)
        for arrs in ([self._Kl[i] for i in self._full], [self._Vl[i] for i in self._full], self._KS, self._VS):
            for layer in arrs if arrs is not None else ():
                if fresh:
                    self._put(layer[dst : dst + n], layer[src : src + n])
                else:
                    np.copyto(layer[dst : dst + n], layer[src : src + n])
        if fresh:
            take_interval(self._owed, dst, dst + n)
        self._tokens[dst : dst + n] = self._tokens[src : src + n]
        self._positions[dst : dst + n] = self._positions[src : src + n]
        self._hashes[dst : dst + n] = self._hashes[src : src + n]

    def _new_row(self, capacity: int, protect: int = -1, near: int = 0) -> tuple[int, int]:
        """A free table row (the first at or after row ``near``) and a reserved range for a new
        sequence (lock held), evicting finished sequences other than row ``protect`` when there
        is no room."""
        has_row = bool((self._table_np[:, STATE] == 0).any())
        fit = next((start for start, size in self._free_ranges() if size >= capacity), None)
        if not has_row or fit is None:
            # one plan for the row and the cells together: evict only if both then fit
            self._evict(capacity, 1, protect)
            fit = None  # the ranges changed: _alloc looks again (and names the shortfall)
        slot = self._free_slot("a new sequence", near=near)
        # allocated, not pre-faulted: a prefill (extend) writes it through the descriptor and
        # pre-faults the rest then (_write_new); a first append pre-faults it all (before_appends)
        if fit is None:
            fit = self._alloc(capacity, populate=False)
        else:  # the free ranges were just scanned: no second scan on the create path
            self._reserve(fit, capacity, populate=False)
        self._reserve_window(slot)
        return slot, fit

    def _copy_prefix_rows(self, s_slot: int, d_slot: int, n: int, *, held: bool = False) -> None:
        """copy_prefix between rows (lock held, ids checked): dst's content becomes src's first
        n tokens, and dst's whole blocks join the prefix index.

        Sliding/chunked layers: ``held=False`` (a reused prefix) copies only what a next token
        needs (``keep`` tokens); ``held=True`` (``Store.copy_prefix``, so ``fork`` and
        ``regather``) every token src holds below n, so a copy of a whole sequence holds exactly
        what src holds on every layer (a batch of copies stays one ``[B, T]`` batch, and a crop
        the source could take, the copy can take too: tests/test_rewind.py, and beam search on
        sliding models in tests/test_transformers_windows.py)."""
        s_row, d_row = self._row(s_slot), self._row(d_slot)
        s_off = s_row[WIN_OFF]
        need = self.layout.resume_from(n)  # the oldest token a next token needs on bounded layers
        if self.layout.bounded and s_off > need:
            raise NotSupportedError(
                f"copy_prefix: the sliding/chunked layers of sequence {s_row[ID]} hold tokens {s_off}.. only; "
                f"a prefix of n={n} needs tokens from {need} on"
            )
        # what the next tokens need (or, held=True, everything), from what src holds
        lo = s_off if held else max(s_off, n - self.layout.keep, 0)
        src_win = self._wcell(s_slot, s_row[WBUF]) + lo - s_off
        with self._changing(d_row):
            if d_row[LENGTH] == 0 and n <= d_row[CAPACITY]:
                # dst holds nothing committed: its own cells and window buffer are free to write
                self._copy_cells(s_row[START], d_row[START], n)
                self._copy_window(src_win, self._wcell(d_slot, d_row[WBUF]), n - lo)
                _crash.point("copy_prefix.copied")
            else:  # never over dst's committed cells: a fresh range and dst's other window buffer
                # never evict the operation's own rows (a finished, unleased src or dst is a candidate)
                new_start = self._alloc(max(n, d_row[CAPACITY]), evict=True, protect=(s_slot, d_slot),
                                        populate=False)
                self._copy_cells(s_row[START], new_start, n)
                self._fill(new_start, max(n, d_row[CAPACITY]))
                wb = 1 - d_row[WBUF]
                self._copy_window(src_win, self._wcell(d_slot, wb), n - lo)
                _crash.point("copy_prefix.copied")
                d_row[START], d_row[CAPACITY], d_row[WBUF] = new_start, max(n, d_row[CAPACITY]), wb
            d_row[WIN_OFF] = lo if self.layout.bounded else 0
            d_row[LENGTH] = n
            clean = s_row[CLEAN]
            d_row[CLEAN] = -1 if clean < 0 or clean >= n else clean
            # the copied hashes are valid for src's indexed blocks: dst's entries start from them
            d_row[IDX_BLOCKS] = min(s_row[IDX_BLOCKS], n // 16)
            d_row[FLAGS] = with_leads(d_row[FLAGS], min(leads(s_row[FLAGS]), lead_levels(n))) & ~NOINDEX
            self._index_blocks(d_slot, n, adopt=True)

    def _relocate(self, slot: int, row: memoryview, needed: int, keep: int, protect: int = -1) -> None:
        """Give a sequence at least ``needed`` cells, keeping its first ``keep`` (lock held, row changing).

        Tried in order: grow in place into the free cells after the range;
        slide down into free cells before it (plus any after); move to a free
        range elsewhere. Sizes tried: twice the capacity, then exactly ``needed``.
        """
        start, cap = row[START], row[CAPACITY]
        new_cap = min(max(needed, 2 * cap), self.layout.max_tokens)
        gaps = self._free_ranges()
        before = next((g for g in gaps if g[0] + g[1] == start), (start, 0))
        after = next((g for g in gaps if g[0] == start + cap), (start + cap, 0))
        for want in dict.fromkeys((new_cap, needed)):
            if cap + after[1] >= want:
                self._reserve(start + cap, want - cap)
                row[CAPACITY] = want
                _crash.point("grow.extended")
                return
            new_start = max(before[0], start + cap + after[1] - want)
            if before[1] + cap + after[1] >= want and new_start + keep <= start:
                # slide down into free cells before it, never over its own committed cells
                self._reserve(new_start, want)
                self._copy_cells(start, new_start, keep)  # (no overlap: the condition above)
                _crash.point("grow.slid")
                row[START], row[CAPACITY] = new_start, want
                return
        for want in dict.fromkeys((new_cap, needed)):
            try:
                new_start = self._alloc(want, evict=want == needed, protect=protect, populate=False)
            except CacheFullError:
                continue
            self._copy_cells(start, new_start, keep)
            self._fill(new_start, want)  # the appends that made it grow go on there
            _crash.point("grow.copied")
            row[START] = new_start
            _crash.point("grow.switched")
            row[CAPACITY] = want
            return
        raise CacheFullError(
            f"store {self.name!r}: sequence {row[ID]} needs {needed} token cells and no free range "
            f"is that large ({sum(s for _, s in gaps)} of max_tokens={self.layout.max_tokens} free): "
            "free or truncate sequences, or create the store with a larger max_tokens="
        )
