"""The writing side of a ``Sequence`` handle: the lease holder's pending tokens, ``append``
(the per-token hot path), ``commit``, ``extend``, growth, window compaction, encoding, and
the encoder cache's write.

Writes follow docs/design.md §3: new cells are written beyond the committed length, then
``commit`` publishes the new length with one aligned 8-byte store. Growth and compaction are
structural (the store lock and the row's seqlock bracket).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmkv._engine.clients import futex as _futex
from shmkv._sequence import quant as _quant
from shmkv._engine.memory import segment as _segment
from shmkv._engine.checks import MAX_POSITION, ints, not_arrays, positions_fit
from shmkv._engine.table import dtypes as _dtypes
from shmkv._engine.table.header import (
    CAPACITY,
    FLAGS,
    GEN,
    IDX_BLOCKS,
    LEASE_PID,
    LEASE_TOKEN,
    LENGTH,
    LENT,
    LIVE,
    NOINDEX,
    SEQ_WORDS,
    START,
    STATE,
    WBUF,
    WIN_OFF,
    W_SPANS,
    leads,
)
from shmkv._engine.prefixes.hashes import BLOCK, LEAD, lead_levels
from shmkv._sequence.mirror import Int8Mirror
from shmkv._sequence.reader import SeqReader
from shmkv._sequence.room import compact, grow, leave_loans, limits, make_room
from shmkv.errors import InvalidArgumentError, LeaseError, LockTimeout, ReadOnlyError, ShmkvError


_F16 = np.dtype(np.float16)
_I16 = np.dtype(np.int16)


def real(dt: np.dtype) -> bool:
    """Whether ``dt`` holds real numbers the store takes (floats, ints, bfloat16 bits)."""
    return dt.kind in "fiu" or dt == _quant.BF16


class SeqWriter:
    """A handle's writing state: the lease flag and token, the pending counts of each layer,
    and the per-layer addressing the hot path uses (refreshed after structural changes).

    The store's structural helpers (``locked``, ``changing``, ...) come from its narrow core,
    the reader's ``port``, copied into slots here: this part never reaches into the store.
    ``Sequence.append`` and ``Sequence.commit`` are this part's bound methods (no extra call
    on the hot path). Its short names are in the table of ``SeqReader``'s docstring.
    """

    # slots: the fastest attribute reads on the hot path (and more than 30 attributes would
    # cost CPython's shared-key instance dicts)
    __slots__ = ("KS", "Kr", "Kw", "L", "VS", "Vr", "Vw", "base", "cached", "cell", "dtype", "epoch", "fdt",
                 "gen", "here", "id", "isfull", "length", "lent_past", "lim", "mirror", "pending", "plain", "port",
                 "positions", "positions_mv", "r", "ro_waiters", "room", "row", "slot", "staged", "start", "token",
                 "tokens", "tokens_mv", "unmapped", "vfrom", "waddr", "waiters", "wc", "write")

    def __init__(self, r: SeqReader, *, write: bool, token: int, epoch: int) -> None:
        self.r = r
        self.write = write
        self.token = token
        self.epoch = epoch
        self.pending = [0] * r.L
        self.gen = -1
        self.length = -1  # the committed length this handle knows (addressing_kept())
        self.start = 0
        self.base: list[int] = []  # per layer: cell of token 0
        self.lim: list[int] = []  # per layer: token index limit
        self.vfrom: list[int] = []  # per layer: first kept cell
        self.room = 0  # tokens [0, room) of the range have their pages (_sequence/room.py)
        self.lent_past = True  # cells it lent may lie past its length (_sequence/room.py): not known yet
        self.cached: tuple[int, int, int, int] | None = None  # what base/lim/vfrom were computed for
        self.mirror: Int8Mirror | None = None  # int8 stores: what append returns views of (_sequence/mirror.py)
        self.staged = False  # int8: the pending tokens are in the mirror only, quantized at commit
        if write:
            self._bind()

    def _bind(self) -> None:
        """The references this part works through, from its reader and the store's engine: a
        write handle's at once, a read handle's at the first use of any of them (``UnboundWriter``):
        a read handle (``store.sequence(id)``, one a request) reads through its reader and
        usually needs none. Each is a reference to an object that does not change, ``port``
        last: a bind cut short (Ctrl-C) is done again at the next use."""
        r = self.r
        p = r.port
        self.id, self.slot, self.row = r.id, r.slot, r.row
        self.L, self.cell, self.dtype, self.plain = r.L, r.cell, r.dtype, r.plain
        # the input dtype append's fast path knows at once (identity, no .kind): a plain store's own,
        # float16 for the others (int8 quantizes float input; bfloat16 input goes the checked way)
        self.fdt = _dtypes.storage(r.dtype) if r.plain else _F16
        self.isfull, self.wc = r.isfull, r.wc
        self.Kw, self.Vw = p.Kl, p.Vl  # writable per-layer bases
        self.Kr, self.Vr, self.KS, self.VS = r.Kr, r.Vr, r.KS, r.VS
        self.tokens, self.positions = r.tokens, r.positions
        # the same words as memoryviews: a commit of one token stores its id and position with
        # no numpy call (a commit that wakes a waiter runs cold, and every call there counts)
        self.tokens_mv, self.positions_mv = r.tokens.data, r.positions.data
        self.unmapped = r.shares.unmapped  # rows whose shared pages are not mapped here (read: refused)
        self.waiters = p.waiters  # Sequence.wait's sleepers per row: a commit wakes them (_sequence/waiting.py)
        self.ro_waiters = p.ro_waiters.counts  # ... of read-only attachments
        self.waddr = p.length_addr0 + self.slot * 8 * SEQ_WORDS  # the row's futex word
        self.port = p  # the store's engine (its narrow core); set last: the bind is done

    # -- addressing --------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-read the row: someone else's change, or a new handle. The room too is what is
        written then (``_sequence/room.py``), and cells it lent may lie past its length."""
        g = self.row[GEN]
        start, cap, _, woff = self.r.span()
        self.lent_past = True  # (the safe value: its length may have fallen below cells it lent)
        self.cache(start, cap, woff, gen=g if not g & 1 else -1, fresh=True)

    def cache(self, start: int, cap: int, woff: int, *, gen: int | None = None, fresh: bool = False) -> None:
        """Per-layer addressing for the writer's hot path, at row generation ``gen`` (None: the
        handle's generation stays as it is, and the caller sets it after: ``Int8Mirror.moved``).

        Token i of a full layer is cell ``start + i``; of a sliding/chunked layer,
        cell ``slot * window_cells + i - woff`` of that layer's window region.
        Also what addressing_kept() compares: the length, this process's count of changes of the row.

        Everything is worked out first and assigned in one statement, with no call between the
        stores (a Ctrl-C is raised only at a call, a function's entry or a backward jump): the
        fields a read or write trusts are all old or all new, never half (ARCHITECTURE.md,
        "A write handle's addressing").
        """
        row = self.row
        here = self.port.here[self.slot]
        length = row[LENGTH]
        wbase = (2 * self.slot + row[WBUF]) * self.wc  # the writer's own row
        key = (start, cap, woff, wbase)
        g = self.gen if gen is None else gen
        prev = self.cached
        self.r.wbase = wbase
        if key == prev and not fresh:
            # (a truncate within the range, the speculative-decoding step, changes none of them)
            self.here, self.length, self.gen = here, length, g
            return
        room = self.room if prev is not None and prev[0] == start and not fresh else length + max(self.pending)
        base = wbase - woff
        bases = [start if f else base for f in self.isfull]  # cell of token 0
        lim = limits(self, cap, woff, room)  # token index limits: capacity, window buffer, room
        vfrom = [start if f else wbase for f in self.isfull]  # first kept cell
        (self.here, self.length, self.start, self.room, self.base, self.lim, self.vfrom, self.cached,
         self.gen) = (here, length, start, room, bases, lim, vfrom, key, g)

    def abandon(self) -> None:
        """A foreign exception (KeyboardInterrupt, MemoryError) left append, commit or extend: the
        step's pending tokens dropped, the row re-read at the next use, in one statement."""
        self.gen, self.pending, self.staged = -1, [0] * self.L, False

    def drop_pending(self) -> None:
        """Forget this handle's uncommitted tokens (their cells are simply written again)."""
        self.pending = [0] * self.L
        if self.staged and self.mirror is not None:
            self.staged = False
            self.mirror.clamp(self.row[LENGTH])

    def discard(self) -> int:
        """Sequence.discard: drop the pending tokens; returns the most any layer had."""
        n = max(self.pending)
        if n:
            self.drop_pending()
        return n

    def pending_cells(self, layer: int) -> tuple[int, int] | None:
        """Cells [first held, end of pending) of ``layer`` when this handle has tokens pending there
        (its addressing current); None when it has none (the committed cells are all there is)."""
        p = self.pending[layer]
        row = self.row
        if not p or not self.write or row[GEN] != self.gen:
            return None
        return self.vfrom[layer], self.base[layer] + row[LENGTH] + p

    def need_writer(self, what: str) -> None:
        """Refuse ``what`` unless this handle holds the lease, here and now; reload the range
        after a structural change made by someone else (then pending tokens are dropped)."""
        if self.port.closed:
            self.r.check()  # raises
        if not self.write:
            self.r.span()  # a freed sequence: SequenceNotFound (no lease to take)
            raise ReadOnlyError(
                f"{what}: sequence {self.id} handle is read-only; take the lease with "
                f"store.sequence({self.id}, write=True)"
            )
        if self.epoch != _segment.fork_epoch:
            raise LeaseError(
                f"{what}: this write handle of sequence {self.id} was inherited across fork; "
                f"take the lease in this process with store.sequence({self.id}, write=True)"
            )
        row = self.row
        if row[LEASE_TOKEN] != self.token:  # random per handle: no pid check (a syscall) needed
            self.write = False
            raise LeaseError(
                f"{what}: the lease on sequence {self.id} was taken over (pid {row[LEASE_PID]}); "
                "this handle is now read-only"
            )
        if row[GEN] != self.gen and addressing_kept(self, row):
            g = row[GEN]  # someone lent from us or copied our borrowed cells: cells stay (not mapped: no gen)
            Int8Mirror.moved(self, g if not g & 1 and remap(self) else -1)
        elif row[GEN] != self.gen:
            # a structural change we did not make through this handle (e.g. copy_prefix
            # into it): drop uncommitted tokens, reload the range (an int8 mirror re-reads the cells)
            self.pending = [0] * self.L
            self.refresh()
            if what != "extend":  # a new range (create_sequence): pre-faulted before writes through the mapping
                self.port.before_appends(self.start, row[CAPACITY])

    # -- appending ---------------------------------------------------------------------

    def append(self, layer: int, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
        """Sequence.append (its docstring tells the contract); bound as the handle's ``append``."""
        # Fast path (the per-token hot loop; see tools/bench.py decode): every check
        # below is what need_writer/layer/kv_arrays do, inlined for the common case.
        row = self.row
        if ((self.plain or self.mirror is not None) and self.write and row[LEASE_TOKEN] == self.token
                and row[GEN] == self.gen and not self.unmapped
                and self.epoch == _segment.fork_epoch and type(layer) is int and 0 <= layer < self.L
                and type(k) is np.ndarray and type(v) is np.ndarray
                and ((kd := k.dtype) is (vd := v.dtype) is self.fdt or (kd.kind == "f" and vd.kind == "f"))):
            ks = k.shape
            if ks == self.cell and v.shape == ks:
                n = 1
            elif len(ks) == 3 and ks[1:] == self.cell and v.shape == ks:
                n = ks[0]
            else:
                return self.append_checked(layer, k, v)
            length = row[LENGTH]
            p = self.pending[layer]
            if length + p + n > self.lim[layer]:
                return self.append_checked(layer, k, v)
            if not self.plain:  # int8: into the mirror, quantized at commit (_sequence/mirror.py)
                mir = self.mirror
                assert mir is not None  # (made by a first, checked, append)
                t0, end = length + p, length + p + n
                if mir.gen != self.gen or mir.n[layer] < t0 or end > mir.cap or k.itemsize > 4 or v.itemsize > 4:
                    return self.append_checked(layer, k, v)
                if (put := mir.put16) is not None and k.dtype == v.dtype == _F16 and k.flags.c_contiguous \
                        and v.flags.c_contiguous:  # numba's float16 conversion: numpy's cast, bit for bit, 5x faster
                    put(k.view(_I16), v.view(_I16), mir.M, layer, t0)
                else:  # (a cast: float16 to float32 is exact)
                    mir.wk[layer][t0:end], mir.wv[layer][t0:end] = k, v
                mir.n[layer] = end
                self.pending[layer] = p + n
                self.staged = True
                return mir.kv[layer][:end], mir.vv[layer][:end]
            s = self.base[layer] + length + p
            if n == 1 and len(ks) == 2:
                self.Kw[layer][s] = k
                self.Vw[layer][s] = v
            else:
                self.Kw[layer][s : s + n] = k
                self.Vw[layer][s : s + n] = v
            self.pending[layer] = p + n
            first = self.vfrom[layer]
            return self.Kr[layer][first : s + n], self.Vr[layer][first : s + n]
        return self.append_checked(layer, k, v)

    def append_checked(self, layer: Any, k: Any, v: Any, views: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """append's checked path; ``views=False`` (extend) returns empty arrays."""
        try:
            return self._append_checked(layer, k, v, views)
        except ShmkvError:
            raise  # (refused before anything was written: the step goes on as it was)
        except BaseException:
            self.abandon()
            raise

    def _append_checked(self, layer: Any, k: Any, v: Any, views: bool) -> tuple[np.ndarray, np.ndarray]:
        self.need_writer("append")
        layer = self.r.layer(layer)
        int8 = self.dtype == "int8"
        k, v = kv_arrays(self, k, v, finite=views)  # int8: refused here (extend: by the quantizer)
        if views and self.unmapped:
            self.r.readable()  # the views would show its borrowed cells: holes in this process
        n = k.shape[0]
        length = self.row[LENGTH]
        p = self.pending[layer]
        end = length + p + n
        if end > self.lim[layer]:
            if end > self.row[CAPACITY]:
                self.grow(end)
            if end > self.room:  # the pages after the room: allocated before the write
                if self.row[FLAGS] & LENT and self.lent_past:  # cells it lent may lie there: it moves first (room.py)
                    leave_loans(self)
                make_room(self, end)
            if end > self.lim[layer]:  # a sliding/chunked layer's buffer is full
                compact(self, layer, end)
        s = self.base[layer] + length + p
        if int8 and views:  # into the mirror (made, or brought up to date, first)
            self.mirror = Int8Mirror.current(self.mirror, self.r.arena, self.row, gen=self.gen, start=self.start,
                                             length=length, pending=self.pending if self.staged else None)
            self.mirror.catch_up(layer, self.start, length + p)
            kv = self.mirror.put(layer, length + p, k, v)
            self.pending[layer] = p + n
            self.staged = True
            return kv
        if self.plain:
            self.Kw[layer][s : s + n] = k
            self.Vw[layer][s : s + n] = v
        else:
            encode(self, layer, s, k, v)
        self.pending[layer] = p + n
        if not views:
            return k[:0], v[:0]
        first = self.vfrom[layer]
        return self.r.view("k", layer, first, s + n), self.r.view("v", layer, first, s + n)

    def grow(self, needed: int) -> None:
        """Give the sequence room for ``needed`` tokens (``_sequence/room.py``)."""
        grow(self, needed)

    # -- publishing --------------------------------------------------------------------

    def commit(self, tokens: Any = None, positions: Any = None) -> int:
        """Sequence.commit (its docstring tells the contract); bound as the handle's ``commit``."""
        try:
            self.need_writer("commit")
            pend = self.pending
            n = pend[0]
            if pend.count(n) != self.L:
                raise InvalidArgumentError(
                    f"commit: layers have different pending token counts {pend}; append the same "
                    "number of tokens to every layer before commit()"
                )
            row = self.row
            length = row[LENGTH]
            s = self.start + length
            last = self.positions_mv[s - 1] if length else -1
            if n == 0:
                if (tokens is not None and np.size(tokens)) or (positions is not None and np.size(positions)):
                    raise InvalidArgumentError("commit: tokens/positions given but no token is pending")
                return length
            tok = None if tokens is None else ints("tokens", tokens, n)
            pos = None
            if positions is not None:
                pos = ints("positions", positions, n)
                if pos[0] <= last or (n > 1 and np.any(np.diff(pos) <= 0)):
                    raise InvalidArgumentError(
                        f"commit: positions {pos.tolist()[:8]} must increase, after the last committed position {last}"
                    )
            if (last + n if pos is None else int(pos[-1])) > MAX_POSITION:  # (a compare a commit; the call to say it)
                positions_fit("commit", n, last, pos)
            if self.staged and self.mirror is not None:  # int8: all layers' pending tokens quantized, one pass
                self.mirror.quantize(length, n, s, self)
            if n == 1:  # (the decode step: two word stores)
                self.tokens_mv[s] = -1 if tok is None else int(tok[0])
                self.positions_mv[s] = last + 1 if pos is None else int(pos[0])
            else:
                self.tokens[s : s + n] = -1 if tok is None else tok
                self.positions[s : s + n] = np.arange(last + 1, last + 1 + n) if pos is None else pos
            zero = [0] * self.L
            row[LENGTH] = length + n  # publish: one aligned 8-byte store, after the data
            self.length, self.pending, self.staged = length + n, zero, False  # (with it: no call between)
            if self.waiters[self.slot] or self.ro_waiters[self.slot]:  # the syscall only for a sleeper
                _futex.wake(self.waddr)
            flags = row[FLAGS]
            if flags & NOINDEX:
                pass
            elif tok is None:  # cells without ids cannot be found by the prefix index
                unindexable(self, row)
            elif ((length + n) // BLOCK > row[IDX_BLOCKS]
                  or (length < LEAD[-1] and lead_levels(length + n) > leads(flags))):
                self.index_committed(length + n)
            return length + n
        except ShmkvError:
            raise  # (refused before anything was written, or the tokens are committed)
        except BaseException:
            self.abandon()
            raise

    def index_committed(self, length: int) -> None:
        """Put the blocks (and leads) this commit completed into the prefix index: the store lock
        once per 16 tokens, and at most four times over a sequence's first 8 (docs/design.md §3). The tokens
        are committed whatever happens here: a lock timeout only delays the indexing to the next
        completed block (or lead)."""
        try:
            with self.port.locked():
                self.port.index_blocks(self.slot, length)
        except LockTimeout:
            pass


class UnboundWriter(SeqWriter):
    """A read handle's writing part before its first use: at the first read of any slot it binds
    (``SeqWriter._bind``) and becomes a ``SeqWriter`` (the same slots). A class of its own, so that
    ``SeqWriter`` defines no ``__getattr__``: with one, CPython looks up every attribute of the
    write hot path through a slower hook instead of the specialized slot read."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        self._bind()
        self.__class__ = SeqWriter  # type: ignore[assignment]  # (Ctrl-C before it: the next read binds again)
        return getattr(self, name)  # (``here`` before the first ``cache``: AttributeError, as before)


def kv_arrays(w: SeqWriter, k: Any, v: Any, finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``k``, ``v`` checked and shaped ``[n, kv_heads, head_dim]`` (what append accepts).
    ``finite=False``: int8 values are not checked here (the quantizer refuses them)."""
    try:
        k = np.asarray(k)
        v = np.asarray(v)
    except (TypeError, ValueError, RuntimeError):  # (a torch bfloat16 tensor, one needing grad, ragged lists)
        raise not_arrays("append", {"k": k, "v": v}) from None
    if k.shape[-2:] != w.cell or k.shape != v.shape or k.ndim not in (2, 3):
        H, D = w.cell
        raise InvalidArgumentError(
            f"k shape {k.shape} and v shape {v.shape} must both be [n, kv_heads={H}, head_dim={D}] "
            f"(or [{H}, {D}] for one token)"
        )
    if not (real(k.dtype) and real(v.dtype)):
        raise InvalidArgumentError(
            f"k dtype {k.dtype} / v dtype {v.dtype}: keys and values must be real numbers (float or int)"
        )
    if k.ndim == 2:
        k = k[None]
        v = v[None]
    if finite and w.dtype == "int8":
        _quant.check_finite(k, "k")
        _quant.check_finite(v, "v")
    return k, v


def encode(w: SeqWriter, layer: int, s: int, k: np.ndarray, v: np.ndarray) -> None:
    """Write k, v (already checked) into cells s.. of layer in the storage encoding."""
    write_rows(w, w.Kw[layer], None if w.KS is None else w.KS[layer], s, k)
    write_rows(w, w.Vw[layer], None if w.VS is None else w.VS[layer], s, v)

def write_rows(w: SeqWriter, codes: np.ndarray, scales: np.ndarray | None, s: int, x: np.ndarray) -> None:
    """Store ``x`` [n, kv_heads, head_dim] at cells s.. of one layer's array (and int8 scales),
    in the storage encoding: the one place values are encoded."""
    n = x.shape[0]
    if w.dtype == "int8":
        assert scales is not None  # int8: every layer has its scales
        _quant.quantize_into(x, codes[s : s + n], scales[s : s + n])
    elif w.dtype == "bfloat16":
        codes[s : s + n] = _quant.to_bf16(x)
    else:
        codes[s : s + n] = x


def unindexable(w: SeqWriter, row: memoryview) -> None:
    """Flag ``w``'s row NOINDEX (its blocks from IDX_BLOCKS on have cells without token ids) under
    the store lock: FLAGS also holds LENT and STANDIN, which other processes set under it on this
    leased row (a borrow from it, a copy of it), and an unlocked read-modify-write could drop
    theirs (a donor that forgot it lent would write over its borrowers' cells). A lock timeout
    leaves the flag unset: index_blocks finds the -1 ids at the next block and sets it then."""
    try:
        with w.port.locked():
            row[FLAGS] |= NOINDEX
    except LockTimeout:
        pass


def addressing_kept(w: SeqWriter, row: memoryview) -> bool:
    """Whether a change someone else made to ``w``'s row left its range, window buffer and
    length where they were: another process borrowed from it (the LENT flag), or did and
    rolled it back (an exception, or a recovery after its death: the flag is back as it was,
    the generation moved on; journal invariant 10). Its pending tokens, in cells past the
    length, stay valid then: a decode step is not lost because another request borrowed from
    this one mid-step. A change this process made to the row otherwise (copy_prefix into it,
    say), committed or rolled back, may have written its cells: ``_engine/own_changes`` moved,
    and the pending tokens are dropped. (Every other change by another process moves the range,
    the buffer or the length, or takes the lease: tests/test_sharing_pending_steps.py,
    the journal's invariant 10.)"""
    c = w.cached
    return (c is not None and row[STATE] == LIVE
            and w.port.here[w.slot] == w.here  # none of this process's
            and row[START] == w.start and row[CAPACITY] == c[1] and row[WIN_OFF] == c[2]
            and row[LENGTH] == w.length and (2 * w.slot + row[WBUF]) * w.wc == c[3])


def remap(w: SeqWriter) -> bool:
    """After an addressing_kept() change: this attachment follows the span table before append's views (or
    an int8 mirror) read the row (no change by another process alters a borrower's span since
    a donor stopped giving its borrowers private copies; kept as the rule). Without waiting:
    while the change is open (the span epoch odd: the rows' end comes before the epoch's,
    journal ``_end``) nothing can be mapped yet; returns whether this
    attachment now maps the spans as the table says (False: the caller keeps no generation, so
    its next need_writer calls this again)."""
    shares = w.r.shares
    if shares.applied != shares.hdr[W_SPANS]:
        shares.sync()
    return bool(shares.applied == shares.hdr[W_SPANS])
