"""Encodings of the compact storage dtypes.

int8: each (token, head) row of ``head_dim`` values is stored as int8 with one
float32 scale, ``scale = absmax / 127`` and ``q = round(x / scale)`` (round half
to even, numpy's rule), so ``|q * scale - x| <= scale / 2 = absmax / 254``, up to
float32 rounding of the scale (a few ulps), plus a float32 step (2^-149) for rows
so small that the scale is subnormal. An
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

import numpy as np

from shmkv.errors import InvalidArgumentError

try:  # optional: zero-copy bfloat16 views
    import ml_dtypes as _ml

    BF16: np.dtype | None = np.dtype(_ml.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = None


_TINY = np.float32(2.0**-149)  # the smallest float32 subnormal


_F32_MAX = float(np.finfo(np.float32).max)


def check_finite(x: np.ndarray, what: str) -> None:
    """Refuse NaN, infinity and values beyond float32's range (their float32 scale would be
    infinite and read back as NaN)."""
    ok = np.abs(x) <= _F32_MAX  # False for NaN too
    if not ok.all():
        bad = np.argwhere(~ok)[0].tolist()
        raise InvalidArgumentError(
            f"{what} holds {x[tuple(bad)]!r} at index {bad}: int8 storage cannot represent NaN or infinity, "
            f"nor magnitudes above float32's maximum {_F32_MAX:.4g} (nothing was written)"
        )


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [..., head_dim] -> (int8 codes [..., head_dim], float32 scales [...])."""
    x = np.asarray(x, np.float32)
    absmax = np.abs(x).max(axis=-1)
    scale = (absmax / np.float32(127)).astype(np.float32)
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
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.rint(x / safe[..., None])
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8), scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    out: np.ndarray = q.astype(np.float32) * scale[..., None]
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
