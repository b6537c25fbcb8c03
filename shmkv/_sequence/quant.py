"""Encodings of the compact storage dtypes.

int8 quantizes in compiled loops when numba is installed (``shmkv[fast]``: module
``quant_jit``, loaded by :func:`kernels` on first use), else in the numpy calls below: the
same codes, scales and dequantized values either way, bit for bit.

int8: each (token, head) row of ``head_dim`` values is stored as int8 with one
float32 scale, ``scale = absmax / 127`` and ``q = round(x / scale)`` (round half
to even, numpy's rule), so ``|q * scale - x| <= scale / 2 = absmax / 254``, up to
float32 rounding of the scale (a few ulps), plus a float32 step (2^-149) for rows
so small that the scale is subnormal. A row whose absmax is float32's largest value takes
the largest scale ``_SCALE_MAX`` with a finite ``127 * scale`` (one ulp below absmax / 127,
which rounds up: its code 127 would dequantize to infinity); the bound above still holds. An
all-zero row has scale 0. NaN, infinity and values beyond float32's range
cannot be represented and are refused before anything is written.

bfloat16: the upper 16 bits of the float32, rounded to nearest even; stored as
uint16. Relative error at most 2^-8 for normal numbers; below the normal range
(|x| < 2^-126) at most half of bfloat16's subnormal step, 2^-134; beyond the
largest bfloat16 (~3.39e38) values round to infinity. Reads give float32
copies, or zero-copy ``ml_dtypes.bfloat16`` views when ml_dtypes is installed
(``pip install shmkv[bf16]``).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from shmkv._engine.locking.interrupts import critical, shielding
from shmkv._sequence.quant_limits import F32_MAX, NORMAL, SCALE_MAX
from shmkv.errors import InvalidArgumentError

try:  # optional: zero-copy bfloat16 views
    import ml_dtypes as _ml

    BF16: np.dtype | None = np.dtype(_ml.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = None


_TINY = np.float32(2.0**-149)  # the smallest float32 subnormal
_NORMAL, _F32_MAX, _SCALE_MAX = NORMAL, F32_MAX, SCALE_MAX  # (shmkv/_sequence/quant_limits.py)
_CHUNK_ITEMS = 1 << 15
# values quantized per pass: the scratch (128 KiB a buffer) stays in cache
_FEW_ROWS = 64  # rows of head_dim values: below it a decode step's path (see _encode)


_JIT: Any = None  # the compiled loops (quant_jit) once loaded; False: numba missing or SHMKV_NUMBA=0


def kernels() -> Any:
    """The compiled int8 loops (module ``quant_jit``, numba: ``pip install 'shmkv[fast]'``), or
    None without numba or with ``SHMKV_NUMBA=0`` in the environment. Loaded on the first
    quantization in the process, never by ``import shmkv``; the same results as the numpy path
    below, bit for bit (tests/test_quant_jit.py). A Ctrl-C while the import runs is raised as
    usual (the next call imports again); one while a loop compiles waits for the compile."""
    global _JIT
    if _JIT is None:
        if os.environ.get("SHMKV_NUMBA", "1") == "0":
            _JIT = False
        else:
            try:
                from shmkv._sequence import quant_jit
            except Exception:  # not installed (ImportError), or a numba that cannot load or cache here:
                _JIT = False  # the numpy path, same results
            else:
                for name, loop in vars(quant_jit).items():  # the loops called from Python (no underscore)
                    if not name.startswith("_") and hasattr(loop, "_compile_for_args"):
                        _compiles_deferring_ctrl_c(loop)
                _JIT = quant_jit
    return _JIT or None


def _compiles_deferring_ctrl_c(loop: Any) -> None:
    """Make a compiled loop's compilations (its first call with new argument types: seconds
    without numba's cache) defer a Ctrl-C to their end. LLVM calls back into Python while it
    compiles (llvmlite's object-cache hooks, ctypes callbacks); a KeyboardInterrupt raised in one
    is printed as "Exception ignored" with a traceback and lost. numba's dispatcher calls its
    ``_compile_for_args`` only when no compiled version matches the arguments, so every later
    call costs what it did."""
    compile_for_args = loop._compile_for_args

    @shielding()  # (our deferring handler in place for the compile, the Ctrl-C raised as it ends)
    @critical
    def compiling(*args: Any, **kws: Any) -> Any:
        return compile_for_args(*args, **kws)

    loop._compile_for_args = compiling


def _jit_rows(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> int | None:
    """``quantize_into`` by a compiled loop: -1, or the first row holding a non-finite value
    (rows before it written); None when no loop applies (numba missing, another dtype, arrays
    not C-contiguous)."""
    J = kernels()
    if J is None or not (x.flags.c_contiguous and codes.flags.c_contiguous and scales.flags.c_contiguous):
        return None
    dt = x.dtype
    if dt == np.float16:
        f, src = J.quantize_f16, x.view(np.int16)
    elif dt == np.float32:
        f, src = J.quantize_f32, x
    elif dt == np.float64:
        f, src = J.quantize_f64, x
    elif BF16 is not None and dt == BF16:
        f, src = J.quantize_bf16, x.view(np.uint16)
    else:
        return None
    D = x.shape[-1]
    return int(f(src.reshape(-1, D), codes.reshape(-1, D), scales.reshape(-1)))


def check_finite(x: np.ndarray, what: str) -> None:
    """Refuse NaN, infinity and values beyond float32's range (their float32 scale would be
    infinite and read back as NaN). No warning for any finite input of any real dtype: the
    comparison is made in a dtype that holds both the value and float32's maximum."""
    x = np.asarray(x)
    if x.dtype.kind in "biu":
        return  # every integer up to int64/uint64 is below float32's maximum
    if x.dtype.kind == "f" and x.dtype.itemsize <= 4:
        ok = np.isfinite(x)  # float16 / float32: every finite value fits in float32
    else:  # float64, longdouble, bfloat16 (ml_dtypes): compared in float64 or wider
        wide = x if x.dtype.kind == "f" and x.dtype.itemsize > 8 else x.astype(np.float64)
        ok = np.abs(wide) <= _F32_MAX  # False for NaN too
    if not ok.all():
        bad = np.argwhere(~ok)[0].tolist()
        raise InvalidArgumentError(
            f"{what} holds {x[tuple(bad)]!r} at index {bad}: int8 storage cannot represent NaN or infinity, "
            f"nor magnitudes above float32's maximum {_F32_MAX:.4g} (nothing was committed)"
        )


