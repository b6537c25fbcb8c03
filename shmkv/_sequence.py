"""Sequence: one token stream of a store, through a read handle or a write (lease) handle.

What invalidates a view: the arrays returned by ``keys()``, ``values()``,
``kv()`` and ``append()`` are zero-copy windows on shared memory. They stay
mapped as long as they live (closing the store cannot unmap them), but their
*content* is only guaranteed while no structural operation touches the
sequence: ``truncate``, ``remove``, ``shift_left``, ``copy_prefix`` into it,
a move when it outgrows its range, ``free``. Take ``.copy()`` to keep data
across those, or use ``read(layer)``, which copies under the seqlock.
Views are read-only: committed cells are immutable.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from . import _crash, _dtypes, _pages, _quant, _segment
from ._header import (
    CAPACITY, CLEAN, ENC_SLOT, FINISHED, FLAGS, GEN, ID, IDX_BLOCKS, LEASE_PID, LEASE_TOKEN, LENGTH, LIVE, NOINDEX,
    START, STATE, WBUF, WIN_OFF,
)
from ._header import META_BYTES
from ._checks import count, ints
from ._lease import live_writers, release_row
from ._prefix_hash import BLOCK
from ._visibility import attention_mask, visible_from
from .errors import LockTimeout
from .errors import (
    CacheFullError,
    NotSupportedError,
    InvalidArgumentError,
    LeaseError,
    ReadOnlyError,
    SequenceNotFound,
    StoreClosedError,
)

if TYPE_CHECKING:
    from ._store import Store

ShiftFn = Callable[[int, np.ndarray, int], np.ndarray]
_SPIN = 2000  # seqlock retries before falling back to the store lock


def _real(dt: np.dtype) -> bool:
    return dt.kind in "fiu" or dt == _quant.BF16


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class Sequence:
    """A handle on one sequence. Get one from ``store.create_sequence()`` or ``store.sequence(id)``.

    A write handle holds the sequence's lease: it alone appends, commits and
    makes structural changes. Any number of read handles, in any process, see
    the committed tokens.
    """

    def __init__(self, store: Store, seq_id: int, slot: int, *, write: bool, token: int) -> None:
        self._store = store
        self.id = int(seq_id)
        self._slot = slot
        self._row = store._row(slot)
        self._token = token
        self._write = write
        self._epoch = _segment.fork_epoch
        lay = store.layout
        self._L = lay.layers
        self._cell = (lay.kv_heads, lay.head_dim)
        self._Kw, self._Vw = store._Kl, store._Vl  # writable per-layer bases (None read-only)
        self._Kr, self._Vr = store._Kr, store._Vr  # read-only per-layer views, shared by handles
        self._dtype = lay.dtype
        self._plain = lay.dtype in _dtypes.PLAIN  # stored as is: zero-copy reads, fast appends
        self._KS, self._VS = store._KSl, store._VSl
        self._pending = [0] * self._L
        self._gen = -1
        bounded = set(lay.bounded)
        self._isfull = [i not in bounded for i in range(self._L)]
        self._wc = lay.window_cells
        self._wbase = 0  # first cell of its active window buffer: set by every _span
        self._start = 0
        self._fin: weakref.finalize | None = None
        self._refresh()
        if write:
            live_writers[token] = self
            self._fin = weakref.finalize(self, release_row, self._row, token, os.getpid(), self._epoch)

    def __repr__(self) -> str:
        kind = "write" if self._write else "read"
        try:
            return f"<shmkv.Sequence id={self.id} length={self.length} capacity={self.capacity} {kind}>"
        except Exception:  # repr of a dead handle
            return f"<shmkv.Sequence id={self.id} {kind} (unavailable)>"

    @property
    def store(self) -> Store:
        """The store this sequence lives in (through this handle's attachment)."""
        return self._store

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as a *read* handle: a lease never travels; the receiver takes its own.
        return (_unpickle_sequence, (self._store, self.id))

    # -- row access ----------------------------------------------------------

    def _check(self) -> None:
        if self._store._closed:
            raise StoreClosedError(f"store {self._store.name!r} is closed; sequence {self.id} is unusable")

    def _span(self) -> tuple[int, int, int, int]:
        """A consistent (start, capacity, length, window offset) of the row (seqlock read)."""
        self._check()
        row = self._row
        for i in range(_SPIN):
            g = row[GEN]
            if not g & 1:
                state, sid, start, cap, length = row[STATE], row[ID], row[START], row[CAPACITY], row[LENGTH]
                woff, wbuf = row[WIN_OFF], row[WBUF]
                if row[GEN] == g:
                    if state != LIVE or sid != self.id:
                        raise SequenceNotFound(
                            f"sequence {self.id} of store {self._store.name!r} was freed"
                        )
                    self._wbase = (2 * self._slot + wbuf) * self._wc
                    return start, cap, length, woff
            if i > 50:
                time.sleep(0)
        with self._store._reading():
            return self._span_settled()

    def _span_settled(self) -> tuple[int, int, int, int]:
        """The row's span under _reading (read-only attachments see a dead operation rolled back)."""
        r = self._store._settled_row(self._slot)
        if r[STATE] != LIVE or r[ID] != self.id:
            raise SequenceNotFound(f"sequence {self.id} of store {self._store.name!r} was freed")
        self._wbase = (2 * self._slot + r[WBUF]) * self._wc
        return r[START], r[CAPACITY], r[LENGTH], r[WIN_OFF]

    def _span_unlocked(self) -> tuple[int, int, int, int]:
        row = self._row
        if row[STATE] != LIVE or row[ID] != self.id:
            raise SequenceNotFound(f"sequence {self.id} of store {self._store.name!r} was freed")
        self._wbase = (2 * self._slot + row[WBUF]) * self._wc
        return row[START], row[CAPACITY], row[LENGTH], row[WIN_OFF]

    def _refresh(self) -> None:
        g = self._row[GEN]
        start, cap, _, woff = self._span()
        self._gen = g if not g & 1 else -1
        self._cache(start, cap, woff)

    def _cache(self, start: int, cap: int, woff: int) -> None:
        """Per-layer addressing for the writer's hot path.

        Token i of a full layer is cell ``start + i``; of a sliding/chunked layer,
        cell ``slot * window_cells + i - woff`` of that layer's window region.
        """
        self._start = start
        self._wbase = (2 * self._slot + self._row[WBUF]) * self._wc  # the writer's own row
        wbase = self._wbase - woff
        self._base = [start if f else wbase for f in self._isfull]  # cell of token 0
        # token index limit: the range's capacity bounds every layer (token ids and positions
        # need a cell even where only sliding/chunked layers hold K/V), the buffer bounds those
        wlim = min(woff + self._wc, cap)
        self._lim = [cap if f else wlim for f in self._isfull]
        self._vfrom = [start if f else self._wbase for f in self._isfull]  # first kept cell

    def _cells(self, layer: int, start: int, woff: int, a: int, b: int) -> tuple[int, int]:
        """Cells of tokens [a, b) of ``layer`` (a >= woff on sliding/chunked layers)."""
        if self._isfull[layer]:
            return start + a, start + b
        return self._wbase + a - woff, self._wbase + b - woff

    def _first(self, layer: int, woff: int) -> int:
        """Index of the oldest token ``layer`` holds."""
        return 0 if self._isfull[layer] else woff

    def _need_writer(self, what: str) -> None:
        self._check()
        if not self._write:
            raise ReadOnlyError(
                f"{what}: sequence {self.id} handle is read-only; take the lease with "
                f"store.sequence({self.id}, write=True)"
            )
        if self._epoch != _segment.fork_epoch:
            raise LeaseError(
                f"{what}: this write handle of sequence {self.id} was inherited across fork; "
                f"take the lease in this process with store.sequence({self.id}, write=True)"
            )
        self._check()
        row = self._row
        if row[LEASE_TOKEN] != self._token:  # random per handle: no pid check (a syscall) needed
            self._write = False
            raise LeaseError(
                f"{what}: the lease on sequence {self.id} was taken over (pid {row[LEASE_PID]}); "
                "this handle is now read-only"
            )
        if row[GEN] != self._gen:
            # a structural change we did not make through this handle (e.g. copy_prefix
            # into it): drop uncommitted tokens, reload the range
            self._pending = [0] * self._L
            self._refresh()
            if what != "extend":  # a new range (create_sequence): pre-faulted before writes through the mapping
                _pages.before_appends(self._store, self._start, row[CAPACITY])

    def _layer(self, layer: object) -> int:
        if type(layer) is not int:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
                raise InvalidArgumentError(f"layer={layer!r} must be an int in [0, {self._L})")
            layer = int(layer)
        if not 0 <= layer < self._L:
            raise InvalidArgumentError(
                f"layer={layer} is out of range: the store has layers=0..{self._L - 1}"
            )
        return layer

    def _kv_arrays(self, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
        k = np.asarray(k)
        v = np.asarray(v)
        if k.shape[-2:] != self._cell or k.shape != v.shape or k.ndim not in (2, 3):
            H, D = self._cell
            raise InvalidArgumentError(
                f"k shape {k.shape} and v shape {v.shape} must both be [n, kv_heads={H}, head_dim={D}] "
                f"(or [{H}, {D}] for one token)"
            )
        if not (_real(k.dtype) and _real(v.dtype)):
            raise InvalidArgumentError(
                f"k dtype {k.dtype} / v dtype {v.dtype}: keys and values must be real numbers (float or int)"
            )
        if k.ndim == 2:
            k = k[None]
            v = v[None]
        if self._dtype == "int8":
            _quant.check_finite(k, "k")
            _quant.check_finite(v, "v")
        return k, v

    # -- writing -------------------------------------------------------------

    def append(self, layer: int, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
        """Write ``n`` new tokens of one layer after the sequence's end (not yet visible).

        Args:
            layer: layer index.
            k, v: ``[n, kv_heads, head_dim]`` (or ``[kv_heads, head_dim]`` for one token),
                any float dtype; cast to the storage dtype.

        Returns:
            Read-only views ``(keys, values)`` of this layer, ``[length + pending, kv_heads,
            head_dim]``: the committed tokens followed by this handle's pending ones.

        The tokens become visible to other processes at ``commit()``, once every
        layer has the same number of pending tokens.
        """
        # Fast path (the per-token hot loop; see tools/bench.py decode): every check
        # below is what _need_writer/_layer/_kv_arrays do, inlined for the common case.
        row = self._row
        if (self._plain and self._write and row[LEASE_TOKEN] == self._token and row[GEN] == self._gen
                and self._epoch == _segment.fork_epoch and type(layer) is int and 0 <= layer < self._L
                and type(k) is np.ndarray and type(v) is np.ndarray and k.dtype.kind == "f"
                and v.dtype.kind == "f"):
            ks = k.shape
            if ks == self._cell and v.shape == ks:
                n = 1
            elif len(ks) == 3 and ks[1:] == self._cell and v.shape == ks:
                n = ks[0]
            else:
                return self._append_checked(layer, k, v)
            length = row[LENGTH]
            p = self._pending[layer]
            if length + p + n > self._lim[layer]:
                return self._append_checked(layer, k, v)
            s = self._base[layer] + length + p
            if n == 1 and len(ks) == 2:
                self._Kw[layer][s] = k
                self._Vw[layer][s] = v
            else:
                self._Kw[layer][s : s + n] = k
                self._Vw[layer][s : s + n] = v
            self._pending[layer] = p + n
            first = self._vfrom[layer]
            return self._Kr[layer][first : s + n], self._Vr[layer][first : s + n]
        return self._append_checked(layer, k, v)

    def _append_checked(self, layer: Any, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
        self._need_writer("append")
        layer = self._layer(layer)
        k, v = self._kv_arrays(k, v)
        n = k.shape[0]
        length = self._row[LENGTH]
        p = self._pending[layer]
        end = length + p + n
        if end > self._lim[layer]:
            if end > self._row[CAPACITY]:
                self._grow(end)
            if end > self._lim[layer]:  # a sliding/chunked layer's buffer is full
                self._compact(layer, end)
        s = self._base[layer] + length + p
        if self._plain:
            self._Kw[layer][s : s + n] = k
            self._Vw[layer][s : s + n] = v
        else:
            self._encode(layer, s, k, v)
        self._pending[layer] = p + n
        first = self._vfrom[layer]
        return self._view("k", layer, first, s + n), self._view("v", layer, first, s + n)

    def _compact(self, layer: int, end: int) -> None:
        """Make room in the window buffers: keep the last ``keep`` committed tokens (and
        every layer's pending ones) at the buffer's start. A structural change."""
        st = self._store
        keep_n = st.layout.keep
        with st._locked():
            row = self._row
            length, woff = row[LENGTH], row[WIN_OFF]
            new_off = max(woff, length - keep_n)
            if end - new_off > self._wc:
                raise CacheFullError(
                    f"append: {end - length} new tokens on sliding/chunked layer {layer} exceed the "
                    f"{self._wc - keep_n} a window buffer takes between commits; commit in smaller steps, "
                    f"or create the store with a larger memory= (now {st.layout.step})"
                )
            with st._changing(row):
                # into the other buffer, then switch: the committed tokens stay intact (crash recovery)
                wb = row[WBUF]
                a0, b0 = st._wcell(self._slot, wb) + new_off - woff, st._wcell(self._slot, 1 - wb)
                for lay_i in st.layout.bounded:
                    n = length - new_off + self._pending[lay_i]
                    for arr in (self._Kw[lay_i], self._Vw[lay_i]):
                        np.copyto(arr[b0 : b0 + n], arr[a0 : a0 + n])
                _crash.point("compact.copied")
                row[WBUF] = 1 - wb
                row[WIN_OFF] = new_off
            self._gen = row[GEN]
            self._cache(row[START], row[CAPACITY], new_off)

    def _encode(self, layer: int, s: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write k, v (already checked) into cells s.. of layer in the storage encoding."""
        self._write_rows(self._Kw[layer], None if self._KS is None else self._KS[layer], s, k)
        self._write_rows(self._Vw[layer], None if self._VS is None else self._VS[layer], s, v)

    def _write_rows(self, codes: np.ndarray, scales: np.ndarray | None, s: int, x: np.ndarray) -> None:
        """Store ``x`` [n, kv_heads, head_dim] at cells s.. of one layer's array (and int8 scales),
        in the storage encoding: the one place values are encoded."""
        n = x.shape[0]
        if self._dtype == "int8":
            q, sc = _quant.quantize_int8(x)
            codes[s : s + n] = q
            scales[s : s + n] = sc  # type: ignore[index]
        elif self._dtype == "bfloat16":
            codes[s : s + n] = _quant.to_bf16(x)
        else:
            codes[s : s + n] = x

    def _view(self, which: str, layer: int, a: int, b: int) -> np.ndarray:
        """Cells [a, b) of a layer as the caller sees them (see _decode)."""
        raw = (self._Kr if which == "k" else self._Vr)[layer][a:b]
        scales = self._KS if which == "k" else self._VS
        return self._decode(raw, None if scales is None else scales[layer][a:b])

    def _decode(self, raw: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        """Stored cells as the caller sees them: zero-copy for plain dtypes and bfloat16
        with ml_dtypes; a dequantized float32 copy otherwise."""
        raw = _readonly(raw)
        if self._plain:
            return raw
        if self._dtype == "bfloat16":
            return _quant.bf16_view(raw)
        return _quant.dequantize_int8(raw, scales)  # type: ignore[arg-type]

    # -- encoder (cross-attention) cache -------------------------------------------

    def set_encoder(self, k_all: Any, v_all: Any) -> None:
        """Store this sequence's encoder keys and values ``[layers, n, kv_heads, head_dim]``.

        Position-independent and written once (a second call replaces them); every
        decode step reads them with :meth:`encoder_kv`, with no mask. Kept until the
        sequence is freed, carried by ``fork`` and by snapshots.
        """
        self._need_writer("set_encoder")
        k_all, v_all = np.asarray(k_all), np.asarray(v_all)
        H, D = self._cell
        if k_all.ndim != 4 or k_all.shape[0] != self._L or k_all.shape[2:] != (H, D) or v_all.shape != k_all.shape:
            raise InvalidArgumentError(
                f"set_encoder: k_all {k_all.shape} and v_all {v_all.shape} must both be "
                f"[layers={self._L}, n, kv_heads={H}, head_dim={D}]"
            )
        if not (_real(k_all.dtype) and _real(v_all.dtype)):
            raise InvalidArgumentError(f"set_encoder: dtypes {k_all.dtype}/{v_all.dtype} are not real numbers")
        if self._dtype == "int8":
            _quant.check_finite(k_all, "k_all")
            _quant.check_finite(v_all, "v_all")
        n = k_all.shape[1]
        st = self._store
        with st._locked():
            row = self._row
            self._span_unlocked()
            with st._changing(row):
                start = st._set_encoder(row, n)
                for layer in range(self._L):  # the main arena of every layer (st._K, not _Kw)
                    for x, arrs, scales in ((k_all[layer], st._K, st._KS), (v_all[layer], st._V, st._VS)):
                        self._write_rows(arrs[layer], None if scales is None else scales[layer], start, x)
                _crash.point("set_encoder.written")
            self._gen = row[GEN]  # our own change: pending decoder tokens stay

    def encoder_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The encoder keys and values of ``layer`` ``[n, kv_heads, head_dim]`` (read-only views;
        int8: dequantized copies); empty when none was set."""
        layer = self._layer(layer)
        self._check()
        st = self._store
        row = self._row
        a = n = 0
        for _ in range(_SPIN):
            g = row[GEN]
            enc = row[ENC_SLOT]
            if not g & 1:
                erow = st._row(enc - 1) if enc else None
                a = erow[START] if erow is not None else 0
                n = erow[LENGTH] if erow is not None else 0
                if row[GEN] == g:
                    break
            time.sleep(0)
        else:  # a structural change ran all along: wait it out (never a silently empty result)
            with st._reading():
                r = st._settled_row(self._slot)
                enc = r[ENC_SLOT]
                e = st._settled_row(enc - 1) if enc else None
                a, n = (e[START], e[LENGTH]) if e is not None else (0, 0)
        ks = st._KS[layer, a : a + n] if st._KS is not None else None
        vs = st._VS[layer, a : a + n] if st._VS is not None else None
        return self._decode(st._K[layer, a : a + n], ks), self._decode(st._V[layer, a : a + n], vs)

    @property
    def encoder_length(self) -> int:
        enc = self._row[ENC_SLOT]
        return int(self._store._row(enc - 1)[LENGTH]) if enc else 0

    def _grow(self, needed: int) -> None:
        st = self._store
        if needed > st.layout.max_tokens:  # refused before anything moves or grows
            raise CacheFullError(
                f"sequence {self.id} would hold {needed} tokens, more than store {st.name!r}'s "
                f"max_tokens={st.layout.max_tokens}: truncate or shift_left it, or create the store with "
                "a larger max_tokens= (nothing was written)"
            )
        keep = self._row[LENGTH] + max(self._pending)
        with st._locked():
            row = self._row
            try:
                with st._changing(row):
                    st._relocate(self._slot, row, needed, keep)
            finally:  # our own change (or none): pending tokens stay valid
                self._gen = row[GEN]
                self._cache(row[START], row[CAPACITY], row[WIN_OFF])

    def commit(self, tokens: Any = None, positions: Any = None) -> int:
        """Publish the pending tokens of every layer; return the new length.

        Args:
            tokens: token ids of the pending tokens (``[n]`` ints), default -1.
            positions: their positions (``[n]`` ints, increasing, after the last
                committed position); default: the last position + 1 onwards.
        """
        self._need_writer("commit")
        pend = self._pending
        n = pend[0]
        if pend.count(n) != self._L:
            raise InvalidArgumentError(
                f"commit: layers have different pending token counts {pend}; append the same "
                "number of tokens to every layer before commit()"
            )
        length = self._row[LENGTH]
        st = self._store
        s = self._start + length
        last = int(st._positions[s - 1]) if length else -1
        if n == 0:
            if (tokens is not None and np.size(tokens)) or (positions is not None and np.size(positions)):
                raise InvalidArgumentError("commit: tokens/positions given but no token is pending")
            return length
        row = self._row
        if tokens is None:
            st._tokens[s : s + n] = -1
            if not row[FLAGS] & NOINDEX:  # cells without ids cannot be found by the prefix index
                row[FLAGS] |= NOINDEX
        else:
            st._tokens[s : s + n] = ints("tokens", tokens, n)
        if positions is None:
            if n == 1:
                st._positions[s] = last + 1
            else:
                st._positions[s : s + n] = np.arange(last + 1, last + 1 + n)
        else:
            pos = ints("positions", positions, n)
            if pos[0] <= last or (n > 1 and np.any(np.diff(pos) <= 0)):
                raise InvalidArgumentError(
                    f"commit: positions {pos.tolist()[:8]} must increase, after the last committed position {last}"
                )
            st._positions[s : s + n] = pos
        row[LENGTH] = length + n  # publish: one aligned 8-byte store, after the data
        self._pending = [0] * self._L
        if (length + n) // BLOCK > row[IDX_BLOCKS] and not row[FLAGS] & NOINDEX:
            self._index_committed(length + n)
        return length + n

    def _index_committed(self, length: int) -> None:
        """Put the blocks this commit completed into the prefix index: the store lock once per
        16 tokens (DESIGN §3). The tokens are committed whatever happens here: a lock timeout
        only delays the indexing to the next completed block."""
        st = self._store
        try:
            with st._locked():
                st._index_blocks(self._slot, length)
        except LockTimeout:
            pass

    def extend(self, k_all: Any, v_all: Any, tokens: Any = None, positions: Any = None) -> int:
        """Write ``n`` tokens of every layer and commit them; return the new length.

        Args:
            k_all, v_all: ``[layers, n, kv_heads, head_dim]``.
        """
        self._need_writer("extend")
        if any(self._pending):
            raise InvalidArgumentError(
                f"extend: sequence {self.id} has uncommitted appends {self._pending}; commit() them first"
            )
        k_all = np.asarray(k_all)
        v_all = np.asarray(v_all)
        H, D = self._cell
        if k_all.ndim != 4 or k_all.shape[0] != self._L or k_all.shape[2:] != (H, D) or v_all.shape != k_all.shape:
            raise InvalidArgumentError(
                f"extend: k_all {k_all.shape} and v_all {v_all.shape} must both be "
                f"[layers={self._L}, n, kv_heads={H}, head_dim={D}]"
            )
        n = k_all.shape[1]
        if self._dtype == "int8":
            _quant.check_finite(k_all, "k_all")
            _quant.check_finite(v_all, "v_all")
        if tokens is not None:
            ints("tokens", tokens, n)
        if positions is not None:
            ints("positions", positions, n)
        try:
            # fresh cells (a prefill): written through the segment's descriptor (no page zeroing)
            if _pages.write_new(self._store, self._start, self._row[LENGTH], self._row[CAPACITY], (k_all, v_all)):
                self._pending = [n] * self._L
            else:
                for layer in range(self._L):
                    self.append(layer, k_all[layer], v_all[layer])
            return self.commit(tokens, positions)
        except BaseException:
            self._pending = [0] * self._L
            raise

    # -- structural operations ---------------------------------------------------

    def _structural(self, what: str) -> Any:
        self._need_writer(what)
        return _Structural(self)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` committed tokens; drop pending ones.

        ``n`` beyond the length is clamped to it (the committed tokens stay), as
        Hugging Face's ``crop`` does: truncate never extends.
        """
        n = count("n", n)
        with self._structural("truncate") as row:
            n = min(n, row[LENGTH])
            self._check_resumable(row, n, "truncate")
            row[LENGTH] = n
            _crash.point("truncate.row")
            if n == 0:
                row[WIN_OFF] = 0
            _unindex_from(row, n)

    def _check_resumable(self, row: memoryview, new_len: int, what: str) -> None:
        """Refuse a change after which sliding/chunked layers would miss tokens a new one needs."""
        woff, keep = row[WIN_OFF], self._store.layout.keep
        if self._store.layout.bounded and woff and new_len and new_len - woff < keep:
            raise NotSupportedError(
                f"{what}: sliding/chunked layers of sequence {self.id} hold tokens from {woff} on; "
                f"a length of {new_len} would leave them {max(new_len - woff, 0)} of the {keep} a new "
                "token needs (keep at least that many, or clear())"
            )

    def clear(self) -> None:
        """Drop every token (the range stays reserved)."""
        self.truncate(0)

    def shift_left(self, n: int) -> None:
        """Drop the oldest ``n`` tokens (sliding window); the rest keep their positions."""
        n = count("n", n)
        with self._structural("shift_left") as row:
            length = row[LENGTH]
            if n > length:
                raise InvalidArgumentError(f"shift_left: n={n} exceeds the length {length} of sequence {self.id}")
            if n == 0:
                return
            woff = row[WIN_OFF]
            keep_from = max(n, woff)  # the oldest token the window buffers keep
            new_start, wb = self._store._rewrite(self._slot, [(n, 0, length - n)],
                                                 [(keep_from - woff, 0, length - keep_from)])
            _crash.point("shift_left.copied")
            row[START], row[WBUF] = new_start, wb
            row[WIN_OFF] = max(0, woff - n)
            row[LENGTH] = length - n
            if n:  # token 0 no longer sits at position 0: no longer a donor
                _taint(row, 0)

    def remove(self, begin: int, end: int, shift: ShiftFn | None = None) -> None:
        """Remove tokens ``[begin, end)``; later tokens move down and take the freed positions.

        The moved tokens' positions change by ``delta = positions[begin] -
        positions[end]`` (negative). ``shift(layer, keys, delta) -> keys``, if
        given, re-rotates their keys (RoPE shift) for each layer; it runs before
        anything changes, so an exception in it leaves the sequence as it was.
        """
        begin = count("begin", begin)
        end = count("end", end)
        with self._structural("remove") as row:
            length, start = row[LENGTH], row[START]
            if not begin <= end <= length:
                raise InvalidArgumentError(
                    f"remove: need 0 <= begin <= end <= length, got begin={begin} end={end} length={length}"
                )
            if begin == end:
                return
            st = self._store
            moved = length - end
            woff = row[WIN_OFF]
            if st.layout.bounded:
                if begin < woff:
                    raise NotSupportedError(
                        f"remove: sliding/chunked layers of sequence {self.id} no longer hold tokens "
                        f"before {woff}; remove from begin >= {woff}"
                    )
                if moved and shift is None:
                    raise NotSupportedError(
                        "remove: moved tokens take new positions, which sliding/chunked layers attend by; "
                        "pass shift=(layer, keys, delta) -> keys to re-rotate their keys"
                    )
                self._check_resumable(row, length - (end - begin), "remove")
            delta = int(st._positions[start + begin] - st._positions[start + end]) if moved else 0
            new_keys = []
            if shift is not None and moved:
                for layer in range(self._L):
                    lo, hi = self._cells(layer, start, woff, end, length)
                    src = np.array(self._view("k", layer, lo, hi), dtype=np.float32
                                   if not self._plain else None)
                    out = np.asarray(shift(layer, src, delta))
                    if out.shape != src.shape or out.dtype.kind != "f" or (
                            self._dtype == "int8" and not np.isfinite(out).all()):
                        raise InvalidArgumentError(
                            f"remove: shift() returned {out.shape} {out.dtype} for layer {layer}; "
                            f"it must return float keys shaped {src.shape}"
                        )
                    new_keys.append(out)
            # the result goes where no row points (a fresh range, the other window buffer), then the
            # row switches to it: a crash at any point leaves the sequence as it was
            new_start, wb = st._rewrite(self._slot, [(0, 0, begin), (end, begin, moved)],
                                        [(0, 0, begin - woff), (end - woff, begin - woff, moved)])
            new_wbase = st._wcell(self._slot, wb)
            if moved:
                st._positions[new_start + begin : new_start + begin + moved] += delta
                for layer, keys in enumerate(new_keys):
                    lo = new_start + begin if self._isfull[layer] else new_wbase + begin - woff
                    # re-encoded: values (and their scales) stay as moved
                    self._write_rows(self._Kw[layer], None if self._KS is None else self._KS[layer], lo, keys)
            _crash.point("remove.copied")
            row[START], row[WBUF] = new_start, wb
            row[LENGTH] = length - (end - begin)
            # the moved tokens were computed with the removed ones in context: not a prefix to reuse
            _taint(row, begin)

    def release(self) -> None:
        """Give up the write lease (pending tokens are dropped); the handle becomes a read handle."""
        if self._write and self._epoch == _segment.fork_epoch:
            self._drop_lease()

    def _drop_lease(self) -> None:
        row = self._row
        try:
            if row[LEASE_TOKEN] == self._token and row[LEASE_PID] == os.getpid():
                row[LEASE_PID] = 0
        except (ValueError, TypeError):
            pass
        self._write = False
        self._pending = [0] * self._L
        live_writers.pop(self._token, None)
        if self._fin is not None:
            self._fin.detach()

    def free(self) -> None:
        """Delete the sequence: its cells return to the store. Needs the lease, or no live holder."""
        st = self._store
        with st._locked():
            row = self._row
            self._span_unlocked()
            if not self._write:
                st._check_not_leased_by_other(row, self.id)
            else:
                self._need_writer("free")
            st._free_row(self._slot)
        if self._write:
            self._drop_lease()

    def finish(self) -> None:
        """The request is done: give up the lease and keep the sequence as a cached prefix.

        Other requests reuse its tokens through ``create_sequence(prefix=...)``; it is
        evicted, least recently used first, when a create or a growth needs room.
        ``store.sequence(id, write=True)`` takes it back (a chat's next turn), and it is then
        no longer evictable. Pending (uncommitted) tokens are dropped.
        """
        self._need_writer("finish")
        st = self._store
        with st._locked():
            row = self._row
            self._span_unlocked()
            row[FLAGS] |= FINISHED
            _crash.point("finish.flagged")
            st._touch(row)
            self._drop_lease()

    def fork(self, n: int | None = None, capacity: int | None = None) -> Sequence:
        """A new sequence holding this one's first ``n`` tokens (default: all); returns its write handle."""
        st = self._store
        with st._locked():
            length = self._span()[2]
            n = length if n is None else count("n", n)
            if n > length:
                raise InvalidArgumentError(f"fork: n={n} exceeds the length {length} of sequence {self.id}")
            cap = max(n, 1, self.capacity if capacity is None else count("capacity", capacity, 1))
            with st._unit():  # the child and its content: both, or after a crash neither
                child = st.create_sequence(capacity=cap, _protect=self._slot)  # never evict the parent for it
                _crash.point("fork.child")
                try:
                    st.copy_prefix(self.id, child.id, n)
                    enc = self._row[ENC_SLOT]
                    if enc:  # the child decodes against the same encoder output
                        erow = st._row(enc - 1)
                        src, m = erow[START], erow[LENGTH]
                        with st._changing(child._row):
                            dst = st._set_encoder(child._row, m)
                            st._copy_all_layers(src, dst, m)
                except BaseException:
                    child.free()
                    raise
            child._refresh()
        return child

    @property
    def meta(self) -> dict[str, Any]:
        """Small metadata of the sequence: a msgpack-able dict, at most 512 bytes packed.

        Written by the lease holder (``seq.meta = {"request": "r-17"}``, a whole dict at a
        time, under the store lock), read by any process (a replacement worker learns which
        request it serves), kept by snapshots, shown by ``shmkv info``. Each read returns a
        new dict: change it by assigning one. A new sequence (and a fork) starts with ``{}``.
        """
        packed = self._consistent(lambda: self._store._get_meta(self._slot))
        return msgpack.unpackb(packed) if packed else {}

    @meta.setter
    def meta(self, value: dict[str, Any]) -> None:
        self._need_writer("meta")
        if not isinstance(value, dict):
            raise InvalidArgumentError(f"meta must be a dict, got {type(value).__name__}")
        try:
            packed = msgpack.packb(value)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidArgumentError(
                f"meta {value!r:.80} cannot be packed ({e}): use str, int, float, bool, bytes, lists and dicts"
            ) from None
        if len(packed) > META_BYTES:
            raise InvalidArgumentError(
                f"meta packs to {len(packed)} bytes, more than the {META_BYTES} a sequence keeps: "
                "store an id here and the rest elsewhere"
            )
        st = self._store
        with st._locked():
            row = self._row
            self._span_unlocked()
            with st._changing(row):
                st._set_meta(self._slot, packed)
            self._gen = row[GEN]  # our own change: pending tokens stay

    def _consistent(self, read: Callable[[], Any]) -> Any:
        """``read()`` of this sequence's row state under its seqlock (retried while a structural
        operation runs; then under the store lock, or, read-only, until ``lock_timeout``)."""
        self._check()
        row = self._row
        t_end = None
        i = 0
        while True:
            g = row[GEN]
            if not g & 1:
                value = read()
                state, sid = row[STATE], row[ID]
                if row[GEN] == g:
                    if state != LIVE or sid != self.id:
                        raise SequenceNotFound(f"sequence {self.id} of store {self._store.name!r} was freed")
                    return value
            i += 1
            if i == _SPIN and not self._store.readonly:
                with self._store._locked():
                    self._span_unlocked()
                    return read()
            if i > 50:
                if t_end is None:
                    t_end = time.monotonic() + self._store.lock_timeout
                elif time.monotonic() > t_end:
                    raise LockTimeout(
                        f"sequence {self.id} of store {self._store.name!r} kept changing for "
                        f"{self._store.lock_timeout} s (lock_timeout=): a structural operation is stuck or long"
                    )
                time.sleep(0.0002)

    # -- reading -------------------------------------------------------------

    @property
    def length(self) -> int:
        """Committed tokens (what every process sees)."""
        return int(self._span()[2])

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return int(self._span()[1])

    @property
    def pending(self) -> int:
        """Tokens appended to every layer by this handle and not yet committed."""
        return min(self._pending)

    @property
    def remaining_capacity(self) -> int:
        """Tokens that fit before the sequence must grow (moving if needed)."""
        _, cap, length, _ = self._span()
        return int(cap - length - max(self._pending))

    @property
    def is_full(self) -> bool:
        return self.remaining_capacity <= 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the committed tokens (K and V of the layers that hold them, ids, positions)."""
        _, _, length, woff = self._span()
        st = self._store
        return length * st.bytes_per_token + (length - woff) * st._kv_bytes(len(st.layout.bounded))

    @property
    def writable(self) -> bool:
        """Whether this handle holds the write lease."""
        return self._write

    @property
    def lease_pid(self) -> int:
        return int(self._row[LEASE_PID])

    def _held(self, layer: int) -> tuple[int, int, int, int]:
        """(first cell, end cell, first token index, main-arena start) of what ``layer`` holds."""
        start, _, length, woff = self._span()
        first = self._first(layer, woff)
        lo, hi = self._cells(layer, start, woff, first, length)
        return lo, hi, first, start

    def keys(self, layer: int) -> np.ndarray:
        """Committed keys ``layer`` holds, ``[n, kv_heads, head_dim]``: a read-only zero-copy
        view; for int8 stores a dequantized float32 copy (bfloat16: a copy unless ml_dtypes).

        ``n`` is the length on full layers; sliding and chunked layers hold only the most
        recent tokens (``held_positions(layer)`` gives their positions).
        """
        lo, hi, _, _ = self._held(self._layer(layer))
        return self._view("k", layer, lo, hi)

    def values(self, layer: int) -> np.ndarray:
        """Committed values of ``layer``; see :meth:`keys`."""
        lo, hi, _, _ = self._held(self._layer(layer))
        return self._view("v", layer, lo, hi)

    def kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``(keys(layer), values(layer))`` taken at the same length."""
        lo, hi, _, _ = self._held(self._layer(layer))
        return self._view("k", layer, lo, hi), self._view("v", layer, lo, hi)

    def held_positions(self, layer: int) -> np.ndarray:
        """Positions of the committed tokens ``layer`` holds (rows of ``keys(layer)``)."""
        lo, hi, first, start = self._held(self._layer(layer))
        return _readonly(self._store._positions[start + first : start + first + hi - lo])

    def mask(self, layer: int, query_positions: Any) -> np.ndarray:
        """Additive float32 attention mask ``[q, n]`` for new tokens at ``query_positions``.

        Columns are what ``append(layer, ...)`` returned: the tokens ``layer`` holds,
        then this handle's pending ones (at the positions ``commit()`` would give them
        by default). 0 where the layer's kind lets the query see the key, -inf elsewhere:
        full ``p' <= p``; sliding ``p - window < p' <= p``; chunked
        ``p - p % chunk <= p' <= p``.
        """
        layer = self._layer(layer)
        q = ints("query_positions", query_positions, np.size(query_positions))
        start, _, length, woff = self._span()
        keys_pos = self._store._positions[start + self._first(layer, woff) : start + length]
        p = self._pending[layer]
        if p:
            last = int(self._store._positions[start + length - 1]) if length else -1
            keys_pos = np.concatenate([keys_pos, np.arange(last + 1, last + 1 + p)])
        return attention_mask(self._store.layout, layer, q, keys_pos)

    def can_resume(self, pos: int) -> bool:
        """Whether a new token at position ``pos`` finds every token it needs in every layer.

        It needs, per layer, each earlier position its kind lets it see; the sequence
        must hold them all (positions 0..pos-1 with none missing), and ``pos`` must not
        skip past the last committed position + 1.
        """
        pos = count("pos", pos)
        start, _, length, woff = self._span()
        positions = self._store._positions[start : start + length]
        if pos > (int(positions[-1]) if length else -1) + 1:
            return False
        for layer in range(self._L):
            lo_pos = int(visible_from(self._store.layout, layer, pos))  # the oldest position it needs
            held = positions[self._first(layer, woff) :]
            held = held[(held >= lo_pos) & (held < pos)]  # increasing ints: size and ends decide
            if held.size != pos - lo_pos or (held.size and (held[0] != lo_pos or held[-1] != pos - 1)):
                return False
        return True

    def raw_keys(self, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Stored keys of ``layer`` without any decoding: ``(codes, scales)`` zero-copy views.

        ``codes`` is the storage array (int8 codes, bfloat16 bits as uint16, or the
        floats); ``scales`` the int8 float32 scales ``[length, kv_heads]``, else None.
        """
        return self._raw("k", layer)

    def raw_values(self, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Stored values of ``layer``; see :meth:`raw_keys`."""
        return self._raw("v", layer)

    def _raw(self, which: str, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        lo, hi, _, _ = self._held(self._layer(layer))
        codes = (self._Kr if which == "k" else self._Vr)[layer][lo:hi]
        scales = self._KS if which == "k" else self._VS
        return codes, None if scales is None else _readonly(scales[layer][lo:hi])

    @property
    def tokens(self) -> np.ndarray:
        """Token ids of the committed tokens (read-only view; -1 where none was given)."""
        start, _, length, _ = self._span()
        return _readonly(self._store._tokens[start : start + length])

    @property
    def positions(self) -> np.ndarray:
        """Positions of the committed tokens (read-only view)."""
        start, _, length, _ = self._span()
        return _readonly(self._store._positions[start : start + length])

    def head(self, layer: int, head: int, begin: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of one KV head over tokens ``[begin, end)``: views ``[n, head_dim]``."""
        k, v = self.kv(layer)
        H = self._cell[0]
        if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or not 0 <= head < H:
            raise InvalidArgumentError(f"head={head!r} is out of range: kv_heads=0..{H - 1}")
        end = k.shape[0] if end is None else end
        if not 0 <= begin <= end <= k.shape[0]:
            raise InvalidArgumentError(f"head: need 0 <= begin <= end <= length, got {begin}, {end}, {k.shape[0]}")
        return k[begin:end, head], v[begin:end, head]

    def iter_tokens(self, layer: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """Yield ``(token_id, position, k, v)`` for each committed token of ``layer``."""
        layer = self._layer(layer)
        lo, hi, first, start = self._held(layer)
        k, v = self._view("k", layer, lo, hi), self._view("v", layer, lo, hi)
        n = hi - lo
        toks = self._store._tokens[start + first : start + first + n].tolist()
        poss = self._store._positions[start + first : start + first + n].tolist()
        for i in range(n):
            yield toks[i], poss[i], k[i], v[i]

    def read(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the committed keys and values of ``layer``, consistent even while
        structural operations run (seqlock: retried, then taken under the lock)."""
        layer = self._layer(layer)
        row = self._row
        for _ in range(_SPIN):
            g = row[GEN]
            if g & 1:
                time.sleep(0)
                continue
            lo, hi, _, _ = self._held(layer)
            k = np.array(self._view("k", layer, lo, hi))
            v = np.array(self._view("v", layer, lo, hi))
            if row[GEN] == g:
                return k, v
        with self._store._reading():  # read-only attachments too: a shared lock (crash recovery)
            start, _, length, woff = self._span_settled()
            lo, hi = self._cells(layer, start, woff, self._first(layer, woff), length)
            return np.array(self._view("k", layer, lo, hi)), np.array(self._view("v", layer, lo, hi))

    # -- waiting for tokens, torch tensors (issue 18) ---------------------------

    _WAIT_SPIN = 0.0002  # seq.wait: seconds of busy polling, then sleeps
    _WAIT_FIRST_SLEEP = 50e-6  # ... doubling up to
    _WAIT_MAX_SLEEP = 0.004

    def _wait_steps(self, length: int | None, timeout: float | None) -> Generator[float, None, int]:
        """The polling schedule of :meth:`wait`: yields the delay before the next look;
        its return value (StopIteration.value) is the length reached."""
        from .errors import WaitTimeout
        target = None if length is None else count("length", length)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise InvalidArgumentError(f"timeout={timeout!r} must be a number of seconds >= 0, or None")
        t0 = time.monotonic()
        first = self.length
        deadline = None if timeout is None else t0 + timeout
        spin_end = t0 + self._WAIT_SPIN
        delay = self._WAIT_FIRST_SLEEP
        while True:
            now_len = self.length  # SequenceNotFound once it is freed
            if now_len >= target if target is not None else now_len != first:
                return now_len
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                want = f"length {target}" if target is not None else f"a change from length {first}"
                raise WaitTimeout(
                    f"wait: sequence {self.id} of store {self._store.name!r} did not reach {want} within "
                    f"timeout={timeout} s (its length is {now_len}); pass a larger timeout= or None"
                )
            if now < spin_end:
                yield 0.0
            else:
                yield delay if deadline is None else min(delay, deadline - now)
                delay = min(delay * 2, self._WAIT_MAX_SLEEP)

    def wait(self, length: int | None = None, timeout: float | None = None) -> int:
        """Block until the committed length reaches ``length``; return the length then.

        ``length=None`` waits until the length differs from what it is at the call (a
        commit, or a truncate). Another process's commit is noticed within a few
        milliseconds: the length word is polled, busily for the first 0.2 ms, then with
        sleeps growing from 50 us to 4 ms (no futex: an idle waiter costs ~250 wake-ups
        a second). Works on read handles and read-only attachments.

        Raises:
            WaitTimeout: ``timeout`` seconds passed first (the message gives the length).
            SequenceNotFound: the sequence is freed (before or while waiting).
            StoreClosedError: the store handle is closed.

        Example:
            >>> n = seq.wait(len(seq) + 16, timeout=5.0)    # doctest: +SKIP
        """
        steps = self._wait_steps(length, timeout)
        try:
            while True:
                d = next(steps)
                time.sleep(d) if d else None
        except StopIteration as done:
            return int(done.value)

    async def wait_async(self, length: int | None = None, timeout: float | None = None) -> int:
        """:meth:`wait` for asyncio: polls with ``asyncio.sleep``, never blocking the event loop."""
        import asyncio

        steps = self._wait_steps(length, timeout)
        try:
            while True:
                await asyncio.sleep(next(steps))
        except StopIteration as done:
            return int(done.value)

    def torch_kv(self, layer: int) -> tuple[Any, Any]:
        """Committed keys and values of ``layer`` as torch tensors ``[n, kv_heads, head_dim]``.

        On a read-write attachment, for float32, float16, float64 and bfloat16 (its stored
        uint16 bits viewed as ``torch.bfloat16``), the tensors are zero-copy: **writing
        into them writes the shared cache** that every process reads. On a read-only
        attachment (its mapping cannot be written) and for int8 stores (dequantized to
        float32) they are copies. The same rules as :meth:`keys` say how long the content
        holds. torch is imported here: ``import shmkv`` never imports it.
        """
        import torch

        layer = self._layer(layer)
        lo, hi, _, _ = self._held(layer)
        st = self._store
        out = []
        for which, writable in (("k", st._Kl), ("v", st._Vl)):
            if self._dtype == "int8":
                a = self._view(which, layer, lo, hi)  # a fresh dequantized array
                out.append(torch.from_numpy(a if a.flags.writeable else a.copy()))
                continue
            raw = writable[layer][lo:hi] if not st.readonly else np.array(
                (self._Kr if which == "k" else self._Vr)[layer][lo:hi])
            if self._dtype == "bfloat16":
                out.append(torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16))
            else:
                out.append(torch.from_numpy(raw))
        return out[0], out[1]


class _Structural:
    """Context of a structural op on one sequence: store lock + seqlock bracket.

    The handle's cached range and pending counts are refreshed afterwards.
    """

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self._locked = seq._store._locked()
        self._changing: Any = None

    def __enter__(self) -> memoryview:
        self._locked.__enter__()
        try:
            self.seq._span_unlocked()
            self._changing = self.seq._store._changing(self.seq._row)
            self._changing.__enter__()
        except BaseException:
            self._locked.__exit__(None, None, None)
            raise
        return self.seq._row

    def __exit__(self, *exc: object) -> None:
        try:
            self._changing.__exit__(*exc)
            seq = self.seq
            seq._pending = [0] * seq._L
            row = seq._row
            seq._gen = row[GEN]
            seq._cache(row[START], row[CAPACITY], row[WIN_OFF])
        finally:
            self._locked.__exit__(*exc)  # type: ignore[arg-type]


def _unindex_from(row: memoryview, n: int) -> None:
    """The sequence keeps only its first n tokens (lock held): blocks past them leave the index
    (their entries become invalid), and a taint past them is gone."""
    row[IDX_BLOCKS] = min(row[IDX_BLOCKS], n // BLOCK)
    clean = row[CLEAN]
    if clean >= 0 and n <= clean:
        row[CLEAN] = -1
    if row[CLEAN] < 0:
        row[FLAGS] &= ~NOINDEX  # the next completed block is looked at again


def _taint(row: memoryview, n: int) -> None:
    """Tokens from n on are no faithful prefix computation any more (lock held)."""
    clean = row[CLEAN]
    row[CLEAN] = n if clean < 0 else min(clean, n)
    row[IDX_BLOCKS] = min(row[IDX_BLOCKS], n // BLOCK)
    row[FLAGS] |= NOINDEX


def writer_for(store: Store, seq_id: int) -> Sequence | None:
    """This process's live write handle on ``seq_id`` through ``store``, if any."""
    for handle in list(live_writers.values()):
        if handle.store is store and handle.id == seq_id and handle.writable:
            return handle
    return None


def drop_lease(handle: Sequence) -> None:
    """Give up ``handle``'s lease now (its store is closing), whatever its fork epoch."""
    handle._drop_lease()


def _unpickle_sequence(store: Store, seq_id: int) -> Sequence:
    return store.sequence(seq_id)
