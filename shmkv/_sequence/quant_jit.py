"""Compiled int8 loops (numba, the optional extra ``shmkv[fast]``): the same codes, scales and
dequantized values as the numpy path of :mod:`shmkv._sequence.quant`, bit for bit, in one pass
over each row instead of a dozen whole-array numpy calls.

Why: numpy's float16 -> float32 cast has no SIMD loop in the numpy builds measured here (about
1.4 ns a value even into a cache-sized buffer, a float16 memcpy 0.4 ns), and the numpy path
quantizes in about a dozen passes over its data (abs, argmax, divide, rint, clip, cast, ...).
A compiled loop converts, finds the absmax, divides, rounds and stores each row while it is in
registers. Imported only by :func:`shmkv._sequence.quant.kernels`, the first time an int8 store
quantizes or dequantizes (``import shmkv`` never imports numba).

Exactly the numpy path's arithmetic (tests/test_quant_jit.py compares both with a reference):

* float16 is converted with the same integer trick as ``quant._f16_bits_to_f32`` (exact for
  every finite value, subnormals included), and infinity or NaN come out as themselves;
  bfloat16's bits shifted into a float32's; float64 rounded to float32 (``np.float32(x)`` is
  numpy's cast) after its magnitude is checked against float32's largest in float64;
* ``scale = absmax / float32(127)`` in float32, at most ``quant._SCALE_MAX`` (for a row whose
  absmax is float32's largest: ``127 * scale`` stays finite); rows whose absmax is at most
  ``_NORMAL`` take ``_scales``' subnormal rules (at least the smallest float32 step, stepped up until
  ``absmax <= 127.5 * scale`` holds in float64) and are clipped to [-127, 127];
* ``q = rint(x / scale)`` (IEEE float32 division, round half to even), the code ``int8(q)``,
  the dequantized value ``q * scale`` (or ``q * 1`` for an all-zero row, as numpy's path).

No ``fastmath`` (it would allow reassociation and reciprocal division) and
``error_model="numpy"`` (no zero-division checks: the division is never by zero).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import llvmlite.binding as _llvm
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from shmkv._sequence.quant_limits import F32_MAX, NORMAL, SCALE_MAX

_F32_MAX, _NORMAL = F32_MAX, NORMAL  # (numba reads module globals as constants)
_normal32 = np.float32(_NORMAL)
if float(_normal32) <= _NORMAL:
    _normal32 = np.nextafter(_normal32, np.float32(np.inf))
_NORMAL_BITS = int(np.array(_normal32).view(np.int32))  # absmax > _NORMAL <=> its bits >= these
_INF_BITS = 0x7F800000  # absmax bits at least these: infinity or NaN
_TINY_BITS = 1  # the smallest float32 subnormal's bits
_C127 = np.float32(127)
_SCALE_MAX = SCALE_MAX  # (shmkv/_sequence/quant_limits.py: the numpy path's too)
_ONE = np.float32(1)
_ZERO = np.float32(0)

_jit = njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
_inline = njit(inline="always", cache=True, nogil=True, error_model="numpy", boundscheck=False)


def _bitcast_f32(typingctx: Any, bits: Any) -> Any:  # pragma: no cover
    """The float32 whose bits are the low 32 bits of the integer ``bits`` (a bit cast, no
    conversion; numba widens int32 arithmetic to int64, whose low 32 bits are the same)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


_f32: Any = intrinsic(_bitcast_f32)


def _half_to_f32(typingctx: Any, bits: Any) -> Any:  # pragma: no cover
    """The float32 value of the float16 whose bits are the int16 ``bits``: LLVM's ``fpext half``,
    one vcvtph2ps for 8 values on a CPU with F16C."""
    if bits != types.int16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


_h2f: Any = intrinsic(_half_to_f32)


def _target_has_f16c() -> bool:
    """Whether the code numba emits may use F16C: the host has it and numba compiles for the
    host, or the features numba was told to target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, as
    portable caches in container images set them) name it. With ``NUMBA_CPU_NAME=generic``
    LLVM lowers the conversion to a runtime helper numba does not link: a segfault."""
    import numba

    config: Any = numba.config  # (attributes set from the environment at import: untyped)
    name, features = config.CPU_NAME, config.CPU_FEATURES
    if name in (None, "host") and not features:
        return "f16c" in _llvm.get_host_cpu_features().flatten()
    return "+f16c" in (features or "").split(",")


