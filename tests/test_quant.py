"""int8 and bfloat16 storage."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shmkv
from shmkv._sequence import quant as _quant

SEED = 5150


def _cases(rng: np.random.Generator, n: int, H: int, D: int) -> np.ndarray:
    x = rng.standard_normal((n, H, D)).astype(np.float32)
    x[0] = 0.0  # all-zero tokens
    x[1] = 3.25  # constant tokens
    x[2] *= 1e30  # very large
    x[3] *= 1e-30  # very small
    x[4, 0] = 0.0  # one zero head beside a normal one
    x[5] = -7.0
    x[6:] *= np.exp(rng.uniform(-20, 20, (n - 6, H, 1))).astype(np.float32)
    return x


@pytest.mark.parametrize("seed", range(8))
def test_int8_error_bound(make_store, seed):
    print(f"seed={SEED + seed}")
    rng = np.random.default_rng(SEED + seed)
    L, H, D, n = 2, 3, 16, 40
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=128)
    seq = store.create_sequence(capacity=n)
    k = np.stack([_cases(rng, n, H, D) for _ in range(L)])
    v = np.stack([_cases(rng, n, H, D) for _ in range(L)])
    seq.extend(k, v)
    for layer in range(L):
        for got, want in ((seq.keys(layer), k[layer]), (seq.values(layer), v[layer])):
            assert got.dtype == np.float32 and got.shape == want.shape
            bound = np.abs(want).max(axis=-1, keepdims=True) / 254
            err = np.abs(got.astype(np.float64) - want)
            assert np.all(err <= bound * (1 + 2.0**-15) + 2.0**-148), float((err - bound).max())
        codes, scales = seq.raw_keys(layer)
        assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (n, H)
        assert not codes.flags.writeable and not scales.flags.writeable
        # zero-copy: the raw views are the shared memory itself
        assert np.shares_memory(codes, store._engine.K)
        absmax = np.abs(k[layer].astype(np.float32)).max(-1).astype(np.float64)
        np.testing.assert_allclose(scales, absmax / 127, rtol=2.0**-22)  # absmax / 127, to an ulp
        assert np.all(scales.astype(np.float64) * 127.5 >= absmax)  # never so low that codes clip


@pytest.mark.parametrize("seed", range(8))
def test_bfloat16_error_bound(make_store, seed, monkeypatch):
    rng = np.random.default_rng(SEED + 100 + seed)
    if seed % 2:  # without ml_dtypes: float32 copies
        monkeypatch.setattr(_quant, "BF16", None)
    L, H, D, n = 2, 2, 8, 30
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="bfloat16", max_tokens=64)
    seq = store.create_sequence(capacity=n)
    k = np.stack([_cases(rng, n, H, D) for _ in range(L)])
    k[:, 2] /= 1e25  # keep within bfloat16's range (same exponent range as float32)
    seq.extend(k, k)
    for layer in range(L):
        got = np.asarray(seq.keys(layer), np.float64)
        want = k[layer].astype(np.float64)
        assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-8)
        if _quant.BF16 is not None:
            assert np.shares_memory(seq.keys(layer), store._engine.K)  # zero-copy view
        else:
            assert seq.keys(layer).dtype == np.float32
    # round to nearest even, against an independent reference on a few values
    x = np.array([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -2.5, np.inf, -np.inf], np.float32)
    want = np.array([1.0, 1.0, 1.0 + 2.0**-6, -2.5, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(_quant.from_bf16(_quant.to_bf16(x)), want)
    assert np.isnan(_quant.from_bf16(_quant.to_bf16(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_refuses_non_finite_before_writing(make_store, bad):
    store = make_store(dtype="int8")
    seq = store.create_sequence(capacity=4)
    seq.extend(np.ones((2, 1, 2, 4)), np.ones((2, 1, 2, 4)))
    k = np.ones((2, 2, 2, 4))
    k[1, 1, 0, 3] = bad
    with pytest.raises(shmkv.InvalidArgumentError, match="NaN or infinity") as info:
        seq.extend(k, np.ones_like(k))
    assert isinstance(info.value, ValueError)
    with pytest.raises(shmkv.InvalidArgumentError):
        seq.append(0, np.ones((2, 4)), np.full((2, 4), bad))
    assert seq.length == 1 and seq.pending == 0
    np.testing.assert_array_equal(seq.keys(1), np.ones((1, 2, 4)))


def test_memory_is_reported(make_store):
    lay = dict(layers=4, kv_heads=8, head_dim=128, max_tokens=64)
    f16 = make_store(dtype="float16", **lay)
    i8 = make_store(dtype="int8", **lay)
    # per token: K and V x 4 layers x 8 heads x 128 x itemsize, int8 adds 2 x 4 x 8 float32 scales
    assert f16.bytes_per_token == 2 * 4 * 8 * 128 * 2 + 16
    assert i8.bytes_per_token == 2 * 4 * 8 * 128 + 2 * 4 * 8 * 4 + 16
    for s in (f16, i8):
        seq = s.create_sequence(capacity=10)
        seq.extend(np.ones((4, 10, 8, 128)), np.ones((4, 10, 8, 128)))
        assert s.stats().bytes_used == 10 * s.bytes_per_token == seq.nbytes
    assert i8.stats().bytes_used / f16.stats().bytes_used < 0.52


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

_BIG = float(np.finfo(np.float32).max)  # every finite float32 (the int8 scale is capped there)
_floats = st.floats(min_value=-_BIG, max_value=_BIG, allow_nan=False, allow_infinity=False, width=32)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("SHMKV_HYPOTHESIS_EXAMPLES", "300")), deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=3, max_dims=3, max_side=6), elements=_floats))
def test_int8_codec_bound_property(x):
    """The codec itself, on arbitrary finite float32 rows (zeros, constants, extremes)."""
    q, scale = _quant.quantize_int8(x)
    got = _quant.dequantize_int8(q, scale).astype(np.float64)
    bound = np.abs(x.astype(np.float64)).max(axis=-1, keepdims=True) / 254
    # absmax/254 up to float32 rounding of the scale (a tie such as [60, 30] lands one ulp
    # beyond), plus float32 steps where the scale is subnormal (x = 3.8e-44, where absmax / 127
    # underflows)
    assert np.all(np.abs(got - x) <= bound * (1 + 2.0**-15) + 2.0**-148)
    assert q.dtype == np.int8 and np.all(np.abs(q.astype(int)) <= 127)


@settings(max_examples=int(os.environ.get("SHMKV_HYPOTHESIS_EXAMPLES", "300")), deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=8),
                  elements=_floats))
def test_bfloat16_codec_bound_property(x):
    got = _quant.from_bf16(_quant.to_bf16(x)).astype(np.float64)
    finite = np.isfinite(got)
    # values rounding past bfloat16's largest finite number become inf; all others are within
    # 2^-8 relative, except below the normal range (2.086e-41 -> 0), where
    # bfloat16's subnormal spacing 2^-133 rules: half a step absolute
    err = np.abs(got[finite] - x[finite])
    assert np.all(err <= np.maximum(np.abs(x[finite].astype(np.float64)) * 2.0**-8, 2.0**-134))
    assert np.all(np.abs(x[~finite]) > 3.38e38)