def _scales(absmax: np.ndarray) -> np.ndarray:
    """float32 scales of rows with float32 ``absmax`` (absmax / 127, see the module docstring)."""
    scale = (absmax / np.float32(127)).astype(np.float32)
    np.minimum(scale, _SCALE_MAX, out=scale)  # absmax = float32's largest: 127 * scale finite
    if absmax.size and absmax.min() > _NORMAL:
        return scale  # the common case: a normal scale, absmax <= 127.5 * scale holds already
    # absmax / 127 can underflow to 0 for subnormal rows (found by hypothesis: 3.8e-44);
    # the smallest float32 step then represents them exactly (they are multiples of it)
    scale = np.where(absmax > 0, np.maximum(scale, _TINY), np.float32(0)).astype(np.float32)
    # a scale rounded far down would push |x / scale| past 127.5 and into the clip (subnormal
    # scales round coarsely: found by hypothesis, 1.675e-42); step it up until it fits
    for _ in range(4):
        low = absmax.astype(np.float64) > 127.5 * scale.astype(np.float64)
        if not low.any():
            break
        scale = np.where(low, np.nextafter(scale, np.float32(np.inf)), scale).astype(np.float32)
    return scale


_F16_MAX = 65504.0
_SIGN_AND_BITS = np.int32(-0x70000001)  # 0x8FFFFFFF: the sign bit and the 28 low bits


def _f16_bits_to_f32(out: np.ndarray) -> None:
    """float32 ``out`` holding sign-extended float16 bits as int32: the values (see _as_f32)."""
    iv = out.view(np.int32)
    np.left_shift(iv, 13, out=iv)
    np.bitwise_and(iv, _SIGN_AND_BITS, out=iv)
    np.multiply(out, np.float32(2.0**112), out=out)


