"""``Sequence.rewind``: truncate further back than the sliding/chunked layers still hold, with
the states the caller kept for them.

A sliding or chunked layer keeps a bounded window buffer (``window_cells`` per sequence,
``_engine.table.header``); a forward longer than ``step`` (``memory=``) is committed in steps, and
each step compacts the buffer, so afterwards the layer no longer holds the ``keep`` tokens
before the forward's start. ``truncate`` back there is refused (``check_resumable``). The
Hugging Face adapter's ``crop`` after such a forward (assisted decoding's long first forward)
has those states in hand: the forward's own keys and values and the ones it attended to
before. ``rewind`` writes them as the layers' new window, in the slot's other buffer, and
switches the row to it (WBUF, WIN_OFF, LENGTH together under the row's seqlock: a crash
leaves the sequence as it was, as ``compact`` does).

The caller vouches that the states are the ones the sequence computed for those positions
(they are not compared: the old window no longer has them).
"""

from __future__ import annotations

from typing import Any


from shmkv._engine.locking import crash as _crash
from shmkv._engine.checks import as_arrays, count
from shmkv._sequence.structural import structural, unindex_from
from shmkv._sequence.writer import SeqWriter
from shmkv.errors import InvalidArgumentError


def rewind(w: SeqWriter, n: Any, k_window: Any, v_window: Any) -> None:
    """Sequence.rewind (its docstring tells the contract)."""
    n = count("n", n)
    lay = w.port.layout
    nb = len(lay.bounded)
    k, v = as_arrays("rewind", {"k_window": k_window, "v_window": v_window})
    H, D = w.cell
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != nb or k.shape[2:] != (H, D):
        raise InvalidArgumentError(
            f"rewind: k_window {k.shape} and v_window {v.shape} must both be [bounded layers={nb}, m, "
            f"kv_heads={H}, head_dim={D}]: the states of tokens n-m..n-1 on each sliding/chunked layer "
            f"{list(lay.bounded)}"
        )
    if k.dtype.kind != "f" or v.dtype.kind != "f":
        raise InvalidArgumentError(f"rewind: k_window dtype {k.dtype} / v_window dtype {v.dtype} must be float")
    m = k.shape[1]
    rows = w.r.rows
    with structural(w, "rewind") as row:
        length = rows.length(row)
        if n > length:
            raise InvalidArgumentError(
                f"rewind: n={n} exceeds the length {length} of sequence {w.id}: rewind only goes back"
            )
        if m > n or m > w.wc:
            raise InvalidArgumentError(
                f"rewind: a window of m={m} tokens for n={n}: need m <= n and m <= {w.wc} (the window "
                "buffer's cells: keep + memory)"
            )
        woff = n - m
        if nb and m < min(n, lay.keep):  # the rule truncate keeps (check_resumable)
            raise InvalidArgumentError(
                f"rewind: a window of m={m} tokens before n={n}; a next token needs the {lay.keep} "
                f"before it on sliding/chunked layers: pass m >= {min(n, lay.keep)}"
            )
        held_from, wb = rows.window(row)
        if woff >= held_from:  # the layers hold all of it already: a plain truncate
            rows.rewound(row, n, None)
        else:
            b0 = w.port.wcell(w.slot, 1 - wb)  # the other buffer: no row points there
            for i, layer in enumerate(lay.bounded):
                w.Kw[layer][b0 : b0 + m] = k[i]
                w.Vw[layer][b0 : b0 + m] = v[i]
            _crash.point("rewind.copied")
            rows.rewound(row, n, (1 - wb, woff))  # WBUF, WIN_OFF, LENGTH (WIN_OFF 0 at a length of 0)
        unindex_from(w, row, n)
