"""Restoring a snapshot (``store.restore``, ``shmkv.load``): everything is read into ranges
that no sequence owns yet and published, in one journaled transaction, only when every
checksum matched: all or nothing (the format and its checked reader: ``format``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.checks import check_progress, int_list
from shmkv._engine.clients.lease import own_token
from shmkv._snapshot.format import (
    seekable_fd,
    ID_HINT,
    Progress,
    REGION_NAMES,
    Snapshot,
    SnapshotReader,
    SeqRecord,
    open_source,
    seq_parts,
    token_bytes,
)
from shmkv.errors import (
    CacheFullError,
    InvalidArgumentError,
    LayoutMismatchError,
    SequenceNotFound,
)

if TYPE_CHECKING:
    from shmkv._engine.port import Port
    from shmkv._engine.table.header import Layout



S = TypeVar("S")


# -- reading -------------------------------------------------------------------


def restore(core: Port, source: Any, seq_ids: list[int] | None = None,
            progress: Progress | None = None) -> list[int]:
    """Restore sequences from a snapshot into ``store``, all or nothing; return their ids.

    Sequences whose ids exist in the store are replaced (they must not be
    leased by another live process); others are created with the snapshot's ids.
    A store of another geometry (layers, kv_heads, head_dim, dtype) raises
    LayoutMismatchError; capacity limits may differ.
    """
    core.check_writable()
    check_progress("restore", progress)
    with open_source(source) as (reader, is_file):
        return _restore(core, reader, reader.header(), is_file, seq_ids=seq_ids, progress=progress)


def _restore(core: Port, reader: SnapshotReader, snap: Snapshot, is_file: bool, *, seq_ids: list[int] | None,
             progress: Progress | None) -> list[int]:
    """Restore ``snap`` (its header read already) with the arrays that follow in ``reader``."""
    lay = core.layout
    if snap.layout.geometry != lay.geometry or snap.layout.layer_types != lay.layer_types:
        raise LayoutMismatchError(
            f"{reader.where}: snapshot geometry (layers, kv_heads, head_dim, dtype) {snap.layout.geometry} "
            f"and layer kinds differ from store {core.name!r}'s {lay.geometry}; restore into a store "
            f"created with the same geometry (shmkv.load creates one)"
        )
    ids = snap.seq_ids
    if seq_ids is not None:
        wanted = int_list("restore", "seq_ids", seq_ids, ID_HINT, distinct=True)
        missing = [i for i in wanted if i not in ids]
        if missing:
            raise SequenceNotFound(f"{reader.where}: sequences {missing} are not in the snapshot (it has {ids})")
        selected = set(wanted)
    else:
        selected = set(ids)
    if lay.bounded:  # what the sliding and chunked layers keep, and where: the store's own buffers
        _check_windows(core.name, lay, snap, selected, reader.where)
    total = snap.nbytes
    # a regular file's arrays are copied by the kernel (sendfile) into ranges only staged for them
    direct = is_file and seekable_fd(reader.f) is not None
    with core.locked(scan=True):  # the journal's way in: a dead holder's transaction rolled back first
        rows = core.snapshot_rows
        plan: list[tuple[SeqRecord, int, int]] = []  # (seq, existing slot or -1 - new slot, staged start)
        enc_start: dict[int, int] = {}  # staged encoder ranges
        enc_slot: dict[int, int] = {}
        taken: list[tuple[int, int]] = []
        free_slots = rows.free_slots()
        free_set = set(free_slots)
        for s in snap.sequences:
            if s.id not in selected:
                continue
            slot = rows.live_slot_of(s.id)
            if slot >= 0:
                core.check_not_leased_by_other(core.row(slot), s.id, allow_token=_own(core, slot))
            elif not free_slots:
                raise CacheFullError(
                    f"store {core.name!r} has no free sequence slot for sequence {s.id} of {reader.where} "
                    f"(max_seqs={lay.max_seqs}); free sequences or restore fewer (seq_ids=)"
                )
            else:  # a new sequence: -1 - the slot it will take, its id's own (see Engine.slot_of) if free
                own = s.id % lay.max_seqs
                slot = -1 - (free_slots.pop(free_slots.index(own)) if own in free_set else free_slots.pop(0))
                free_set.discard(-1 - slot)
            if s.length > lay.max_tokens:
                raise CacheFullError(f"sequence {s.id} of {reader.where} has {s.length} tokens, more than "
                                     f"store {core.name!r}'s max_tokens={lay.max_tokens}")
            cap, start = _place(core, max(1, min(max(s.capacity, s.length), lay.max_tokens)), s.length, taken,
                                direct)
            taken.append((start, cap))
            plan.append((s, slot, start))
            if s.encoder_length:
                if not free_slots:
                    raise CacheFullError(
                        f"store {core.name!r} has no free slot for the encoder cache of sequence {s.id} "
                        f"(max_seqs={lay.max_seqs}); free sequences or restore fewer (seq_ids=)"
                    )
                enc_slot[s.id] = free_slots.pop()  # from the end: rows of ids to come stay free
                free_set.discard(enc_slot[s.id])
                enc_start[s.id] = core.alloc(s.encoder_length, taken, all_layers=True)
                taken.append((enc_start[s.id], s.encoder_length))
        # stream every array; those selected land in their staged (unpublished) ranges
        by_id = {p[0].id: p for p in plan}
        done = 0
        k = 0
        checks: list[Future[None]] = []
        # sliding/chunked layers' tokens go to private buffers first: an existing
        # sequence's window buffer is live until the publish step below
        windows: dict[tuple[int, int, int], np.ndarray] = {}
        with ThreadPoolExecutor(1) as pool:
            for s in snap.sequences:
                p = by_id.get(s.id)
                for part in seq_parts(lay, s):
                    nbytes = part.tokens * token_bytes(lay, part.region)
                    arr = _regions(core)[part.region]
                    if not (p and nbytes):
                        dest = None
                    elif part.window:
                        buf = windows[(s.id, part.region, part.layer)] = np.empty((part.tokens, *arr.shape[2:]),
                                                                                   arr.dtype)
                        dest = memoryview(buf).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
                    else:
                        a = enc_start[s.id] if part.encoder else p[2]
                        view = arr[part.layer, a : a + part.tokens]
                        dest = memoryview(view).cast("B")
                    what = (f"sequence {s.id} layer {part.layer} {'encoder ' if part.encoder else ''}"
                            f"{REGION_NAMES[part.region]}")
                    # from a file into the main arena: the kernel copies (no zeroing, no user-space copy)
                    copy_in = (core.file_copier(view)
                               if dest is not None and direct and not part.window else None)
                    fut = reader.array(dest, nbytes, int(snap.checksums[k]), what, pool, copy_in=copy_in)
                    if fut is not None:
                        checks.append(fut)
                    k += 1
                    done += nbytes
                    if progress:
                        progress(done, total)
            for fut in checks:
                fut.result()  # raises the first mismatch
        if is_file and not reader.at_end():
            raise reader.fail(f"unexpected data after the last array (byte {reader.offset})")
        caps = dict(taken)  # staged start -> capacity (a lookup, no generator: see ARCHITECTURE.md, Descriptors)
        for s, _, start in plan:  # written: now the rest of each range
            core.settle(start, s.length, caps[start])
        # everything checked: publish
        # one atomic unit: after a crash, every sequence as it was (crash recovery in _store)
        with core.transaction():
            past = 0  # the ids restored end below it
            for i, (s, existing, start) in enumerate(plan):
                cap = caps[start]
                assert s.tokens is not None and s.positions is not None
                core.tokens[start : start + s.length] = s.tokens
                core.positions[start : start + s.length] = s.positions
                slot = existing if existing >= 0 else -1 - existing
                row = core.row(slot)
                if existing >= 0:  # its content goes: holders its index entries stood for get theirs
                    core.unindexing(slot, 0)
                with core.changing(row):
                    if existing < 0:
                        core.new_incarnation(row)  # a handle on a freed sequence of that id stays dead
                        core.reserve_window(slot)
                    # a live sequence's window goes into its other buffer (its own stays intact)
                    wb = rows.restore_buffer(row, fresh=existing < 0)
                    w = core.wcell(slot, wb)
                    for (sid, r, layer), buf in windows.items():
                        if sid == s.id:
                            (core.Kl if r == 0 else core.Vl)[layer][w : w + buf.shape[0]] = buf
                    rows.publish(row, start, cap, s.length, window_offset=s.window_offset, wbuf=wb,
                                 new_id=None if existing >= 0 else s.id)
                    if s.encoder_length:
                        core.set_encoder(row, s.encoder_length, enc_start[s.id], enc_slot[s.id])
                    else:
                        core.drop_encoder(row)
                if i == 0:
                    _crash.point("restore.published")
                past = max(past, s.id + 1)
            # the prefix cache: finished flags, LRU order (oldest use first) and the index
            for s, existing, _ in sorted(plan, key=lambda p: p[0].recency):
                core.restored(existing if existing >= 0 else -1 - existing, s.finished, s.clean, s.meta)
            rows.raise_next_id(past)  # inside the unit: rows back after a crash, ids not reused
    return [p[0].id for p in plan]


def _place(core: Port, cap: int, length: int, taken: list[tuple[int, int]], stage: bool) -> tuple[int, int]:
    """(capacity, start) of a restored sequence's range: its capacity, else only its tokens if
    that is all that fits, on a page unit where one fits, as ``create_sequence(prefix=)`` places
    a prompt (a range on a page unit may lend its pages to later reuses, docs/design.md §11).
    From a file the arrays arrive through the descriptor, which allocates (Pages.stage); the
    pages past ``length`` are reserved as writes need them."""
    tries = [(c, a) for c in dict.fromkeys((cap, max(1, length))) for a in dict.fromkeys((core.unit_for(c, 0), 1))]
    for c, align in tries[:-1]:
        try:
            return c, core.alloc(c, taken, stage=stage, fill=length, align=align)
        except CacheFullError:
            pass
    c, align = tries[-1]
    return c, core.alloc(c, taken, stage=stage, fill=length, align=align)  # (the last: its CacheFullError is ours)


def _regions(core: Port) -> tuple[Any, ...]:
    """The arrays a part's region names: K, V, K scales, V scales (the scales are None on float
    stores, whose snapshots have no parts in them)."""
    return (core.K, core.V, core.KS, core.VS)


def _own(core: Port, slot: int) -> int:
    return own_token(core.row(slot))


def _check_windows(name: str, lay: Layout, snap: Snapshot, selected: set[int], where: str) -> None:
    """A snapshot's sliding and chunked layers fit store ``name``'s: the same window and chunk
    (the tokens kept are the ones a decode there attends to), and each sequence's kept tokens
    within a slot's window buffer (``memory`` sizes it). Else LayoutMismatchError, nothing changed."""
    if (snap.layout.window, snap.layout.chunk) != (lay.window, lay.chunk):
        raise LayoutMismatchError(
            f"{where}: snapshot's sliding window {snap.layout.window} and chunk {snap.layout.chunk} differ from "
            f"store {name!r}'s ({lay.window}, {lay.chunk}): its bounded layers keep other tokens; restore into a "
            f"store created with window={snap.layout.window or None}, chunk={snap.layout.chunk or None} "
            "(shmkv.load creates one)")
    for s in snap.sequences:
        if s.id in selected and s.length - s.window_offset > lay.window_cells:
            raise LayoutMismatchError(
                f"{where}: sequence {s.id} keeps {s.length - s.window_offset} tokens in its sliding/chunked layers, "
                f"more than a slot of store {name!r} holds ({lay.window_cells}: memory={lay.memory}); restore into "
                f"a store created with memory={snap.layout.memory or None} (shmkv.load creates one)")


