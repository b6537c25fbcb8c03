"""Writing many tokens of every layer at once through a write handle's writer part:
``extend`` (a prefill: written through the data segment's descriptor into fresh cells, else
appended layer by layer, then committed), ``extend(in_steps=True)`` on sliding/chunked stores
(room made first, then a commit every ``step``) and the encoder cache (``set_encoder``, under
the store lock). ``Sequence`` calls these with its ``writer.SeqWriter``; the per-token path
(append, commit) stays in the writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.checks import as_arrays, ints
from shmkv._engine.table.header import CAPACITY, FLAGS, LENGTH, LENT
from shmkv._sequence import quant as _quant
from shmkv._sequence.mirror import Int8Mirror
from shmkv._sequence.room import leave_loans
from shmkv._sequence.writer import real, write_rows
from shmkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shmkv._sequence.writer import SeqWriter

__all__ = ["extend", "set_encoder"]


def check_all_layers(w: SeqWriter, what: str, k_all: np.ndarray, v_all: np.ndarray) -> None:
    """``[layers, n, kv_heads, head_dim]`` K and V of every layer (extend, set_encoder)."""
    H, D = w.cell
    if k_all.ndim != 4 or k_all.shape[0] != w.L or k_all.shape[2:] != (H, D) or v_all.shape != k_all.shape:
        raise InvalidArgumentError(
            f"{what}: k_all {k_all.shape} and v_all {v_all.shape} must both be "
            f"[layers={w.L}, n, kv_heads={H}, head_dim={D}]"
        )


def extend(w: SeqWriter, k_all: Any, v_all: Any, tokens: Any = None, positions: Any = None, *,
           in_steps: bool = False) -> int:
    """``Sequence.extend``: ``n`` tokens of every layer written and committed; the new length."""
    if not isinstance(in_steps, bool):
        raise InvalidArgumentError(f"extend: in_steps={in_steps!r} must be True or False")
    w.need_writer("extend")
    if any(w.pending):
        raise InvalidArgumentError(
            f"extend: sequence {w.id} has uncommitted appends {w.pending}; commit() them first"
        )
    k_all, v_all = as_arrays("extend", {"k_all": k_all, "v_all": v_all})
    check_all_layers(w, "extend", k_all, v_all)
    n = k_all.shape[1]
    if tokens is not None:
        ints("tokens", tokens, n)
    if positions is not None:
        ints("positions", positions, n)
    lay = w.port.layout
    if w.mirror is not None:  # (cells after the length are written here, not through the mirror)
        w.mirror.clamp(w.row[LENGTH])
    if in_steps and lay.bounded and n > lay.step:
        return extend_in_steps(w, k_all, v_all, tokens, positions, step=lay.step)
    try:
        if w.row[FLAGS] & LENT and w.lent_past:  # cells it lent may lie past its length: it moves
            leave_loans(w)  # first (_sequence/room.py)
        # fresh cells (a prefill): written through the segment's descriptor (no page zeroing)
        if w.port.write_new(w.start, w.row[LENGTH], w.row[CAPACITY], k_all, v_all):
            w.pending = [n] * w.L
        else:
            for layer in range(w.L):  # (int8: quantized, its non-finite values refused, here)
                w.append_checked(layer, k_all[layer], v_all[layer], views=False)
        return w.commit(tokens, positions)
    except BaseException:
        w.abandon()  # the pending tokens and the generation, together: re-read at the next use
        raise


def extend_in_steps(w: SeqWriter, k_all: np.ndarray, v_all: np.ndarray, tokens: Any, positions: Any, *,
                    step: int) -> int:
    """extend(in_steps=True) of more tokens than a window buffer takes between commits: room
    for all of them first (a CacheFullError changes nothing), then a commit every ``step``."""
    n = k_all.shape[1]
    tok = None if tokens is None else ints("tokens", tokens, n)
    pos = None if positions is None else ints("positions", positions, n)
    row, rows = w.row, w.r.rows
    length = rows.length(row)
    if pos is not None:
        last = int(w.positions[w.start + length - 1]) if length else -1
        if pos[0] <= last or np.any(np.diff(pos) <= 0):
            raise InvalidArgumentError(
                f"extend: positions {pos.tolist()[:8]} must increase, after the last committed position {last}"
            )
    if length + n > rows.capacity(row):
        w.grow(length + n)
    try:
        for a in range(0, n, step):
            for layer in range(w.L):
                w.append(layer, k_all[layer, a : a + step], v_all[layer, a : a + step])
            w.commit(None if tok is None else tok[a : a + step], None if pos is None else pos[a : a + step])
    except BaseException:
        w.abandon()  # the pending tokens and the generation, together: re-read at the next use
        raise
    return int(length + n)


def _int8_codes(x_all: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes ``[layers, n, kv_heads, head_dim]`` and scales ``[layers, n, kv_heads]`` of
    ``x_all`` (checked finite), as ``writer.write_rows`` encodes them, layer by layer."""
    codes = np.empty(x_all.shape, np.int8)
    scales = np.empty(x_all.shape[:3], np.float32)
    for layer in range(x_all.shape[0]):
        _quant.quantize_into(x_all[layer], codes[layer], scales[layer])
    return codes, scales


def set_encoder(w: SeqWriter, k_all: Any, v_all: Any) -> None:
    """``Sequence.set_encoder``: a fresh encoder range of every layer, written under the lock
    (int8: quantized before it, only copied under it; tests/test_encoder_quant_unlocked.py)."""
    w.need_writer("set_encoder")
    k_all, v_all = as_arrays("set_encoder", {"k_all": k_all, "v_all": v_all})
    check_all_layers(w, "set_encoder", k_all, v_all)
    if not (real(k_all.dtype) and real(v_all.dtype)):
        raise InvalidArgumentError(f"set_encoder: dtypes {k_all.dtype}/{v_all.dtype} are not real numbers")
    coded = None
    if w.dtype == "int8":
        _quant.check_finite(k_all, "k_all")
        _quant.check_finite(v_all, "v_all")
        # quantized before the lock: a process's first quantization loads (or compiles) the
        # compiled loops, 0.3 to 4 s that would stall every other process's truncate
        coded = (_int8_codes(k_all), _int8_codes(v_all))
    n = k_all.shape[1]
    K, V, KS, VS = w.r.arena
    with w.port.locked():
        row = w.row
        w.r.span_unlocked()
        with w.port.changing(row):
            start = w.port.set_encoder(row, n)
            for layer in range(w.L):  # the main arena of every layer (K, not Kw)
                if coded is not None:
                    assert KS is not None and VS is not None  # int8: every layer has its scales
                    for (q, qs), arrs, sarrs in zip(coded, (K, V), (KS, VS), strict=True):
                        arrs[layer][start : start + n] = q[layer]
                        sarrs[layer][start : start + n] = qs[layer]
                    continue
                for x, arrs, scales in ((k_all[layer], K, KS), (v_all[layer], V, VS)):
                    write_rows(w, arrs[layer], None if scales is None else scales[layer], start, x)
            _crash.point("set_encoder.written")
        Int8Mirror.moved(w, w.r.rows.generation(row))  # our own change: pending decoder tokens stay