def _as_f32(x: np.ndarray, out: np.ndarray, what: str, whole: np.ndarray) -> float:
    """``x`` into the float32 scratch ``out`` (C-contiguous); returns the largest magnitude a
    finite value can have after it (a larger absmax means a non-finite input value).

    float16 is converted with integer operations, exactly: its bits moved into a float32's
    (sign in place, exponent and mantissa shifted by 13) make the value times 2^-112, for
    normal and subnormal numbers alike, and one multiply by 2^112 puts it right. numpy's own
    float16 cast runs at ~3 ns a value here (no SIMD), this at a fraction of it. Infinity and
    NaN come out above 65504 (float16's largest finite value), which the caller refuses.
    Values beyond float32's range are refused before a wider float is cast (the cast would
    overflow, with a warning)."""
    if x.dtype == np.float16:
        np.copyto(out.view(np.int32), x.view(np.int16))  # sign-extended
        _f16_bits_to_f32(out)
        return _F16_MAX
    if x.dtype.kind == "f" and x.dtype.itemsize > 4:
        m = np.abs(x).max() if x.size else 0.0
        if not m <= _F32_MAX:  # NaN too
            check_finite(whole, what)
    np.copyto(out, x, casting="unsafe")  # a cast, never float16 arithmetic
    return _F32_MAX


def as_f32(x: np.ndarray, out: np.ndarray) -> None:
    """Finite ``x`` (any real dtype, checked by the caller) into the C-contiguous float32
    ``out``: exact for float16 (see _as_f32), a cast otherwise, never a warning."""
    _as_f32(x, out, "x", x)


def quantize_rows(P: np.ndarray, X: np.ndarray, A: np.ndarray, B: np.ndarray) -> tuple[int, np.ndarray]:
    """Rows of ``head_dim`` float32 values ``P`` (any strides) quantized in one pass of whole-array
    numpy calls: ``P`` copied into ``X``, the float codes (whole numbers in [-127, 127]) into
    ``A``, each row's divisor repeated along the row into ``B`` (all three C-contiguous float32
    scratch of ``P``'s shape), so ``A * B`` is the dequantization. Returns ``(-1, scales [rows])``,
    the same codes and scales as :func:`quantize_into`; or ``(row, empty)`` for the first row
    holding NaN or infinity, before anything but the scratch is written.

    Contiguous scratch because numpy's binary operations on a strided operand (the mirror's
    cells of every layer) cost three times a copy of it; the divisor is repeated into ``B``
    rather than broadcast, since a broadcast operand makes numpy loop over rows of
    ``head_dim`` values."""
    D = P.shape[-1]
    np.copyto(X, P)
    np.abs(X, out=A)
    A2 = A.reshape(-1, D)
    R = A2.shape[0]
    am = A2.ravel().take(A2.argmax(axis=1) + _row_offsets(R, D))  # NaN: argmax finds it
    i = int(am.argmax())
    top = float(am[i])
    if not top <= _F32_MAX:  # NaN or infinity
        return i, am[:0]
    B2 = B.reshape(R, D)
    if am[am.argmin()] > _NORMAL:  # normal scales: no clip needed (see _encode)
        scale: np.ndarray = am / np.float32(127)
        if top == _F32_MAX:
            np.minimum(scale, _SCALE_MAX, out=scale)  # (see _SCALE_MAX)
        np.copyto(B2, scale[:, None])
        np.divide(X, B, out=A)
        np.rint(A, out=A)
        return -1, scale
    scale = _scales(am)
    np.copyto(B2, np.where(scale > 0, scale, np.float32(1))[:, None])
    np.divide(X, B, out=A)
    np.rint(A, out=A)
    np.clip(A, -127, 127, out=A)
    return -1, scale


@functools.lru_cache(maxsize=64)
def _row_offsets(rows: int, width: int) -> np.ndarray:
    return np.arange(rows, dtype=np.intp) * width