def load_with(create: Callable[..., S], core_of: Callable[[S], Port], source: Any, name: str, *, persistent: bool,
              max_tokens: int | None, max_seqs: int | None, progress: Progress | None, **create_kw: Any) -> S:
    """``shmkv.load``: ``create`` (``shmkv.create``) store ``name`` with a snapshot's layout, restore it all
    into its engine (``core_of``). The caller removes the store if this raises (``_lifecycle.load``
    keeps it as the create makes it)."""
    check_progress("load", progress)
    fixed = sorted(set(create_kw) & {"layers", "kv_heads", "head_dim", "dtype", "layer_types", "window", "chunk",
                                      "memory"})
    if fixed:
        raise InvalidArgumentError(f"load: {', '.join(f'{k}=' for k in fixed)} comes from the snapshot's layout: leave "
                                   "it out (restore() into a store you create fills one of another capacity)")
    with open_source(source) as (reader, is_file):
        snap = reader.header()
        lay = snap.layout
        # an encoder cache takes a table row and a range of its own
        encoders = [s for s in snap.sequences if s.encoder_length]
        need_tokens = sum(max(1, s.length) for s in snap.sequences) + sum(s.encoder_length for s in encoders)
        store = create(
            name, layers=lay.layers, kv_heads=lay.kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
            max_tokens=max_tokens or max(lay.max_tokens, need_tokens),
            max_seqs=max_seqs or max(lay.max_seqs, len(snap.sequences) + len(encoders)),
            layer_types=list(lay.layer_types), window=lay.window or None, chunk=lay.chunk or None,
            memory=lay.memory or None, persistent=persistent, **create_kw,
        )
        _restore(core_of(store), reader, snap, is_file, seq_ids=None, progress=progress)
    return store


__all__ = ["load_with", "restore"]
