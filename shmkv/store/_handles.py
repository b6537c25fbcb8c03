"""How a store makes sequence handles: ``create_sequence`` (its row, its prefix copied in from
a donor, a remote tier's chunks), ``sequence(id, write=True)`` (a write lease taken over; a read
handle ``Store.sequence`` makes itself), undoing either for a handle that never reached its
caller, and ``copy_prefix``.

``store._store.Store`` keeps the public methods (and their documentation) and calls these
with its engine; everything here goes through the engine's public API (``_engine.engine.Engine``),
and the words of a row or of the header only through its ``rows`` part (``_engine/table/rows.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.placement.arena import fits
from shmkv._engine.engine import Engine
from shmkv._engine.checks import count
from shmkv._engine.clients.lease import live_writers, new_token, own_token
from shmkv._engine.prefixes.hashes import as_tokens
from shmkv._sequence.handle import Owner, Sequence
from shmkv.errors import CacheFullError, InvalidArgumentError, ShmkvError

__all__ = ["copy_prefix", "create_sequence", "prompt", "take_lease"]


def prompt(tokens: Any) -> np.ndarray:
    """A prompt's token ids as int64, checked: ids are >= 0 (-1 marks "no id" in the store)."""
    try:
        t = as_tokens(tokens)
    except ValueError as e:
        raise InvalidArgumentError(f"prefix: {e}; pass the prompt's token ids as a 1-d int sequence") from None
    if t.size and int(t.min()) < 0:
        raise InvalidArgumentError(f"prefix: token ids must be >= 0, got {int(t.min())}")
    return t


def create_sequence(store: Owner, e: Engine, capacity: int, *, prefix: Any, tier: Any, protect: int) -> Sequence:
    """``Store.create_sequence`` (``protect``: a row no eviction may take, e.g. a fork's parent)."""
    made: list[int] = []  # (id, lease token) once the inner call has chosen them
    try:
        return _create(store, e, capacity, prefix=prefix, tier=tier, protect=protect, made=made)
    except BaseException:  # KeyboardInterrupt included: the caller never gets the handle
        if made:
            _drop_unreturned(e, made[0], made[1], free=True)
        raise


def _create(store: Owner, e: Engine, capacity: int, *, prefix: Any, tier: Any, protect: int,
            made: list[int]) -> Sequence:
    capacity = count("capacity", capacity, minimum=1)
    if capacity > e.layout.max_tokens:
        e.check_open()  # (a closed store says so first)
        raise CacheFullError(
            f"capacity={capacity} exceeds the store's max_tokens={e.layout.max_tokens}: "
            "ask for less, or create the store with a larger max_tokens="
        )
    toks = None if prefix is None else prompt(prefix)
    token = new_token()
    client = e.client_key()
    with e.locked():
        # (the mark before the new range: a span above it has no pages to punch)
        next_id, mark = e.rows.next_id_and_page_mark()
        n, _, donor = e.index.match(toks) if toks is not None else (0, 0, -1)
        # the id decides the row: id % max_seqs, so that any process finds it at once (slot_of)
        rows = e.layout.max_seqs
        # a prompt's sequence starts on a page unit: it may lend its pages, or borrow (docs/design.md §11;
        # a range shorter than a unit never lends: no alignment waste)
        # (not when sharing is off; a fork's child too, ``protect``: its parent's row; it borrows
        # through copy_prefix)
        align = e.unit_for(max(capacity, n), 0) if toks is not None or protect >= 0 else 1
        phys, m, owner = e.lend(donor, n) if n else (0, 0, -1)
        if align > 1 and not fits(e.arena, max(capacity, n), align) and fits(e.arena, max(capacity, n), 1):
            # only an unaligned range fits: take it and copy the prefix rather than evict
            # anything to borrow or lend
            align, phys, m, owner = 1, 0, 0, -1
        try:
            slot, start = e.new_row(max(capacity, n), protect=donor if n else protect, near=next_id % rows,
                                    align=align, skip=m, fill=n)  # pages for what it copies (pages.py)
        except CacheFullError:
            if n == 0:
                raise
            n, donor, m = 0, -1, 0  # only the donor's eviction makes room: a miss, which may evict it
            slot, start = e.new_row(capacity, protect=protect, near=next_id % rows, align=align)
        row = e.row(slot)
        with e.transaction():  # the row and its prefix: both, or after a crash neither
            with e.changing(row):
                # (the next id of that row, claimed: ids are never reused, a rolled-back create skips one)
                seq_id = e.rows.init_row(slot, row, start, max(capacity, n), client=client, token=token)
                made += (seq_id, token)
            if n:
                e.copy_prefix_rows(donor, slot, n, share=m, reserved=True)  # (new_row reserved them)
                if m:
                    e.borrow(slot, phys, m, owner, mark=mark)
                _crash.point("create.copied")
        if toks is not None:
            e.rows.count_prefix(donor, n)  # (a hit also makes the donor's recency fresh)
        seq = Sequence(store, e, seq_id, slot, write=True, token=token)
        e.rows.owe_first_touch(row)  # (after the handle is made: its first write takes the checked path)
    if tier is not None:
        if toks is None:
            raise InvalidArgumentError("create_sequence: tier= needs prefix= (the prompt's token ids)")
        try:
            tier.pull(seq, toks, have=n)  # network I/O: outside the store lock
        except BaseException:  # (a chunk that cannot be loaded is a miss; this is anything else)
            seq.free()  # no live, unfinished sequence is left behind
            raise
    return seq


