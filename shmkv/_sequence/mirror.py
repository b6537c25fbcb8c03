"""int8 stores: the write handle's float32 mirror, what ``append`` returns views of.

Dequantizing a whole layer at every appended token made an int8 decode step O(context)
(987x a float16 store's at 2048 tokens), and quantizing each layer's new token at
its append cost a dozen numpy calls per array (9.5x). The write handle keeps instead one
process-local float32 array ``[layers, 2 (K, V), tokens, kv_heads, head_dim]``:

* ``append`` writes the new tokens' values into it, as given (cast to float32), and returns
  read-only views of it: O(new tokens), one cast per array (float16 input: one compiled
  call for both, with numba: ``quant_jit.put_f16``);
* ``commit`` quantizes the pending tokens of every layer in one pass
  (:meth:`Int8Mirror.quantize`: one compiled call, ``quant_jit.commit_rows``, with numba;
  else about a dozen numpy calls for all layers together), writes codes and scales into
  the shared cells, and only then publishes the length; it rewrites those mirror cells
  with their dequantized values, what a reader's ``keys()`` gives (equal to it; the sign
  of a zero may differ, -0.0 where a tiny negative value rounded to code 0).

So a view ``append`` returned shows the committed tokens dequantized and the pending ones
exact (as given, in float32) until their commit; from the commit on, it equals the
dequantization of the shared cells (tests/test_int8_mirror.py checks it after every step).
transformers' QuantizedCache keeps a full-precision residual the same way. Other processes
only ever see quantized cells: nothing un-quantized is written to shared memory, and an
exception or a crash between append and commit loses only the pending tokens.

Why it stays right: committed cells never change under one row generation, and only the
lease holder, this handle, writes its pending cells. The mirror is valid at the generation
it was made at. This handle's own changes that keep the cells (growth, meta, set_tokens,
set_encoder) move it to the new generation (:meth:`Int8Mirror.moved`); its own truncate keeps
the first ``n`` tokens (:meth:`Int8Mirror.keep`: the speculative-decoding step stays O(1));
any other generation (a copy_prefix into the sequence, a take-over, shift_left, remove,
another process's writes) re-reads the committed tokens from the cells, once, at the next
append (:meth:`Int8Mirror.sync`).

Memory: 4 bytes per value against the store's 1 (K and V of every layer), grown by doubling
up to the sequence's capacity, per write handle, freed when the lease is given up. The shared
store stays int8.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmkv._engine.table.header import CAPACITY, GEN, LENGTH
from shmkv._sequence import quant as _quant
from shmkv.errors import InvalidArgumentError

__all__ = ["Int8Mirror"]

_PASS_ITEMS = 1 << 16  # values quantized per pass at commit: the scratch stays in cache


class Int8Mirror:
    """One write handle's float32 copy of its int8 sequence (see the module docstring).

    ``K``, ``V``, ``KS``, ``VS``: the store's writable codes ``[layers, max_tokens, kv_heads,
    head_dim]`` and scales ``[layers, max_tokens, kv_heads]`` (int8 stores have full layers
    only: token ``t`` of every layer is cell ``start + t``); ``row``: the sequence's table row
    (its capacity bounds the mirror)."""

    __slots__ = ("K", "KS", "M", "V", "VS", "cap", "cell", "flat", "gen", "jit", "kv", "n", "put16", "row", "scratch",
                 "vv", "wk", "wv")

    def __init__(self, *, K: np.ndarray, V: np.ndarray, KS: np.ndarray, VS: np.ndarray, cell: tuple[int, int],
                 row: memoryview) -> None:
        self.K, self.V, self.KS, self.VS = K, V, KS, VS
        self.cell = cell
        self.row = row
        L = K.shape[0]
        self.M = np.empty((L, 2, 0, *cell), np.float32)
        self.cap = 0
        self.kv: list[np.ndarray] = []  # per layer: read-only view of M[layer, 0] (append returns slices)
        self.vv: list[np.ndarray] = []
        self.wk: list[np.ndarray] = []  # per layer: M[layer, 0] (what append writes into)
        self.wv: list[np.ndarray] = []
        self.n = [0] * L  # tokens [0, n) of each layer mirrored (pending ones as given)
        self.gen = -2  # the row generation the mirror is valid at
        self.scratch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.jit = _quant.kernels()  # the compiled loops (numba), or None: numpy's calls
        self.flat = _flat(K, V, KS, VS) if self.jit is not None else None
        self.put16 = None if self.jit is None else self.jit.put_f16  # append's float16 (writer.append)

    # -- keeping it current ----------------------------------------------------------------

    @classmethod
    def current(cls, mirror: Int8Mirror | None, arena: tuple[np.ndarray, np.ndarray, np.ndarray | None,
                np.ndarray | None], row: memoryview, *, gen: int, start: int, length: int,
                pending: list[int] | None) -> Int8Mirror:
        """``mirror`` (made if None, from the store's ``arena``: K, V, KS, VS) valid at ``gen``:
        re-read from the cells at ``start`` if it was made at another (see :meth:`sync`)."""
        if mirror is None:
            K, V, KS, VS = arena
            assert KS is not None and VS is not None  # int8: every layer has its scales
            mirror = cls(K=K, V=V, KS=KS, VS=VS, cell=(K.shape[2], K.shape[3]), row=row)
        if mirror.gen != gen:
            mirror.sync(gen, start, length, pending or [0] * mirror.M.shape[0])
        return mirror

    def rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of tokens ``[0, end)`` of ``layer`` (pending ones as given)."""
        return self.kv[layer][:end].copy(), self.vv[layer][:end].copy()

    @staticmethod
    def staged_rows(w: Any, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Copies of ``layer``'s committed and pending tokens from write handle part ``w``'s
        mirror, when its pending tokens are staged there (their cells are written at commit);
        else None (its cells hold what there is)."""
        p = w.pending[layer]
        ok = w.staged and p and w.write and w.row[GEN] == w.gen and w.mirror is not None
        return w.mirror.rows(layer, w.row[LENGTH] + p) if ok else None

    def room(self, end: int) -> None:
        """Room for at least ``end`` tokens in every layer (doubling: amortized O(1) a token)."""
        if end <= self.cap:
            return
        cap = max(end, 16, 2 * self.cap)
        cap = min(cap, max(end, self.row[CAPACITY]))
        old, keep = self.M, min(max(self.n, default=0), self.cap)
        new = np.empty((old.shape[0], 2, cap, *self.cell), np.float32)
        if keep:
            new[:, :, :keep] = old[:, :, :keep]
        new[:, :, keep:] = 0  # its pages faulted in here, not one by one in the decode loop
        ro = new.view()
        ro.flags.writeable = False
        wk = [new[i, 0] for i in range(new.shape[0])]
        wv = [new[i, 1] for i in range(new.shape[0])]
        kv = [ro[i, 0] for i in range(new.shape[0])]
        vv = [ro[i, 1] for i in range(new.shape[0])]
        # one statement, no call between (a Ctrl-C lands only at a call): the views are always of M
        self.M, self.cap, self.wk, self.wv, self.kv, self.vv = new, cap, wk, wv, kv, vv

    def sync(self, gen: int, start: int, length: int, pending: list[int]) -> None:
        """At generation ``gen`` (someone else's change, or a new handle): the committed tokens
        ``[0, length)`` of every layer dequantized from the cells at ``start``; the pending ones
        (this handle's, kept across its own change) stay as they are."""
        keep = [length + p if p and self.gen != -2 and self.n[i] >= length + p else 0 for i, p in enumerate(pending)]
        self.room(max(length, max(keep, default=0)))
        M = self.M
        if length:
            for which, codes, scales in ((0, self.K, self.KS), (1, self.V, self.VS)):
                np.multiply(codes[:, start : start + length], scales[:, start : start + length, :, None],
                            out=M[:, which, :length])
        self.n = [max(length, k) for k in keep]
        self.gen = gen

    def catch_up(self, layer: int, start: int, t0: int) -> None:
        """Tokens ``[n, t0)`` of ``layer`` from the cells (written by ``extend``, not through here)."""
        m = self.n[layer]
        if m < t0:
            self.room(t0)
            a, b = start + m, start + t0
            M = self.M
            np.multiply(self.K[layer, a:b], self.KS[layer, a:b, :, None], out=M[layer, 0, m:t0])
            np.multiply(self.V[layer, a:b], self.VS[layer, a:b, :, None], out=M[layer, 1, m:t0])
            self.n[layer] = t0

    def keep(self, n: int, gen: int) -> None:
        """After the handle's own change that kept the first ``n`` tokens where they were
        (truncate): valid at the handle's new generation ``gen``."""
        self.n = [min(m, n) for m in self.n]
        self.gen = gen

    @staticmethod
    def moved(w: Any, gen: int) -> None:
        """Write handle part ``w``'s own change kept every cell and its pending tokens (growth,
        meta, set_tokens, set_encoder): now at generation ``gen``, its mirror too if it was valid."""
        m = w.mirror
        if m is not None and m.gen == w.gen:
            m.gen = gen
        w.gen = gen

    def clamp(self, length: int) -> None:
        """Pending tokens dropped: only the committed ``[0, length)`` are known (the cells after
        it are written again, by append or by extend)."""
        self.n = [min(m, length) for m in self.n]

    # -- writing -----------------------------------------------------------------------------

    def put(self, layer: int, t0: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[t0, t0 + n)`` of ``layer`` (checked, finite, ``[n, kv_heads, head_dim]``)
        into the mirror (room made, ``[0, t0)`` current); returns the views ``[0, t0 + n)``."""
        end = t0 + k.shape[0]
        self.room(end)
        M = self.M
        for which, x in ((0, k), (1, v)):
            dst = M[layer, which, t0:end]
            if x.dtype == np.float16 or x.dtype.kind != "f" or x.dtype.itemsize > 4:
                _quant.as_f32(x, dst)  # exact, without a warning for any finite value
            else:
                dst[...] = x
        self.n[layer] = end
        return self.kv[layer][:end], self.vv[layer][:end]

    def quantize(self, t0: int, n: int, s: int, w: Any) -> None:
        """Commit's pass: the pending tokens ``[t0, t0 + n)`` of every layer quantized into cells
        ``s..`` (codes and scales), then rewritten in the mirror with their dequantized values.
        Non-finite values raise InvalidArgumentError before anything of their pass is written;
        the pending tokens of write handle part ``w`` are dropped (the committed ones stay)."""
        if self.flat is not None:  # one compiled pass over every layer's rows
            kf, vf, ksf, vsf, kstride, sstride = self.flat
            bad = self.jit.commit_rows(self.M, t0, n, kf, vf, ksf, vsf, kstride, sstride, s)
            if bad >= 0:  # (the rows before it: written in cells past the length, and dropped here)
                X = self.M[:, :, t0 : t0 + n].copy()
                w.drop_pending()
                self.refuse(bad, X, t0)
            return
        L = self.M.shape[0]
        H, D = self.cell
        step = max(1, _PASS_ITEMS // (L * 2 * H * D))
        for a in range(0, n, step):
            c = min(step, n - a)
            sc = self.scratch
            if sc is None or sc[0].shape[2] != c:
                shape = (L, 2, c, H, D)
                sc = self.scratch = (np.empty(shape, np.float32), np.empty(shape, np.float32),
                                     np.empty(shape, np.float32), np.empty(shape, np.int8))
            X, A, B, C = sc
            P = self.M[:, :, t0 + a : t0 + a + c]
            bad, scales = _quant.quantize_rows(P, X, A, B)
            if bad >= 0:
                w.drop_pending()
                self.refuse(bad, X, t0 + a)
            np.copyto(C, A, casting="unsafe")  # the codes (whole numbers in [-127, 127])
            b = s + a
            e = b + c
            np.copyto(self.K[:, b:e], C[:, 0])
            np.copyto(self.V[:, b:e], C[:, 1])
            sc5 = scales.reshape(L, 2, c, H)
            np.copyto(self.KS[:, b:e], sc5[:, 0])
            np.copyto(self.VS[:, b:e], sc5[:, 1])
            np.multiply(A, B, out=X)  # codes * scale: exactly what dequantize_int8 gives
            np.copyto(P, X)

    @staticmethod
    def refuse(bad: int, X: np.ndarray, t0: int) -> None:
        """Raise for the non-finite row ``bad`` of the pass whose values are ``X`` (tokens t0..)."""
        layer, which, tok, head = (int(i) for i in np.unravel_index(bad, X.shape[:4]))
        row = X[layer, which, tok, head]
        value = row[~np.isfinite(row)][:1]
        raise InvalidArgumentError(
            f"commit: the pending {'kv'[which]} of layer {layer}, token {t0 + tok} (head {head}) holds "
            f"{value[0] if value.size else 'a non-finite value'}: int8 storage cannot represent NaN or "
            "infinity (nothing was committed; the pending tokens are dropped)"
        )


def _flat(K: np.ndarray, V: np.ndarray, KS: np.ndarray, VS: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                             np.ndarray, int, int] | None:
    """The store's codes and scales as flat arrays from layer 0's first cell (the compiled commit
    addresses layer ``l``, cell ``c``, head ``h`` itself: layers are a page-aligned stride
    apart, so ``K`` is not one contiguous array), with the layer strides in values; None if
    the layout is not the one this addressing assumes."""
    L, T, H, D = K.shape
    if (K.strides[1:] != (H * D, D, 1) or V.strides != K.strides or KS.strides[1:] != (4 * H, 4)
            or VS.strides != KS.strides or KS.strides[0] % 4):
        return None
    kstride, sstride = K.strides[0], KS.strides[0] // 4
    ast = np.lib.stride_tricks.as_strided
    nk, ns = (L - 1) * kstride + T * H * D, (L - 1) * sstride + T * H
    return (ast(K, (nk,), (1,)), ast(V, (nk,), (1,)), ast(KS, (ns,), (4,)), ast(VS, (ns,), (4,)), kstride, sstride)