# F16C (x86-64 since 2012): the CPU converts float16, 0.1 ns a value; without it the integer
# conversion below is used instead
_F16C = _target_has_f16c()


@_inline
def _f16(t: Any) -> Any:  # pragma: no cover
    """The float32 value of the float16 bits ``t`` (int16): numpy's cast, bit for bit, for every
    non-NaN value (-0.0 and subnormals too); a NaN stays a NaN (F16C sets a signalling NaN's
    quiet bit: every NaN is refused before it is stored)."""
    if _F16C:
        return _h2f(t)
    return _f16_soft(t)


@_inline
def _f16_soft(t: Any) -> Any:  # pragma: no cover
    """_f16 without F16C, with integers and no branch (the loops calling it vectorize): normal
    numbers get their exponent re-biased (+112, +224 for infinity and NaN); zero and subnormals
    (exponent 0) are ``mantissa * 2^-24``, a normal float32. No float32 subnormal is ever an
    operand: the CPU takes ~100 cycles for one (quant's _f16_bits_to_f32 multiplies them)."""
    i32 = np.int32  # (every step cast back: numba widens int32 arithmetic to int64, 2x slower)
    w = i32(t)  # sign-extended
    u = i32(w & i32(0x7FFF))
    e31 = i32(i32(i32(u & i32(0x7C00)) + i32(0x400)) >> i32(15))  # 1 for infinity and NaN
    bits = i32(i32(i32(u << i32(13)) + i32(0x38000000)) + i32(e31 * i32(0x38000000)))
    f = _f32(i32(bits | i32(i32(w & i32(0x8000)) << i32(16))))
    g = np.float32(w & np.int32(0x3FF)) * np.float32(2.0**-24)
    g = -g if w < 0 else g
    return g if (w & np.int32(0x7C00)) == 0 else f


@_jit
def f16_to_f32(src: np.ndarray, out: np.ndarray, soft: bool) -> None:  # pragma: no cover
    """float16 bits ``src`` (int16, 1-D) into float32 ``out``: _f16, or with ``soft`` the
    conversion used on CPUs without F16C (here so that tests check both on any machine)."""
    for j in range(src.size):
        out[j] = _f16_soft(src[j]) if soft else _f16(src[j])


# Kernels take positional arguments only (numba), hence the PLR0917 exceptions.
# Every inner loop indexes a row slice by its loop variable only: an index ``a + j`` with a
# runtime ``a`` keeps numba's negative-index wraparound in the loop, which then does not
# vectorize (4.5x slower, measured on the commit's loop).


@_inline
def _f16_row(src: np.ndarray, buf: np.ndarray) -> None:  # pragma: no cover
    """float16 bits ``src`` (int16 row) into float32 ``buf``: numpy's cast, bit for bit."""
    for j in range(src.size):
        buf[j] = _f16(src[j])


@_inline
def _absbits(bits: np.ndarray) -> Any:  # pragma: no cover
    """The bits (int32) of the largest magnitude of the float32 row whose bits are ``bits``: at
    least _INF_BITS if the row holds infinity or NaN. One integer max (the bits of non-negative
    floats sort as their values do, NaN's above infinity's), which vectorizes where a float max
    does not; the caller compares bits, not floats (no float64 round trip: 1.5x faster)."""
    m = np.int32(0)
    for j in range(bits.size):  # (int32 casts: numba's int64 arithmetic here runs 2.3x slower)
        m = np.int32(max(m, np.int32(bits[j] & np.int32(0x7FFFFFFF))))
    return m


@_inline
def _f16_absmax(src: np.ndarray) -> Any:  # pragma: no cover
    """_absmax of a float16 row from its bits (int16): their magnitudes sort as the values do,
    and a max over them vectorizes better than one over the converted row (measured: 0.1 ns a
    value, against 0.5)."""
    m = np.int32(0)
    for j in range(src.size):
        m = np.int32(max(m, np.int32(np.int32(src[j]) & np.int32(0x7FFF))))
    if m >= np.int32(0x7C00):  # infinity or NaN
        return np.inf
    if m < np.int32(0x400):  # zero or subnormal
        return np.float32(m) * np.float32(2.0**-24)
    return _f32((m << 13) + np.int32(0x38000000))


