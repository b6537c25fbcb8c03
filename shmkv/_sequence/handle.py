"""Sequence: one token stream of a store, through a read handle or a write (lease) handle.

What invalidates a view: the arrays returned by ``keys()``, ``values()``,
``kv()`` and ``append()`` are zero-copy windows on shared memory. They stay
mapped as long as they live (closing the store cannot unmap them). A view of
committed cells keeps its content across appends and a ``truncate`` above them
(full-attention layers, shared prefix pages or not: ``_engine/spans/lending.py``);
``free``, ``remove``, ``shift_left``, ``copy_prefix`` into the sequence and a
move (growth past its range, a donor truncating below what it lent) invalidate
it (docs/stores.md). Take ``.copy()`` to keep data across those, or use
``read(layer)``, which copies under the seqlock.
Views are read-only: committed cells are immutable.

``Sequence`` is the public face; the work is done by its parts, each in its own module:
``reader.SeqReader`` (seqlocked reads, cell addressing, views, masks, waiting),
``writer.SeqWriter`` (the lease holder's pending tokens, append, commit, extend,
growth, compaction, encoding) and ``structural`` (truncate, shift_left, remove).
They reach the store's engine through its narrow core only, the ``_engine.port.Port`` protocol
that the store hands each handle: this module and the parts touch no underscore attribute of the
engine, and the public store (``Owner``: ``seq.store``, fork, pickling) only through its API.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._sequence import bulk as _bulk
from shmkv._engine.memory import segment as _segment
from shmkv._sequence.mirror import Int8Mirror
from shmkv._sequence import rewind as _seq_rewind
from shmkv._sequence import structural as _seq_structural
from shmkv._engine.checks import pack_meta, count
from shmkv._engine.clients.lease import live_writers
from shmkv._sequence.reader import SeqReader
from shmkv._sequence.reads import Reads
from shmkv._sequence.structural import ShiftFn
from shmkv._sequence.writer import SeqWriter, UnboundWriter
from shmkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shmkv._engine.table.header import Layout
    from shmkv._engine.port import Port

__all__ = ["Owner", "Sequence", "ShiftFn", "drop_lease", "pending_views", "writer_for", "writer_part"]


class Owner(Protocol):
    """The public store as the sequence layer uses it: what ``seq.store`` is, what a fork and
    the group operations call (``store.Store`` implements it; mypy checks that it does)."""

    name: str
    layout: Layout
    readonly: bool

    @property
    def closed(self) -> bool: ...

    @property
    def bytes_per_token(self) -> int: ...

    def sequence(self, seq_id: int, write: bool = False) -> Sequence: ...

    def create_sequence(self, capacity: int = ..., *, prefix: Any = ..., tier: Any = ...,
                        _protect: int = ...) -> Sequence: ...

    def copy_prefix(self, src_id: int, dst_id: int, n: int) -> None: ...

    def transaction(self) -> AbstractContextManager[None]: ...


class Sequence(Reads):
    """A handle on one sequence. Get one from ``store.create_sequence()`` or ``store.sequence(id)``.

    A write handle holds the sequence's lease: it alone appends, commits and
    makes structural changes. Any number of read handles, in any process, see
    the committed tokens.
    """

    def __init__(self, store: Owner, port: Port, seq_id: int, slot: int, *, write: bool, token: int) -> None:
        self._store = store
        self.id = int(seq_id)
        self._slot = slot
        self._p = p = port
        self._row = row = p.row(slot)
        self._token = token
        self._epoch = _segment.fork_epoch
        self._r = r = SeqReader(p, self.id, slot, row)
        self._w = w = (SeqWriter if write else UnboundWriter)(r, write=write, token=token, epoch=self._epoch)
        # The per-token hot path: the writer's own methods, with no call layer in between
        # (the class's append/commit below say what they do, for help() and the docs).
        self.append = w.append  # type: ignore[method-assign]
        self.commit = w.commit  # type: ignore[method-assign]
        if write:  # (a read handle's reads look at the row themselves: it never uses the addressing)
            w.refresh()
            live_writers.add(token, self, row, self._epoch)

    def __repr__(self) -> str:
        kind = "write" if self._w.write else "read"
        try:
            return f"<shmkv.Sequence id={self.id} length={self.length} capacity={self.capacity} {kind}>"
        except Exception:  # repr of a dead handle
            return f"<shmkv.Sequence id={self.id} {kind} (unavailable)>"

    @property
    def store(self) -> Owner:
        """The store this sequence lives in (through this handle's attachment)."""
        return self._store

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as a *read* handle: a lease never travels; the receiver takes its own.
        return (_unpickle_sequence, (self._store, self.id))

    @property
    def _pending(self) -> list[int]:
        """This handle's uncommitted tokens per layer (the writer part's)."""
        return self._w.pending

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
            int8 stores: float32 views of the write handle's own copy, the pending tokens
            as given until ``commit()`` quantizes them, as stored from then on
            (``_sequence/mirror.py``).

        The tokens become visible to other processes at ``commit()``, once every
        layer has the same number of pending tokens.
        """
        return self._w.append(layer, k, v)  # handles call the writer's append directly (see __init__)

    # -- encoder (cross-attention) cache -------------------------------------------

    def set_encoder(self, k_all: Any, v_all: Any) -> None:
        """Store this sequence's encoder keys and values ``[layers, n, kv_heads, head_dim]``.

        Position-independent and written once (a second call replaces them); every
        decode step reads them with :meth:`encoder_kv`, with no mask. Kept until the
        sequence is freed, carried by ``fork`` and by snapshots.
        """
        _bulk.set_encoder(self._w, k_all, v_all)

    def commit(self, tokens: Any = None, positions: Any = None) -> int:
        """Publish the pending tokens of every layer; return the new length.

        Args:
            tokens: token ids of the pending tokens (``[n]`` ints), default -1.
            positions: their positions (``[n]`` ints, increasing, after the last
                committed position); default: the last position + 1 onwards.
        """
        return self._w.commit(tokens, positions)  # handles call the writer's commit directly (see __init__)

    def extend(self, k_all: Any, v_all: Any, tokens: Any = None, positions: Any = None, *,
               in_steps: bool = False) -> int:
        """Write ``n`` tokens of every layer and commit them; return the new length.

        Args:
            k_all, v_all: ``[layers, n, kv_heads, head_dim]``.
            in_steps: on stores with sliding/chunked layers, take any ``n``: room for all is made
                first (``CacheFullError`` changes nothing), then they are committed
                ``layout.step`` at a time (other processes may see the first steps meanwhile).
        """
        return _bulk.extend(self._w, k_all, v_all, tokens, positions, in_steps=in_steps)

    def discard(self) -> int:
        """Drop this handle's pending (uncommitted) tokens on every layer, e.g. after a forward
        failed between layers; returns the most any layer had. No lock: no other process saw
        them. A read handle (or a released one) has none: 0."""
        return self._w.discard()

    def pending_on(self, layer: int) -> int:
        """Tokens this handle appended to ``layer`` and has not committed (0 on a read handle)."""
        return self._w.pending[self._r.layer(layer)]

    def set_tokens(self, tokens: Any, begin: int = 0) -> None:
        """Record the ids of committed tokens ``[begin, begin + len(tokens))`` committed without
        them (a model's forward sees states, not ids); their whole blocks join the prefix cache.

        Raises:
            InvalidArgumentError: an id < 0, tokens past the length, or an id that differs
                from one a cell holds (recorded ids are fixed); nothing is written then.
            ReadOnlyError, LeaseError: this handle does not hold the lease.
        """
        _seq_structural.set_tokens(self._w, tokens, begin)

    # -- structural operations ---------------------------------------------------

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` committed tokens; drop pending ones.

        ``n`` beyond the length is clamped to it (the committed tokens stay), as
        Hugging Face's ``crop`` does: truncate never extends.
        """
        _seq_structural.truncate(self._w, n)

    def rewind(self, n: int, k_window: Any, v_window: Any) -> None:
        """Truncate to ``n`` tokens where sliding/chunked layers no longer hold what a next
        token needs, giving them those tokens' states: ``k_window`` and ``v_window``
        ``[bounded layers, m, kv_heads, head_dim]`` are the keys and values of tokens
        ``n - m .. n - 1`` on each sliding/chunked layer (``store.layout.bounded`` order),
        ``min(n, layout.keep) <= m <= layout.window_cells``. Full layers keep their cells.

        For a rollback after a forward longer than ``memory`` (committed in steps, the
        window buffers compacted meanwhile) by a caller that kept the states: the Hugging
        Face adapter's ``crop``. The states are not checked against the old ones (they are
        gone); they must be the ones computed for those positions.

        Raises:
            InvalidArgumentError: ``n`` beyond the length, or windows of the wrong shape or size.
            ReadOnlyError, LeaseError: this handle does not hold the lease.
        """
        _seq_rewind.rewind(self._w, n, k_window, v_window)

    def clear(self) -> None:
        """Drop every token (the range stays reserved)."""
        self.truncate(0)

    def shift_left(self, n: int) -> None:
        """Drop the oldest ``n`` tokens (sliding window); the rest keep their positions."""
        _seq_structural.shift_left(self._w, n)

    def remove(self, begin: int, end: int, shift: ShiftFn | None = None) -> None:
        """Remove tokens ``[begin, end)``; later tokens move down and take the freed positions.

        The moved tokens' positions change by ``delta = positions[begin] -
        positions[end]`` (negative). ``shift(layer, keys, delta) -> keys``, if
        given, re-rotates their keys (RoPE shift) for each layer; it runs before
        anything changes, so an exception in it leaves the sequence as it was.
        """
        _seq_structural.remove(self._w, begin, end, shift)

    def release(self) -> None:
        """Give up the write lease (pending tokens are dropped); the handle becomes a read handle."""
        if self._w.write and self._epoch == _segment.fork_epoch:
            self._drop_lease()

    def _drop_lease(self) -> None:
        try:
            self._r.rows.release_own_lease(self._row, self._token)
        except (ValueError, TypeError):
            pass
        self._w.write = False
        self._w.drop_pending()
        self._w.mirror = None  # (an int8 mirror's memory: a read handle never appends)
        live_writers.pop(self._token)

    def free(self) -> None:
        """Delete the sequence: its cells return to the store. Needs the lease, or no live holder."""
        p = self._p
        w = self._w
        with p.locked():
            row = self._row
            self._r.span_unlocked()
            if not w.write:
                p.check_not_leased_by_other(row, self.id)
            else:
                w.need_writer("free")
            p.free_row(self._slot)
        if w.write:
            self._drop_lease()

    def finish(self) -> None:
        """The request is done: give up the lease and keep the sequence as a cached prefix.

        Other requests reuse its tokens through ``create_sequence(prefix=...)``; it is
        evicted, least recently used first, when a create or a growth needs room.
        ``store.sequence(id, write=True)`` takes it back (a chat's next turn), and it is then
        no longer evictable. Pending (uncommitted) tokens are dropped.
        """
        self._w.need_writer("finish")
        p = self._p
        with p.locked():
            row = self._row
            self._r.span_unlocked()
            with p.changing(row):  # journaled: an exception before the end leaves it unfinished
                self._r.rows.mark_finished(row)
            self._drop_lease()

    def fork(self, n: int | None = None, capacity: int | None = None) -> Sequence:
        """A new sequence holding this one's first ``n`` tokens (default: all); returns its write handle."""
        st, p = self._store, self._p
        with p.locked():
            length = self._r.span()[2]
            n = length if n is None else count("n", n)
            if n > length:
                raise InvalidArgumentError(f"fork: n={n} exceeds the length {length} of sequence {self.id}")
            cap = max(n, 1, self.capacity if capacity is None else count("capacity", capacity, 1))
            with p.transaction():  # the child and its content: both, or after a crash neither
                child = st.create_sequence(capacity=cap, _protect=self._slot)  # never evict the parent for it
                _crash.point("fork.child")
                try:
                    st.copy_prefix(self.id, child.id, n)
                    enc = self._r.rows.encoder_range(self._row, p.row)
                    if enc is not None:  # the child decodes against the same encoder output
                        src, m = enc
                        with p.changing(child._row):
                            dst = p.set_encoder(child._row, m)
                            p.copy_all_layers(src, dst, m)
                except BaseException:
                    child.free()
                    raise
            child._w.refresh()
            # the refresh above takes the child's first append off the checked path, which is
            # where a new range's pages are pre-faulted: do it here (not on the per-token path)
            p.before_appends(child._w.start, self._r.rows.capacity(child._row))
        return child

    @property
    def meta(self) -> dict[str, Any]:
        """Small metadata of the sequence: a msgpack-able dict, at most 512 bytes packed.

        Written by the lease holder (``seq.meta = {"request": "r-17"}``, a whole dict at a
        time, under the store lock), read by any process (a replacement worker learns which
        request it serves), kept by snapshots, shown by ``shmkv info``. Each read returns a
        new dict: change it by assigning one. A new sequence (and a fork) starts with ``{}``.
        """
        packed = self._r.consistent(lambda: self._p.get_meta(self._slot))
        return msgpack.unpackb(packed) if packed else {}

    @meta.setter
    def meta(self, value: dict[str, Any]) -> None:
        self._w.need_writer("meta")
        packed = pack_meta(value)
        p = self._p
        with p.locked():
            row = self._row
            self._r.span_unlocked()
            with p.changing(row):
                p.set_meta(self._slot, packed)
            Int8Mirror.moved(self._w, self._r.rows.generation(row))  # our own change: pending tokens stay


def writer_for(store: Owner, seq_id: int) -> Sequence | None:
    """This process's live write handle on ``seq_id`` through ``store``, if any."""
    for handle in list(live_writers.values()):
        if isinstance(handle, Sequence) and handle.store is store and handle.id == seq_id and handle.writable:
            return handle
    return None


def writer_part(handle: Sequence) -> SeqWriter:
    """The writer part of ``handle``: what ``Batch`` appends through (pending counts, checks)."""
    return handle._w


def pending_views(handle: Sequence, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The cells ``handle.torch_kv(layer, pending=True)`` shows, as writable numpy views
    ``[n, kv_heads, head_dim]`` of the shared cache, where that is two slices: a plain float
    store, tokens pending in ``layer``, every page mapped here. None otherwise (int8 or bfloat16,
    nothing pending, a structural change since, borrowed pages not mapped here, a closed store):
    ``torch_kv`` then makes the tensors, or says why not. The transformers cache's decode step
    shapes these for torch itself, without making a tensor twice."""
    w = handle._w
    if not w.plain or w.unmapped or w.port.closed:
        return None
    cells = w.pending_cells(layer)
    if cells is None:
        return None
    lo, hi = cells
    return w.Kw[layer][lo:hi], w.Vw[layer][lo:hi]


def drop_lease(handle: Sequence) -> None:
    """Give up ``handle``'s lease now (its store is closing), whatever its fork epoch."""
    handle._drop_lease()


def _unpickle_sequence(store: Owner, seq_id: int) -> Sequence:
    return store.sequence(seq_id)
