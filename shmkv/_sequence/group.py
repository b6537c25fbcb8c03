"""Operations on several sequences at once, through the public ``Sequence`` / ``Store`` API:
all-or-none creation (``store.create_sequences``) and leases (``store.lease``), regathering a
batch's rows (``store.regather``) and reading one layer of a batch (``store.batch_kv``).

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

from shmkv._sequence.mirror import Int8Mirror
from shmkv._sequence import quant as _quant
from shmkv._engine.checks import count, int_list
from shmkv._sequence.handle import Sequence, writer_part
from shmkv.errors import InvalidArgumentError, ReadOnlyError, StoreClosedError

if TYPE_CHECKING:
    from shmkv._sequence.handle import Owner


def create_sequences(store: Owner, n: int, capacity: int, prefix: Iterable[Any] | None = None) -> list[Sequence]:
    """``store.create_sequences``: ``n`` new sequences (write handles), every one or none."""
    n = count("n", n)
    prompts = None if prefix is None else list(prefix)
    if prompts is not None and len(prompts) != n:
        raise InvalidArgumentError(f"create_sequences: prefix= gives {len(prompts)} prompts for n={n} "
                                   "sequences: pass one prompt per sequence (or prefix=None)")
    made: list[Sequence] = []
    try:
        with store.transaction():  # one lock hold: no other process's create lands between them
            for i in range(n):
                made.append(store.create_sequence(capacity, prefix=None if prompts is None else prompts[i]))
    except BaseException:
        for s in made:
            s.free()
        raise
    return made


def lease(store: Owner, seq_ids: Iterable[int]) -> list[Sequence]:
    """``store.lease``: write handles on every sequence of ``seq_ids``, in that order, or none."""
    ids = int_list("lease", "seq_ids", seq_ids)
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


def _handles(what: str, seqs: Any) -> list[Sequence]:
    """``seqs`` as a list, each a Sequence handle (a bare id or None is refused, naming it)."""
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
        raise InvalidArgumentError(f"{what}: seqs={seqs!r} must be a list of Sequence handles")
    seqs = list(seqs)
    for s in seqs:
        if not isinstance(s, Sequence):
            raise InvalidArgumentError(f"{what}: seqs holds {s!r}, not a Sequence handle "
                                       "(store.sequence(id) makes one)")
    return seqs


def regather(store: Owner, seqs: list[Sequence], rows: Iterable[int]) -> list[Sequence]:
    """``store.regather``: handles whose row i holds what ``seqs[rows[i]]`` holds."""
    seqs = _handles("regather", seqs)
    rows = int_list("regather", "rows", rows)
    b = len(seqs)
    bad = [r for r in rows if not 0 <= r < b]
    if bad:
        raise InvalidArgumentError(f"regather: rows={rows[:16]} pick row {bad[0]} of {b} sequences: "
                                   f"each must be in [0, {b})")
    seen: set[int] = set()
    for s in seqs:
        if s.store is not store:  # (first: a handle of another store may share an id with one of these)
            raise InvalidArgumentError(
                f"regather: sequence {s.id} is a handle of another attachment of store {store.name!r}; "
                "pass handles from the store object regather is called on"
            )
        if s.id in seen:
            raise InvalidArgumentError(f"regather: sequence {s.id} is given twice in seqs")
        seen.add(s.id)
        if not s.writable:
            if store.closed:
                raise StoreClosedError(f"store {store.name!r} is closed: attach again with "
                                       f"shmkv.attach({store.name!r})")
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


def batch_kv(store: Owner, seqs: Iterable[Sequence], layer: int, pending: bool,
             writable: bool) -> tuple[np.ndarray, np.ndarray]:
    """``store.batch_kv``: keys and values ``[B, T, kv_heads, head_dim]`` of one layer of ``seqs``.

    One strided view over the shared arrays when the rows' cells sit equally spaced in
    increasing order (the stored dtype read as is: plain floats, bfloat16 with ml_dtypes),
    checked from the rows on every call; otherwise a gathered copy.
    """
    seqs = _handles("batch_kv", seqs)
    if not seqs:
        raise InvalidArgumentError("batch_kv: seqs is empty; pass at least one sequence handle")
    parts = []
    for s in seqs:
        if s.store is not store:
            raise InvalidArgumentError(
                f"batch_kv: sequence {s.id} is a handle of another attachment of store {store.name!r}; "
                "pass handles from the store object batch_kv is called on"
            )
        if writable and not s.writable:
            raise ReadOnlyError(f"batch_kv: writable=True, but the handle of sequence {s.id} is read-only; "
                                f"take the lease with store.sequence({s.id}, write=True) or pass writable=False")
        parts.append(writer_part(s))
    w0 = parts[0]
    layer = w0.r.layer(layer)
    cells: list[tuple[int, int]] = []
    for w in parts:
        w.r.readable()  # (a row whose shared pages this process could not map: ShareError)
        c = w.pending_cells(layer) if pending else None  # None: no pending tokens, the committed ones
        if c is None:
            lo, hi, _, _ = w.r.held(layer)
            c = (lo, hi)
        cells.append(c)
    lo0, hi0 = cells[0]
    n = hi0 - lo0
    if any(hi - lo != n for lo, hi in cells):
        raise InvalidArgumentError(
            f"batch_kv: the sequences {[s.id for s in seqs][:16]} hold {[hi - lo for lo, hi in cells][:16]} "
            f"tokens on layer {layer}: a [B, T, ...] batch needs equal lengths (truncate or pad them)"
        )
    b = len(cells)
    d = cells[1][0] - lo0 if b > 1 else 0
    bf16 = None if w0.plain else _quant.BF16  # bfloat16 bits read as ml_dtypes' bfloat16
    as_is = w0.plain or (w0.dtype == "bfloat16" and bf16 is not None)
    if as_is and n and (b == 1 or d > 0) and all(c[0] == lo0 + i * d for i, c in enumerate(cells)):
        out = []
        for a in ((w0.Kw, w0.Vw) if writable else (w0.Kr, w0.Vr)):
            arr = a[layer]  # the layer's cells (a read-only one exports a read-only buffer); numpy
            st = arr.strides  # checks the view fits inside it (as_strided costs 3x this)
            v = np.ndarray((b, n, *arr.shape[1:]), arr.dtype, arr, lo0 * st[0], (d * st[0], *st))
            out.append(v if bf16 is None else v.view(bf16))
        return out[0], out[1]
    got = []
    staged = [Int8Mirror.staged_rows(w, layer) if pending else None for w in parts]  # int8: pending in mirrors
    for i, which in enumerate(("k", "v")):
        rows = [w.r.view(which, layer, lo, hi) if st is None else st[i]
                for w, (lo, hi), st in zip(parts, cells, staged, strict=True)]
        g = np.empty((b, *rows[0].shape), rows[0].dtype)
        for j, r in enumerate(rows):
            g[j] = r
        got.append(g)
    return got[0], got[1]
