"""int8 stores: the write handle's dequantized mirror, what ``append`` returns views of.

Dequantizing a whole layer at every appended token made an int8 decode step O(context)
(987x a float16 store's at 2048 tokens: issue 24). The write handle keeps instead, per layer,
a process-local float32 copy ``[2 (K, V), tokens, kv_heads, head_dim]`` of what the shared
cells hold, tokens ``[0, n)``; an append quantizes its new tokens into the shared cells and
writes their dequantized values (``codes * scales``, bit for bit what a reader's
``keys()`` gives) into the mirror, and returns read-only views of it: O(new tokens).

Why it stays right: committed cells never change under one row generation, and only the
lease holder, this handle, writes its pending cells (through here). So the mirror is valid
while the row's generation is the one it was made at. Any other generation (a copy_prefix
into the sequence, a take-over, shift_left, remove, a move, another process's writes
under a lease this handle no longer holds) rebuilds it from the cells, once, at the next
append. This handle's own truncate keeps the first ``n`` tokens (``keep``): the
speculative-decoding step stays O(1). A discarded pending token is simply written again.

Memory: 4 bytes per value against the store's 1 (K and V of every layer the handle has
appended to), grown by doubling up to the sequence's capacity, per write handle, freed when
the lease is given up. The shared store stays int8.
"""

from __future__ import annotations

import numpy as np

from shmkv._engine.header import CAPACITY
from shmkv._sequence import quant as _quant

__all__ = ["Int8Mirror"]

Arrays = list[np.ndarray]


class Int8Mirror:
    """One write handle's dequantized copy of its int8 sequence (see the module docstring).

    ``Kw``, ``Vw``, ``KS``, ``VS``: the store's writable per-layer codes and scales; ``row``:
    the sequence's table row (its capacity bounds the mirror)."""

    __slots__ = ("KS", "Kw", "VS", "Vw", "arrays", "cell", "gen", "n", "row", "views")

    def __init__(self, *, Kw: Arrays, Vw: Arrays, KS: Arrays, VS: Arrays, cell: tuple[int, int],
                 row: memoryview) -> None:
        self.Kw, self.Vw, self.KS, self.VS = Kw, Vw, KS, VS
        self.cell = cell
        self.row = row
        L = len(Kw)
        self.arrays: list[np.ndarray | None] = [None] * L  # per layer [2, tokens, H, D] float32
        self.views: list[np.ndarray | None] = [None] * L  # their read-only views (append returns slices)
        self.n = [0] * L  # tokens [0, n) of each layer mirrored
        self.gen = -2  # the row generation the mirror is valid at

    def append(self, layer: int, t0: int, s: int, k: np.ndarray, v: np.ndarray, *,
               gen: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [t0, t0 + n) of ``layer`` (checked ``k``, ``v``) into cells s.. and the mirror,
        the handle's row generation being ``gen``; returns the views ``[t0 + n, kv_heads,
        head_dim]`` of K and V (the caller counts the pending tokens)."""
        n = k.shape[0]
        if self.gen != gen:
            self.n = [0] * len(self.n)
            self.gen = gen
        m = min(self.n[layer], t0)  # (pending tokens dropped since: discard, a failed batch)
        end = t0 + n
        mir = self.arrays[layer]
        if mir is None or mir.shape[1] < end:
            mir = self.room(layer, end, m)
        Kw, Vw, KS, VS = self.Kw[layer], self.Vw[layer], self.KS[layer], self.VS[layer]
        if m < t0:  # catch up from the cells: after extend, a rebuild, a new handle
            a = s - (t0 - m)
            np.multiply(Kw[a:s], KS[a:s, :, None], out=mir[0, m:t0])
            np.multiply(Vw[a:s], VS[a:s, :, None], out=mir[1, m:t0])
        _quant.quantize_pair(k, v, kc=Kw[s : s + n], vc=Vw[s : s + n], ks=KS[s : s + n], vs=VS[s : s + n],
                             mirror=mir[:, t0:end])
        self.n[layer] = end
        r = self.views[layer]
        assert r is not None
        return r[0, :end], r[1, :end]

    def room(self, layer: int, end: int, keep: int) -> np.ndarray:
        """A mirror of ``layer`` for at least ``end`` tokens (doubling: amortized O(1) a token),
        its first ``keep`` tokens carried over."""
        old = self.arrays[layer]
        cap = max(end, 16, 2 * (old.shape[1] if old is not None else 0))
        cap = min(cap, max(end, self.row[CAPACITY]))
        new = np.empty((2, cap, *self.cell), np.float32)
        if old is not None and keep:
            new[:, :keep] = old[:, :keep]
        self.arrays[layer] = new
        ro = new.view()
        ro.flags.writeable = False
        self.views[layer] = ro
        return new

    def keep(self, n: int, gen: int) -> None:
        """After the handle's own change that kept the first ``n`` tokens where they were
        (truncate): valid at the handle's new generation ``gen``."""
        self.n = [min(m, n) for m in self.n]
        self.gen = gen
