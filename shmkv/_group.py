"""Operations on several sequences at once, through the public ``Sequence`` / ``Store`` API:
all-or-none leases (``store.lease``) and regathering a batch's rows (``store.regather``).

A batch of a model is one sequence per row; beam search and contrastive search
reorder, repeat and drop rows every step. ``regather`` does that without a
fork and a free per row: a row's first use keeps its sequence, repeats are
copied into sequences no row keeps any more (no allocation), and only what is
left over is forked or freed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidArgumentError, ReadOnlyError

if TYPE_CHECKING:
    from ._sequence import Sequence
    from ._store import Store


def _id_list(name: str, values: Iterable[Any]) -> list[int]:
    values = list(values)
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise InvalidArgumentError(f"{name}={values!r} must be ints")
    return [int(x) for x in values]


def lease(store: Store, seq_ids: Iterable[int]) -> list[Sequence]:
    """``store.lease``: write handles on every sequence of ``seq_ids``, in that order, or none."""
    ids = _id_list("seq_ids", seq_ids)
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"seq_ids={ids} names a sequence twice: pass each id once")
    taken: list[Sequence] = []
    try:
        for i in ids:
            taken.append(store.sequence(i, write=True))
    except BaseException:
        for s in taken:
            s.release()
        raise
    return taken


def regather(store: Store, seqs: list[Sequence], rows: Iterable[int]) -> list[Sequence]:
    """``store.regather``: handles whose row i holds what ``seqs[rows[i]]`` holds."""
    seqs = list(seqs)
    rows = _id_list("rows", rows)
    b = len(seqs)
    bad = [r for r in rows if not 0 <= r < b]
    if bad:
        raise InvalidArgumentError(f"regather: rows={rows[:16]} pick row {bad[0]} of {b} sequences: "
                                   f"each must be in [0, {b})")
    seen: set[int] = set()
    for s in seqs:
        if s.id in seen:
            raise InvalidArgumentError(f"regather: sequence {s.id} is given twice in seqs")
        seen.add(s.id)
        if s.store is not store:
            raise InvalidArgumentError(
                f"regather: sequence {s.id} is a handle of another attachment of store {store.name!r}; "
                "pass handles from the store object regather is called on"
            )
        if not s.writable:
            raise ReadOnlyError(f"regather: sequence {s.id} handle is read-only; take the lease with "
                                f"store.sequence({s.id}, write=True)")
        pending = [s.pending_on(layer) for layer in range(store.layout.layers)]
        if any(pending):
            raise InvalidArgumentError(f"regather: sequence {s.id} has uncommitted tokens {pending}; "
                                       "commit() or discard() them first")
    out: list[Sequence | None] = [None] * len(rows)
    repeats: list[int] = []  # rows of out that need a copy
    kept: set[int] = set()
    for i, r in enumerate(rows):
        if r in kept:
            repeats.append(i)
        else:
            kept.add(r)
            out[i] = seqs[r]
    # spares (no row keeps them) take copies in place: cleared, then within their capacity and
    # without an encoder to drop; a source with an encoder is forked (fork carries it)
    spares = sorted((s for r, s in enumerate(seqs) if r not in kept and not s.encoder_length),
                    key=lambda s: s.capacity)
    lengths = [s.length for s in seqs]
    into: list[tuple[int, Sequence]] = []  # (row of out, spare)
    to_fork: list[int] = []
    for i in repeats:
        src = seqs[rows[i]]
        fit = None if src.encoder_length else next((s for s in spares if s.capacity >= lengths[rows[i]]), None)
        if fit is None:
            to_fork.append(i)
        else:
            spares.remove(fit)
            into.append((i, fit))
    # everything that allocates first: a CacheFullError here leaves every sequence as it was
    forks: list[Sequence] = []
    try:
        for i in to_fork:
            forks.append(seqs[rows[i]].fork())
    except BaseException:
        for f in forks:
            f.free()
        raise
    for i, f in zip(to_fork, forks, strict=True):
        out[i] = f
    for i, spare in into:
        r = rows[i]
        spare.clear()
        if lengths[r]:
            store.copy_prefix(seqs[r].id, spare.id, lengths[r])  # within its capacity: no allocation
        if spare.meta:
            spare.meta = {}  # a copy starts as a fork does
        out[i] = spare
    used = {id(s) for s in out}
    for s in seqs:
        if id(s) not in used:
            s.free()
    return [s for s in out if s is not None]