@_jit
def _row_scale(am: float, tmp: np.ndarray, tmpi: np.ndarray) -> np.float32:  # pragma: no cover
    """``quant._scales`` for one row's float32 absmax ``am``, at most _NORMAL."""
    amf = np.float32(am)
    if not amf > _ZERO:
        return _ZERO
    s = amf / _C127
    tmpi[0] = 1  # the smallest float32 subnormal
    s = max(s, tmp[0])
    for _ in range(4):  # stepped up until absmax <= 127.5 * scale (in float64)
        if np.float64(amf) > 127.5 * np.float64(s):
            tmp[0] = s
            tmpi[0] += 1  # nextafter towards infinity, for a positive float32
            s = tmp[0]
        else:
            break
    return s


@_inline
def _low_code(x: Any, safe: Any) -> Any:  # pragma: no cover
    """A value's code (as a float32) for a subnormal or zero scale: clipped, as numpy's path."""
    q = np.rint(x / safe)
    return min(max(q, np.float32(-127)), np.float32(127))


@_jit
def _code_low(row: np.ndarray, am: float, codes: np.ndarray, tmp: np.ndarray,
              tmpi: np.ndarray) -> np.float32:  # pragma: no cover
    """A row whose scale is subnormal or zero into ``codes``, divided by 1 for a zero row.
    Rare: a call of its own, out of the common loop. ``row`` is only read (it may be the
    caller's read-only array)."""
    s = _row_scale(am, tmp, tmpi)
    safe = s if s > _ZERO else _ONE
    for j in range(row.size):
        codes[j] = np.int8(_low_code(row[j], safe))
    return s


@_jit
def _code_low_back(row: np.ndarray, am: float, codes: np.ndarray, tmp: np.ndarray,
                   tmpi: np.ndarray) -> np.float32:  # pragma: no cover
    """``_code_low``, with the row's dequantized values written back into ``row`` (a mirror's;
    a -0.0 code keeps its sign, as numpy's path)."""
    s = _row_scale(am, tmp, tmpi)
    safe = s if s > _ZERO else _ONE
    for j in range(row.size):
        q = _low_code(row[j], safe)
        codes[j] = np.int8(q)
        row[j] = q * safe
    return s


@_inline
def _code(row: np.ndarray, mb: Any, codes: np.ndarray, tmp: np.ndarray, tmpi: np.ndarray) -> Any:  # pragma: no cover
    """Finite ``row`` (float32, absmax bits ``mb``) into ``codes``; returns its scale."""
    if mb >= _NORMAL_BITS:
        s = min(_f32(mb) / _C127, _SCALE_MAX)
        for j in range(row.size):
            codes[j] = np.int8(np.int32(np.rint(row[j] / s)))
        return s
    return _code_low(row, _f32(mb), codes, tmp, tmpi)