def _encode(f: np.ndarray, error: Callable[[], None], limit: float, scratch: np.ndarray) -> np.ndarray:
    """Rows of ``f`` (float32 [R, head_dim], C-contiguous) divided by their scales and rounded,
    in place (the float codes); returns the float32 scales [R]. ``error()`` raises for a
    non-finite row (an absmax above ``limit`` is one, see _as_f32). ``scratch``: float32, at
    least ``f.size`` values (a fresh array per chunk would be fresh pages each time).

    The absmax is found with argmax + take: numpy's max along the last axis costs ~5 us on a
    decode step's 16 rows of 128 and ~57 us on a prefill chunk's 256, argmax an eighth of it
    (SIMD)."""
    t = np.abs(f, out=scratch[: f.size].reshape(f.shape))
    am = t.ravel().take(t.argmax(axis=1) + _row_offsets(*f.shape))  # NaN: argmax finds it
    if f.shape[0] > _FEW_ROWS:  # a prefill: numpy's argmax/argmin of the rows' absmax
        high = float(am[am.argmax()])
        finite = high <= limit  # (False for NaN)
        low = float(am[am.argmin()])
    else:  # a decode step: Python's sum and min of a few floats
        rows = am.tolist()
        high = max(rows)
        finite = math.isfinite(sum(rows)) and high <= limit  # (no overflow in a double)
        low = min(rows)
    if not finite:  # NaN or infinity
        error()
    if low > _NORMAL:
        # normal scales (the common case): |x| / scale <= 127 * (1 + 2^-23) rounds to <= 127,
        # no clip needed (with the capped scale of a row at float32's largest, 127 + one ulp);
        # the same codes as the general path below
        scale: np.ndarray = am / np.float32(127)
        if high == _F32_MAX:
            np.minimum(scale, _SCALE_MAX, out=scale)  # (see _SCALE_MAX)
        np.divide(f, scale[:, None], out=f)
        np.rint(f, out=f)
        return scale
    scale = _scales(am)
    safe = np.where(scale > 0, scale, np.float32(1))
    np.divide(f, safe[:, None], out=f)
    np.rint(f, out=f)
    np.clip(f, -127, 127, out=f)
    return scale


def quantize_into(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, *, what: str = "x") -> None:
    """Quantize ``x`` [n, kv_heads, head_dim] (any real dtype) into ``codes`` (int8, same shape)
    and ``scales`` (float32 [n, kv_heads]), all arithmetic in float32, a cache-sized chunk of
    tokens at a time.

    Non-finite values (or beyond float32's range) raise InvalidArgumentError naming the first
    one; chunks before it may have been written (callers write cells nobody sees yet)."""
    n = x.shape[0]
    if not n:
        return
    bad = _jit_rows(x, codes, scales)
    if bad is not None:
        if bad >= 0:
            check_finite(x, what)  # raises, naming the value
            raise InvalidArgumentError(f"{what}: row {bad} holds a non-finite value (nothing was committed)")
        return
    D = x.shape[-1]
    step = max(1, _CHUNK_ITEMS // max(x[0].size, 1))
    buf = np.empty((min(step, n), *x.shape[1:]), np.float32)
    scratch = np.empty(buf.size, np.float32)

    def error() -> None:
        check_finite(x, what)

    for a in range(0, n, step):
        b = min(a + step, n)
        f = buf[: b - a]
        limit = _as_f32(x[a:b], f, what, x)
        scale = _encode(f.reshape(-1, D), error, limit, scratch)
        np.copyto(codes[a:b], f, casting="unsafe")
        scales[a:b] = scale.reshape(scales[a:b].shape)


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [..., head_dim] -> (int8 codes [..., head_dim], float32 scales [...])."""
    x = np.asarray(x)
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1]) if x.ndim else x.reshape(1, 1, 1)
    q = np.empty(flat.shape, np.int8)
    s = np.empty(flat.shape[:2], np.float32)
    quantize_into(flat, q, s)
    return q.reshape(shape), s.reshape(shape[:-1])


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    out: np.ndarray = q.astype(np.float32)
    out *= scale[..., None]
    return out


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bits (uint16), round to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(x, np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def from_bf16(u: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 copy."""
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_view(u: np.ndarray) -> np.ndarray:
    """Zero-copy ml_dtypes.bfloat16 view of stored bits, or a float32 copy without ml_dtypes."""
    if BF16 is not None:
        return u.view(BF16)
    return from_bf16(u)
