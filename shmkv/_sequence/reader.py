"""The reading side of a ``Sequence`` handle: its row read under the seqlock, where each
layer's tokens sit, views and copies of them, masks, ``can_resume`` and waiting.

A ``SeqReader`` serves any handle (read or write) and holds no lease. Readers read the
row's generation, the row, the generation again, and retry while it moved (a structural
operation in progress: docs/design.md §3); when ``_engine.table.seqlock.HANDLE``'s tries are used
up they wait it out under the store's reading lock. ``Sequence`` delegates to it; the writer part and the
structural operations use its addressing (``span``, ``cells``, ``view``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from shmkv._engine.table import dtypes as _dtypes
from shmkv._sequence import quant as _quant
from shmkv._sequence import waiting as _waiting
from shmkv._engine.checks import count, ints
from shmkv._engine.attachment import read_only_view
from shmkv._engine.table.header import CAPACITY, GEN, ID, LENGTH, LIVE, START, STATE, W_SPANS, WBUF, WIN_OFF
from shmkv._engine.locking.journal import INCARNATION_SHIFT
from shmkv._engine.table.seqlock import HANDLE, seqlocked
from shmkv._sequence.visibility import attention_mask, visible_from
from shmkv.errors import InvalidArgumentError, SequenceNotFound, StoreClosedError

if TYPE_CHECKING:
    from shmkv._engine.table.header import Layout
    from shmkv._engine.port import Port

Arrays = list[np.ndarray]
Words = tuple[int, int, int, int, int, int, int]  # state, id, start, capacity, length, window offset, buffer
T = TypeVar("T")


_Geometry = tuple[int, tuple[int, int], str, bool, list[bool], int]
_geometries: dict[int, tuple[Layout, _Geometry]] = {}


def _geometry(lay: Layout) -> _Geometry:
    """What a handle needs of its store's layout: layers, (kv_heads, head_dim), dtype, whether
    stored as is (zero-copy reads, fast appends), which layers are full, window cells.

    Worked out once per layout, not per handle (Layout's properties compute each time, and a
    handle is made per request: this keeps ``store.sequence(id)`` cheap)."""
    hit = _geometries.get(id(lay))
    if hit is not None and hit[0] is lay:
        return hit[1]
    bounded = set(lay.bounded)
    geo = (lay.layers, (lay.kv_heads, lay.head_dim), lay.dtype, lay.dtype in _dtypes.PLAIN,
           [i not in bounded for i in range(lay.layers)], lay.window_cells)
    if len(_geometries) > 64:  # stores come and go: keep only recent layouts
        _geometries.clear()
    _geometries[id(lay)] = (lay, geo)
    return geo


class SeqReader:
    """Seqlocked reads of one sequence row, and the cell-addressing of its layers.

    Built by ``Sequence`` from its store's narrow core (``port``, see ``_engine/port.py``; this part
    never reaches into the store): what it reads often is copied into its own slots.

    The short names of the hot path (the writer, ``SeqWriter``, copies most of them):

    ======== ================================================================================
    name     what it is
    ======== ================================================================================
    L        layers
    cell     (kv_heads, head_dim): the shape of one token's cell in one layer
    plain    the storage dtype is read as is (not int8 or bfloat16 bits): zero-copy views
    isfull   per layer: a full-attention layer (else sliding/chunked: a window buffer)
    wc       window cells a slot has per buffer on sliding/chunked layers
    Kr, Vr   per layer: read-only views of all cells (K, V) of the store
    KS, VS   per layer: int8 scales (one float32 per cell and head), None on float stores
    row      this sequence's row of the table (int64 memoryview; ``_engine.table.header`` columns)
    inc      the row's incarnation when this handle was made (a freed row's is stale)
    wbase    first cell of the row's active window buffer as the latest ``span`` saw it
    reading  the port's reading lock, and ``owned`` its lock_owned: bound once, passed to every
             seqlocked read (``_engine.table.seqlock``)
    rows     the engine's rows part (``_engine/table/rows.py``): the row's words off the hot path
    ======== ================================================================================

    The writer's (``SeqWriter``) beyond these:

    ======== ================================================================================
    name     what it is
    ======== ================================================================================
    r        the handle's reader part
    Kw, Vw   per layer: writable views of all cells of the store (full layers) or of the
             window buffers (sliding/chunked layers)
    start    first cell of this sequence's range, as last refreshed
    base     per layer: the cell that holds token 0 (window layers: in the active buffer)
    lim      per layer: how many tokens fit before the layer needs room (growth, compaction)
    vfrom    per layer: the first token the layer still holds (window layers drop older ones)
    cached   (start, capacity, window offset, window base) that base/lim/vfrom were computed for
    pending  per layer: tokens appended and not yet committed
    gen      the row generation this handle's addressing was computed at
    port     the store's engine (its narrow core, ``_engine.port.Port``): the structural calls
             (``locked``, ``changing``, ``wcell``, ``rewrite``, ``relocate``) go through it
    waddr    address of the row's futex word (the low half of LENGTH) for ``Sequence.wait``
    ======== ================================================================================
    """

    __slots__ = ("KS", "Kr", "L", "VS", "Vr", "arena", "cell", "dtype", "id", "inc", "isfull", "owned", "plain",
                 "port", "positions", "reading", "row", "rows", "shares", "slot", "tokens", "wbase", "wc")

    def __init__(self, port: Port, seq_id: int, slot: int, row: memoryview) -> None:
        self.port = port
        self.id = seq_id
        self.slot = slot
        self.row = row
        # which life of the row this handle is on (``_engine/locking/journal.py``, invariant 8)
        self.inc = row[GEN] >> INCARNATION_SHIFT
        self.L, self.cell, self.dtype, self.plain, self.isfull, self.wc = _geometry(port.layout)
        self.wbase = 0  # first cell of its active window buffer: set by every span
        self.Kr, self.Vr = port.Kr, port.Vr  # read-only per-layer views, shared by handles
        self.KS, self.VS = port.KSl, port.VSl  # int8 scales per layer, else None
        self.arena = (port.K, port.V, port.KS, port.VS)  # main-arena K, V (and scales) of every layer: encoders
        self.tokens, self.positions = port.tokens, port.positions
        # bound once here: every seqlocked read passes them (the rest of the port is called through it)
        self.reading, self.owned = port.reading, port.lock_owned
        self.shares = port.shares  # shared prefix pages: the mapping a read needs current (mapped)
        self.rows = port.rows  # (kept: a closed store's handle still reads its own row's words)

    # -- the row ---------------------------------------------------------------------

    def check(self) -> None:
        if self.port.closed:
            raise StoreClosedError(f"store {self.port.name!r} is closed; sequence {self.id} is unusable")

    def _freed(self) -> SequenceNotFound:
        return SequenceNotFound(f"sequence {self.id} of store {self.port.name!r} was freed")

    def words(self) -> Words:
        """The row's words a reader needs, as they are now (torn while a structural op runs)."""
        row = self.row
        return row[STATE], row[ID], row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF], row[WBUF]

    def settled_words(self) -> Words:
        """The row's words under ``reading`` (read-only attachments see a dead operation rolled back)."""
        return self.rows.settled_words(self.slot)

    def live(self, words: Words) -> tuple[int, int, int, int]:
        """(start, capacity, length, window offset) of consistent ``words``; SequenceNotFound if
        the sequence was freed. Sets ``wbase``."""
        state, sid, start, cap, length, woff, wbuf = words
        if state != LIVE or sid != self.id or self.row[GEN] >> INCARNATION_SHIFT != self.inc:
            raise self._freed()
        self.wbase = (2 * self.slot + wbuf) * self.wc
        return start, cap, length, woff

    def mapped(self, read: Callable[[], T]) -> T:
        """``read()`` (a seqlocked read of rows) with this process's mapping of shared prefix pages
        current before and after it (``_engine/spans/mappings.py``, 1): the cells of what it read are the
        ones the table says."""
        sh = self.shares
        while True:
            e = sh.applied
            if sh.hdr[W_SPANS] != e:
                sh.sync(self.reading, self.port.settled_row)
                continue
            value = read()
            if sh.hdr[W_SPANS] == e and sh.applied == e:
                return value

    def span(self) -> tuple[int, int, int, int]:
        """A consistent (start, capacity, length, window offset) of the row (seqlock read)."""
        if self.port.closed:  # check() and live() inlined: seq.length, keys() and views come here
            self.check()
        sh = self.shares
        e = sh.applied
        words = seqlocked(self.row, GEN, self.words, HANDLE, self.settled_words, hold=self.reading, mine=self.owned)
        if sh.hdr[W_SPANS] != e or sh.applied != e:  # spans changed meanwhile, or not mapped yet
            words = self.mapped(lambda: seqlocked(self.row, GEN, self.words, HANDLE, self.settled_words,
                                                  hold=self.reading, mine=self.owned))
        state, sid, start, cap, length, woff, wbuf = words
        if state != LIVE or sid != self.id or self.row[GEN] >> INCARNATION_SHIFT != self.inc:
            raise self._freed()
        self.wbase = (2 * self.slot + wbuf) * self.wc
        return start, cap, length, woff

    def span_unlocked(self) -> tuple[int, int, int, int]:
        """The row's span with the store lock held (nothing changes it meanwhile)."""
        row = self.row  # live(words()) inlined: every structural op (a truncate per speculative step)
        if row[STATE] != LIVE or row[ID] != self.id or row[GEN] >> INCARNATION_SHIFT != self.inc:
            raise self._freed()
        self.wbase = (2 * self.slot + row[WBUF]) * self.wc
        return row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF]

    def consistent(self, read: Callable[[], T]) -> T:
        """``read()`` of this sequence's row state (its meta record) under its seqlock."""
        self.check()

        def settled() -> tuple[Words, T]:
            # a dead process's transaction: its rows (and meta records) as the rollback leaves them
            return self.settled_words(), read()

        words, value = seqlocked(self.row, GEN, lambda: (self.words(), read()), HANDLE, settled, hold=self.reading)
        self.live(words)
        return value

    # -- where tokens sit ----------------------------------------------------------------

    def layer(self, layer: object) -> int:
        """``layer`` checked: an int in [0, layers)."""
        if type(layer) is not int:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
                raise InvalidArgumentError(f"layer={layer!r} must be an int in [0, {self.L})")
            layer = int(layer)
        if not 0 <= layer < self.L:
            raise InvalidArgumentError(
                f"layer={layer} is out of range: the store has layers=0..{self.L - 1}"
            )
        return layer

    def cells(self, layer: int, start: int, woff: int, a: int, b: int) -> tuple[int, int]:
        """Cells of tokens [a, b) of ``layer`` (a >= woff on sliding/chunked layers).

        Token i of a full layer is cell ``start + i``; of a sliding/chunked layer, cell
        ``wbase + i - woff`` of that layer's window region (``wbase``: the latest span's).
        """
        if self.isfull[layer]:
            return start + a, start + b
        return self.wbase + a - woff, self.wbase + b - woff

    def first(self, layer: int, woff: int) -> int:
        """Index of the oldest token ``layer`` holds."""
        return 0 if self.isfull[layer] else woff

    def readable(self) -> None:
        """ShareError if this row's shared prefix pages are not mapped here (``Shares.unmapped``)."""
        if self.shares.unmapped:
            self.shares.readable(self.slot, f"sequence {self.id} of store {self.port.name!r}")

    def held(self, layer: int) -> tuple[int, int, int, int]:
        """(first cell, end cell, first token index, main-arena start) of what ``layer`` holds."""
        start, _, length, woff = self.span()
        self.readable()
        first = self.first(layer, woff)
        lo, hi = self.cells(layer, start, woff, first, length)
        return lo, hi, first, start

    # -- decoding --------------------------------------------------------------------------

    def view(self, which: str, layer: int, a: int, b: int) -> np.ndarray:
        """Cells [a, b) of a layer as the caller sees them (see decode)."""
        raw = (self.Kr if which == "k" else self.Vr)[layer][a:b]
        scales = self.KS if which == "k" else self.VS
        return self.decode(raw, None if scales is None else scales[layer][a:b])

    def decode(self, raw: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        """Stored cells as the caller sees them: zero-copy for plain dtypes and bfloat16
        with ml_dtypes; a dequantized float32 copy otherwise."""
        raw = read_only_view(raw)
        if self.plain:
            return raw
        if self.dtype == "bfloat16":
            return _quant.bf16_view(raw)
        assert scales is not None  # int8: every layer has its scales
        return _quant.dequantize_int8(raw, scales)

    # -- what Sequence's read methods return ------------------------------------------------

    def kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi, _, _ = self.held(layer)
        return self.view("k", layer, lo, hi), self.view("v", layer, lo, hi)

    def held_positions(self, layer: int) -> np.ndarray:
        lo, hi, first, start = self.held(layer)
        return read_only_view(self.positions[start + first : start + first + hi - lo])

    def mask(self, layer: int, query_positions: Any, pending: int) -> np.ndarray:
        """Sequence.mask, with ``pending`` tokens of this handle after the committed ones."""
        layer = self.layer(layer)
        q = np.asarray(query_positions)  # (a torch tensor too)
        q = ints("query_positions", q, q.size)
        if q.size and int(q.min()) < 0:
            raise InvalidArgumentError(f"mask: query_positions {q.tolist()[:8]} must be positions >= 0")
        start, _, length, woff = self.span()
        keys_pos = self.positions[start + self.first(layer, woff) : start + length]
        if pending:
            last = int(self.positions[start + length - 1]) if length else -1
            keys_pos = np.concatenate([keys_pos, np.arange(last + 1, last + 1 + pending)])
        return attention_mask(self.port.layout, layer, q, keys_pos)

    def can_resume(self, pos: int) -> bool:
        pos = count("pos", pos)
        start, _, length, woff = self.span()
        positions = self.positions[start : start + length]
        if pos > (int(positions[-1]) if length else -1) + 1:
            return False
        for layer in range(self.L):
            lo_pos = int(visible_from(self.port.layout, layer, pos))  # the oldest position it needs
            held = positions[self.first(layer, woff) :]
            held = held[(held >= lo_pos) & (held < pos)]  # increasing ints: size and ends decide
            if held.size != pos - lo_pos or (held.size and (held[0] != lo_pos or held[-1] != pos - 1)):
                return False
        return True

    def raw(self, which: str, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        lo, hi, _, _ = self.held(self.layer(layer))
        codes = (self.Kr if which == "k" else self.Vr)[layer][lo:hi]
        scales = self.KS if which == "k" else self.VS
        return codes, None if scales is None else read_only_view(scales[layer][lo:hi])

    def committed(self, ids: bool) -> np.ndarray:
        """Token ids (``ids``) or positions of the committed tokens, a read-only view."""
        start, _, length, _ = self.span()
        return read_only_view((self.tokens if ids else self.positions)[start : start + length])

    def iter_tokens(self, layer: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        layer = self.layer(layer)
        lo, hi, first, start = self.held(layer)
        k, v = self.view("k", layer, lo, hi), self.view("v", layer, lo, hi)
        n = hi - lo
        toks = self.tokens[start + first : start + first + n].tolist()
        poss = self.positions[start + first : start + first + n].tolist()
        for i in range(n):
            yield toks[i], poss[i], k[i], v[i]

    def head(self, kv: tuple[np.ndarray, np.ndarray], head: int, begin: int, end: int | None,
             ) -> tuple[np.ndarray, np.ndarray]:
        """Sequence.head: one KV head of ``kv`` (the layer's keys and values) over [begin, end)."""
        k, v = kv
        H = self.cell[0]
        if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or not 0 <= head < H:
            raise InvalidArgumentError(f"head={head!r} is out of range: kv_heads=0..{H - 1}")
        end = k.shape[0] if end is None else end
        if not 0 <= begin <= end <= k.shape[0]:
            raise InvalidArgumentError(f"head: need 0 <= begin <= end <= length, got {begin}, {end}, {k.shape[0]}")
        return k[begin:end, head], v[begin:end, head]

    def read(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the committed keys and values of ``layer`` under the seqlock."""
        layer = self.layer(layer)
        self.check()

        def copy(words: Words) -> tuple[Words, np.ndarray, np.ndarray]:
            self.readable()  # before the copy, after mapped()'s sync (not after it: holes, see test_02_read)
            _, _, start, _, length, woff, wbuf = words
            self.wbase = (2 * self.slot + wbuf) * self.wc
            lo, hi = self.cells(layer, start, woff, self.first(layer, woff), length)
            return words, np.array(self.view("k", layer, lo, hi)), np.array(self.view("v", layer, lo, hi))

        words, k, v = self.mapped(lambda: seqlocked(self.row, GEN, lambda: copy(self.words()), HANDLE,
                                                    lambda: copy(self.settled_words()), hold=self.reading))
        self.live(words)
        return k, v

    def encoder_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        layer = self.layer(layer)
        self.check()
        a, n = self.mapped(lambda: self.rows.encoder_seqlocked(self.row, self.slot, self.port.row, self.reading)
                           ) or (0, 0)
        K, V, KS, VS = self.arena
        ks = KS[layer, a : a + n] if KS is not None else None
        vs = VS[layer, a : a + n] if VS is not None else None
        return self.decode(K[layer, a : a + n], ks), self.decode(V[layer, a : a + n], vs)

    def encoder_length(self) -> int:
        self.check()
        enc = self.rows.encoder_range(self.row, self.port.row)
        return 0 if enc is None else int(enc[1])

    def torch_kv(self, layer: int, writable: tuple[Arrays, Arrays],
                 cells: tuple[int, int] | None = None) -> tuple[Any, Any]:
        """Sequence.torch_kv; ``writable``: the per-layer K and V bases of this attachment;
        ``cells``: the cells to show (the writer's, pending ones included), else what is held."""
        import torch

        layer = self.layer(layer)
        if cells is None:
            lo, hi, _, _ = self.held(layer)
        else:
            self.check()
            self.readable()
            lo, hi = cells
        out = []
        for which, arrays in (("k", writable[0]), ("v", writable[1])):
            if self.dtype == "int8":
                a = self.view(which, layer, lo, hi)  # a fresh dequantized array
                out.append(torch.from_numpy(a if a.flags.writeable else a.copy()))
                continue
            raw = arrays[layer][lo:hi] if not self.port.readonly else np.array(
                (self.Kr if which == "k" else self.Vr)[layer][lo:hi])
            if self.dtype == "bfloat16":
                out.append(torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16))
            else:
                out.append(torch.from_numpy(raw))
        return out[0], out[1]

    # -- waiting (see _sequence/waiting.py) ------------------------------------------------

    def length(self) -> int:
        return int(self.span()[2])

    def wait(self, length: int | None, timeout: float | None) -> int:
        return _waiting.wait(self, length, timeout)

    async def wait_async(self, length: int | None, timeout: float | None) -> int:
        return await _waiting.wait_async(self, length, timeout)


def extent(r: SeqReader) -> tuple[int, int, int, int]:
    """``r.span()`` without bringing this process's mapping of shared prefix pages up to date:
    for what reads no cells (``seq.length``, ``capacity``: a speculative step asks the length
    before each truncate). A read of cells goes through ``span``."""
    if r.port.closed:
        r.check()
    state, sid, start, cap, length, woff, wbuf = seqlocked(r.row, GEN, r.words, HANDLE, r.settled_words,
                                                           hold=r.reading, mine=r.owned)
    if state != LIVE or sid != r.id or r.row[GEN] >> INCARNATION_SHIFT != r.inc:
        raise r._freed()
    r.wbase = (2 * r.slot + wbuf) * r.wc
    return start, cap, length, woff