@_jit
def quantize_f16(src: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> int:  # pragma: no cover
    """Rows of float16 bits ``src`` (int16, C-contiguous [R, D]) into ``codes`` (int8 [R, D]) and
    ``scales`` (float32 [R]); returns -1, or the first row holding infinity or NaN (the rows
    before it written). Each value converted in the loop that divides it (no buffer)."""
    R, D = src.shape
    buf = np.empty(D, np.float32)
    tmp = np.empty(1, np.float32)
    tmpi = tmp.view(np.int32)
    for r in range(R):
        row = src[r]
        am = _f16_absmax(row)
        if not am <= _F32_MAX:
            return r
        cd = codes[r]
        if am > _NORMAL:
            sc = np.float32(am) / _C127
            for j in range(D):
                cd[j] = np.int8(np.int32(np.rint(_f16(row[j]) / sc)))
        else:
            _f16_row(row, buf)
            sc = _code_low(buf, am, cd, tmp, tmpi)
        scales[r] = sc
    return -1


@_jit
def quantize_bf16(src: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> int:  # pragma: no cover
    """As quantize_f16, for bfloat16 bits (uint16): a float32's upper half."""
    R, D = src.shape
    buf = np.empty(D, np.float32)
    bufi = buf.view(np.int32)
    tmp = np.empty(1, np.float32)
    tmpi = tmp.view(np.int32)
    for r in range(R):
        row = src[r]
        for j in range(D):
            bufi[j] = np.int32(row[j]) << 16
        mb = _absbits(bufi)
        if mb >= _INF_BITS:
            return r
        scales[r] = _code(buf, mb, codes[r], tmp, tmpi)
    return -1


@_jit
def quantize_f32(src: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> int:  # pragma: no cover
    """As quantize_f16, for float32 rows."""
    R = src.shape[0]
    bits = src.view(np.int32)
    tmp = np.empty(1, np.float32)
    tmpi = tmp.view(np.int32)
    for r in range(R):
        mb = _absbits(bits[r])
        if mb >= _INF_BITS:
            return r
        scales[r] = _code(src[r], mb, codes[r], tmp, tmpi)
    return -1


_F32_MAX_BITS64 = int(np.float64(_F32_MAX).view(np.int64))


@_jit
def quantize_f64(src: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> int:  # pragma: no cover
    """As quantize_f16, for float64 rows: each row's magnitudes checked against float32's
    largest in float64 (on the bits: an integer max, which vectorizes; NaN's bits sort above
    infinity's), then rounded to float32 as numpy casts."""
    R, D = src.shape
    bits = src.view(np.int64)
    buf = np.empty(D, np.float32)
    bufi = buf.view(np.int32)
    tmp = np.empty(1, np.float32)
    tmpi = tmp.view(np.int32)
    for r in range(R):
        b64 = bits[r]
        w = np.int64(0)
        for j in range(D):
            b = b64[j] & np.int64(0x7FFFFFFFFFFFFFFF)
            w = max(w, b)
        if w > _F32_MAX_BITS64:  # beyond float32's range, infinity or NaN
            return r
        row = src[r]
        for j in range(D):
            buf[j] = np.float32(row[j])
        scales[r] = _code(buf, _absbits(bufi), codes[r], tmp, tmpi)
    return -1


@_jit
def put_f16(kb: np.ndarray, vb: np.ndarray, M: np.ndarray, layer: int, t0: int) -> None:  # pragma: no cover
    """An append's float16 ``k``, ``v`` (int16 bits, C-contiguous, ``n`` tokens) into the mirror
    ``M`` [layers, 2, cap, H, D] at tokens ``t0..`` of ``layer``: numpy's cast, bit for bit."""
    HD = M.shape[3] * M.shape[4]
    n = kb.size // HD
    Mk = M[layer, 0, t0 : t0 + n].reshape(n * HD)
    Mv = M[layer, 1, t0 : t0 + n].reshape(n * HD)
    _f16_row(kb.reshape(kb.size), Mk)
    _f16_row(vb.reshape(vb.size), Mv)


@_jit
def commit_rows(M: np.ndarray, t0: int, n: int, K: np.ndarray, V: np.ndarray,  # noqa: PLR0917 (numba: positional)
                KS: np.ndarray, VS: np.ndarray, kstride: int, sstride: int, s: int) -> int:  # pragma: no cover
    """A commit's pass (``Int8Mirror.quantize``): the mirror's pending tokens ``[t0, t0 + n)`` of
    every layer quantized into cells ``s..``: codes into the flat int8 ``K``/``V`` (layer ``l``,
    cell ``c``, head ``h`` at ``l * kstride + (c * H + h) * D``), scales into the flat float32
    ``KS``/``VS`` (``l * sstride + c * H + h``), and the mirror rewritten with the dequantized
    values. Returns -1, or the first row (in ``[L, 2, n, H]`` order) holding NaN or infinity,
    left as it was (the rows before it are written: cells past the committed length, and
    mirror values of pending tokens that the caller then drops)."""
    L, _, cap, H, D = M.shape
    M1 = M.reshape(M.size)
    Mi = M1.view(np.int32)
    tmp = np.empty(1, np.float32)
    tmpi = tmp.view(np.int32)
    r = 0
    for lw in range(L * 2):
        lay = lw // 2
        codes = K if lw % 2 == 0 else V
        scales = KS if lw % 2 == 0 else VS
        for t in range(n):
            for h in range(H):
                a = ((lw * cap + t0 + t) * H + h) * D
                mb = _absbits(Mi[a : a + D])
                if mb >= _INF_BITS:
                    return r
                c = lay * kstride + ((s + t) * H + h) * D
                row = M1[a : a + D]
                cd = codes[c : c + D]
                if mb >= _NORMAL_BITS:
                    sc = min(_f32(mb) / _C127, _SCALE_MAX)
                    for j in range(D):
                        q = np.rint(row[j] / sc)
                        cd[j] = np.int8(np.int32(q))
                        row[j] = q * sc  # what dequantize_int8 gives for it
                else:
                    sc = _code_low_back(row, _f32(mb), cd, tmp, tmpi)
                scales[lay * sstride + (s + t) * H + h] = sc
                r += 1
    return -1