def take_lease(store: Owner, e: Engine, seq_id: int) -> Sequence:
    """``Store.sequence(seq_id, write=True)``: a write handle that takes the lease."""
    e.check_open()
    e.slot_of(seq_id)  # SequenceNotFound before anything else
    token = new_token()
    client = e.client_key()
    try:
        return _take_lease(store, e, int(seq_id), token, client)
    except BaseException:  # KeyboardInterrupt included: no lease is left for a handle never returned
        _drop_unreturned(e, int(seq_id), token, free=False)
        raise


def _drop_unreturned(e: Engine, seq_id: int, token: int, *, free: bool) -> None:
    """Undo what create_sequence (``free``) or a lease take-over did for a handle that never
    reached its caller (an exception after the work, KeyboardInterrupt included): free the new
    sequence, or give up the lease, if the row still holds ``token``. Best effort: the
    exception that got here is what the caller sees."""
    live_writers.pop(token)
    try:
        with e.locked():
            slot = e.slot_of(seq_id)
            row = e.row(slot)
            if e.rows.lease_token(row) != token:
                return
            if free:
                e.free_row(slot)
            else:
                e.rows.release_lease(row)  # what release() does
    except ShmkvError:  # closed, gone, or the lock is busy: nothing more to do here
        pass


def _take_lease(store: Owner, e: Engine, seq_id: int, token: int, client: int) -> Sequence:
    with e.locked():
        slot = e.slot_of(seq_id)
        row = e.row(slot)
        e.check_not_leased_by_other(row, int(seq_id))
        # journaled, as any change of a row's words: a crash or an exception before the end puts
        # back the old lease (a dead holder's, or none) and the FINISHED flag, all of it
        with e.changing(row):
            e.rows.take_lease_words(row, client, token)  # (a finished sequence taken back: no longer evictable)
    return Sequence(store, e, int(seq_id), slot, write=True, token=token)


def copy_prefix(e: Engine, src_id: int, dst_id: int, n: int) -> None:
    """``Store.copy_prefix``: dst's content replaced with src's first ``n`` tokens."""
    n = count("n", n)
    if int(src_id) == int(dst_id):
        raise InvalidArgumentError(f"copy_prefix: src_id and dst_id are both {src_id}; use truncate() instead")
    with e.locked():
        s_row = e.row(e.slot_of(src_id))
        d_slot = e.slot_of(dst_id)
        d_row = e.row(d_slot)
        if n > (length := e.rows.length(s_row)):
            raise InvalidArgumentError(f"copy_prefix: n={n} exceeds the length {length} of sequence {src_id}")
        e.check_not_leased_by_other(d_row, int(dst_id), allow_token=own_token(d_row))
        s_slot = e.slot_of(src_id)
        phys, m, owner = 0, 0, -1
        if e.rows.may_borrow_into(d_row, n):
            # an empty dst on a page unit borrows src's whole units, as a reused prompt does
            # (fork and regather)
            phys, m, owner = e.lend(s_slot, n)
        with e.transaction():  # the copy and the borrow: both, or after a crash neither
            e.copy_prefix_rows(s_slot, d_slot, n, held=True, share=m)
            if m:
                e.borrow(d_slot, phys, m, owner)
