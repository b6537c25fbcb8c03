"""int8 quantization's two paths: numba's compiled loops (``shmkv[fast]``,
_sequence/quant_jit.py) and the numpy path they replace must give the same codes, scales and
mirror values, bit for bit, for float16, bfloat16, float32 and float64 input; both are checked
here against one plain numpy reference computed in this file."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import importorskip_unless_ci
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import shmkv
from shmkv._sequence import quant as _quant

SEED = 2468
F32_MAX = float(np.finfo(np.float32).max)
BIG = F32_MAX  # the largest input magnitude the strategies draw
EXAMPLES = int(os.environ.get("SHMKV_HYPOTHESIS_EXAMPLES", "300"))
ml_dtypes = importorskip_unless_ci("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]


def _numba() -> object:
    importorskip_unless_ci("numba")  # the extra shmkv[fast]: CI installs it
    from shmkv._sequence import quant_jit

    return quant_jit


@pytest.fixture(params=["numpy", "numba"])
def path(request, monkeypatch):
    """The quantization path this test runs: numpy's calls, or the compiled loops."""
    monkeypatch.setattr(_quant, "_JIT", _numba() if request.param == "numba" else False)
    return request.param


def _largest_finite_scale() -> np.float32:
    """The largest float32 s with 127 * s finite in float32: a bisection over the bits of the
    positive float32s (fl(127 * s) grows with s)."""
    lo, hi = 0, 0x7F7FFFFF  # 127 * (the float with bits lo) is finite, with bits hi it is not
    with np.errstate(over="ignore"):
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if np.isfinite(np.float32(127) * np.array(mid, np.int32).view(np.float32)):
                lo = mid
            else:
                hi = mid
    return np.array(lo, np.int32).view(np.float32)[()]


SCALE_MAX = _largest_finite_scale()


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 codes, float32 scales and dequantized float32 values of rows ``x`` [..., D] (finite,
    within float32's range), straight from quant's docstring: the values in float32 (numpy's
    cast), scale = absmax / 127 in float32, at most the largest scale whose 127 * scale is
    finite (absmax = float32's largest); a subnormal scale at least the smallest float32 step
    and stepped up until absmax <= 127.5 * scale; codes rint(x / scale) (half to even) clipped
    to [-127, 127]; an all-zero row has scale 0 (divided by 1). Dequantized: code * the divisor."""
    f = x.astype(np.float32)
    am = np.abs(f).max(axis=-1)
    scale = np.minimum((am / np.float32(127)).astype(np.float32), SCALE_MAX)
    scale = np.where(am > 0, np.maximum(scale, np.float32(2.0**-149)), np.float32(0)).astype(np.float32)
    for _ in range(4):
        low = am.astype(np.float64) > 127.5 * scale.astype(np.float64)
        scale = np.where(low, np.nextafter(scale, np.float32(np.inf)), scale).astype(np.float32)
    div = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)[..., None]
    q = np.clip(np.rint(f / div), -127, 127).astype(np.float32)
    return q.astype(np.int8), scale, (q * div).astype(np.float32)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _edge_rows(dtype: np.dtype, D: int) -> np.ndarray:
    """Rows every quantizer gets wrong first: zeros (and -0.0), subnormal magnitudes (whose
    scale underflows or rounds far down), the dtype's largest values, ties at .5 codes,
    one value among zeros, mixed magnitudes."""
    big = {np.dtype(np.float16): 65504.0, BF16: float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)}.get(dtype, BIG)
    tiny = {np.dtype(np.float16): 2.0**-24, BF16: 2.0**-133}.get(dtype, 2.0**-149)
    rows = [np.zeros(D), -np.zeros(D), np.full(D, tiny), np.arange(D) * tiny, np.full(D, big),
            np.linspace(-big, big, D), np.r_[127.0, np.arange(D - 1) + 0.5], np.eye(1, D, D // 2)[0] * 3.0,
            np.r_[1e-3, np.full(D - 1, 1e3)], np.full(D, 1.675e-42), np.full(D, 3.8e-44), -np.arange(D) * 1e-40,
            np.r_[-big, np.zeros(D - 1)]]
    if dtype.itemsize >= 4:  # float32's largest and a few ulps below it (its scale is capped)
        rows += [np.linspace(-_below_max(k), 0, D) for k in range(4)]
    return np.array(rows).astype(dtype)


def _below_max(ulps: int) -> float:
    """float32's largest value ``ulps`` float32 steps down."""
    return float(np.array(np.array(F32_MAX, np.float32).view(np.int32) - ulps, np.int32).view(np.float32))


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    H = x.shape[0]
    q = np.empty(x.shape, np.int8)
    s = np.empty(x.shape[:-1], np.float32)
    _quant.quantize_into(x.reshape(H, 1, -1), q.reshape(H, 1, -1), s.reshape(H, 1))
    return q, s


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_paths_equal_the_reference_on_edge_rows(path, dtype):
    x = _edge_rows(dtype, 24)
    want_q, want_s, _ = reference(x)
    q, s = _quantize(x)
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(_bits(s), _bits(want_s))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_paths_equal_the_reference_on_a_prefill(path, dtype, make_store):
    """An extend's shape (thousands of rows, every magnitude), and through a store's extend."""
    print(f"seed={SEED}")
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((2, 300, 4, 64)) * np.exp(rng.uniform(-40, 40, (2, 300, 4, 1)))
    edge = _edge_rows(dtype, 64)
    t = -(-len(edge) // 4)  # tokens of 4 heads holding every edge row
    x[:, :t] = np.concatenate([edge, edge[: 4 * t - len(edge)]]).reshape(t, 4, 64)
    x = x.clip(-6e4, 6e4).astype(dtype) if dtype == np.float16 else x.astype(dtype)
    q, s = _quantize(x.reshape(-1, 64))
    want_q, want_s, _ = reference(x.reshape(-1, 64))
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(_bits(s), _bits(want_s))
    store = make_store(layers=1, kv_heads=4, head_dim=64, dtype="int8", max_tokens=1024, max_seqs=2)
    seq = store.create_sequence(capacity=600)
    seq.extend(x[:1], x[1:])
    want_k = want_q.reshape(2, 300, 4, 64)[0].astype(np.float32) * want_s.reshape(2, 300, 4)[0, ..., None]
    np.testing.assert_array_equal(_bits(seq.keys(0)), _bits(want_k))  # dequantize_int8's values



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_read_only_input_quantizes_as_writable_input_and_stays_unchanged(path, dtype, make_store):
    """K/V the caller cannot write (a frombuffer array, a read-only view): the same codes and
    scales as the reference, by quantize_into, an extend and a decode step, the input untouched
    (the edge rows take the subnormal-scale loop too)."""
    x = _edge_rows(dtype, 32)
    x.flags.writeable = False
    before = x.copy()
    want_q, want_s, _ = reference(x)
    q, s = _quantize(x)
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(_bits(s), _bits(want_s))
    store = make_store(layers=1, kv_heads=len(x), head_dim=32, dtype="int8", max_tokens=64, max_seqs=2)
    seq = store.create_sequence(capacity=8)
    kv = x.reshape(1, 1, len(x), 32)
    seq.extend(kv, kv)
    seq.append(0, x, x)
    seq.commit()
    want_k = want_q.astype(np.float32) * want_s[:, None]
    for t in range(2):
        np.testing.assert_array_equal(_bits(seq.keys(0)[t]), _bits(want_k))
    np.testing.assert_array_equal(_bits(x), _bits(before))

def _within_the_codec_bound(x: np.ndarray, got: np.ndarray) -> None:
    """quant's documented error: |dequantized - x| <= absmax / 254 per row, up to float32
    rounding of the scale (as tests/test_quant.py bounds it)."""
    assert np.isfinite(got).all()
    x = x.astype(np.float64)
    bound = np.abs(x).max(axis=-1, keepdims=True) / 254
    err = np.abs(got.astype(np.float64) - x)
    assert np.all(err <= bound * (1 + 2.0**-15) + 2.0**-148), float((err - bound).max())


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_rows_at_float32s_largest_read_back_finite(path, dtype, make_store):
    """A row whose absmax is float32's largest value (or a few ulps below it) reads back finite:
    127 * fl(absmax / 127) can round past it, so the scale is capped.
    Through the codec, an extend (prefill) and a decode step's commit (the mirror's rows)."""
    D, H = 16, 4
    rows = []
    for k in range(5):
        for sign in (1, -1):
            r = np.linspace(-1e30, 1e30, D)
            r[(3 * k) % D] = sign * _below_max(k)
            rows.append(r)
    x = np.array(rows).astype(dtype)  # [10, D]
    q, s = _quantize(x)
    assert np.isfinite(np.float32(127) * s).all()
    _within_the_codec_bound(x, _quant.dequantize_int8(q, s))
    _, _, want = reference(x)
    np.testing.assert_array_equal(_quant.dequantize_int8(q, s), want)  # (the codes lose -0.0)

    kv = x[: 2 * H].reshape(1, 2, H, D)  # [layers, tokens, heads, D]
    store = make_store(layers=1, kv_heads=H, head_dim=D, dtype="int8", max_tokens=64, max_seqs=2)
    seq = store.create_sequence(capacity=8)
    seq.extend(kv, kv[:, ::-1])
    _within_the_codec_bound(kv[0], seq.keys(0))
    _within_the_codec_bound(kv[0, ::-1], seq.values(0))
    step = x[2 * H - 2 : 3 * H - 2]  # one token: [H, D]
    k, v = seq.append(0, step, -step)
    seq.commit()
    _within_the_codec_bound(step, k[-1])  # the mirror's view, dequantized at commit
    _within_the_codec_bound(-step, v[-1])
    np.testing.assert_array_equal(k, seq.keys(0))  # equal (the mirror keeps -0.0)
    _within_the_codec_bound(np.concatenate([kv[0], step[None]]), seq.keys(0))


_F16 = st.floats(width=16, allow_nan=False, allow_infinity=False)
_F32 = st.floats(min_value=-BIG, max_value=BIG, width=32, allow_nan=False, allow_infinity=False)
_F64 = st.floats(min_value=-BIG, max_value=BIG, allow_nan=False, allow_infinity=False)
_ROWS = hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=40)


def _same_on_both_paths(x: np.ndarray) -> None:
    want_q, want_s, _ = reference(x)
    jit = _numba()
    for impl in (False, jit):
        _quant._JIT = impl
        try:
            q, s = _quantize(x)
        finally:
            _quant._JIT = None
        np.testing.assert_array_equal(_bits(q), _bits(want_q))
        np.testing.assert_array_equal(_bits(s), _bits(want_s))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float16, _ROWS, elements=_F16))
def test_float16_rows_property(x):
    _same_on_both_paths(x)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float32, _ROWS, elements=_F32))
def test_float32_rows_property(x):
    _same_on_both_paths(x)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.float64, _ROWS, elements=_F64))
def test_float64_rows_property(x):
    _same_on_both_paths(x)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(hnp.arrays(np.uint16, _ROWS))
def test_bfloat16_rows_property(bits):
    finite = (bits & 0x7F80) != 0x7F80  # (on the bits: isfinite of a signalling NaN warns)
    x = np.where(finite, bits, 0).astype(np.uint16).view(BF16)  # every finite bfloat16, subnormals too
    _same_on_both_paths(x)


@pytest.mark.parametrize(("dtype", "bad"), [*((dt, b) for dt in DTYPES for b in (np.nan, np.inf, -np.inf)),
                                             (np.dtype(np.float64), 3.5e38)], ids=str)
def test_both_paths_refuse_non_finite_alike(path, dtype, bad):
    x = np.ones((3, 1, 8), dtype)
    x[2, 0, 5] = bad
    q = np.zeros(x.shape, np.int8)
    s = np.zeros(x.shape[:2], np.float32)
    with pytest.raises(shmkv.InvalidArgumentError, match=r"x holds .* at index \[2, 0, 5\]"):
        _quant.quantize_into(x, q, s)


def test_a_float64_just_beyond_float32s_largest_is_refused(path):
    """It rounds to float32's largest in a cast, but it is out of range: checked in float64."""
    x = np.ones((1, 1, 4))
    x[0, 0, 1] = np.nextafter(F32_MAX, np.inf)
    with pytest.raises(shmkv.InvalidArgumentError, match="float32's maximum"):
        _quant.quantize_into(x, np.zeros((1, 1, 4), np.int8), np.zeros((1, 1), np.float32))


@pytest.mark.parametrize("soft", [False, True], ids=["this-cpu", "without-f16c"])
def test_every_float16_converts_as_numpys_cast(soft):
    """The compiled float16 -> float32 conversion, all 65,536 bit patterns: numpy's cast bit for
    bit, NaN a NaN (F16C quiets a signalling one; every NaN is refused before it is stored)."""
    jit = _numba()
    bits = np.arange(-(2**15), 2**15, dtype=np.int16)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    got = np.zeros(bits.size, np.float32)
    jit.f16_to_f32(bits, got, soft)
    np.testing.assert_array_equal(got.view(np.int32)[~nan], want.view(np.int32)[~nan])
    assert np.isnan(got[nan]).all()


def test_an_appends_float16_conversion_is_numpys_cast():
    """put_f16 (the append's fast path) converts K and V into their own rows of the mirror."""
    jit = _numba()
    bits = np.arange(-(2**15), 2**15, dtype=np.int16).reshape(64, 8, 128)
    M = np.zeros((2, 2, 70, 8, 128), np.float32)
    jit.put_f16(bits, bits[::-1].copy(), M, 1, 3)
    want = bits.view(np.float16).astype(np.float32)
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(M[1, 0, 3:67][ok], want[ok])
    np.testing.assert_array_equal(M[1, 1, 3:67][ok[::-1]], want[::-1][ok[::-1]])
    assert not M[0].any() and not M[1, :, :3].any() and not M[1, :, 67:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_steps_give_the_same_bits_on_both_paths(dtype, make_store, monkeypatch):
    """append + commit through a write handle's mirror (the compiled commit, and the compiled
    float16 append): the views and the stored codes and scales of both paths, and the
    reference's dequantized values, are the same bits at every step."""
    jit = _numba()
    print(f"seed={SEED}")
    L, H, D, steps = 3, 2, 32, 24
    rng = np.random.default_rng(SEED)
    data = rng.standard_normal((steps, L, 2, 2, H, D)) * np.exp(rng.uniform(-30, 30, (steps, L, 2, 2, H, 1)))
    data[3] = 0.0
    data[5, :, :, :, 0] = 1e-42
    data = data.clip(-6e4, 6e4).astype(dtype) if dtype == np.float16 else data.astype(dtype)
    prefill = rng.standard_normal((2, L, 3, H, D)).astype(np.float32)
    results = []
    for impl in (False, jit):
        monkeypatch.setattr(_quant, "_JIT", impl)
        store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=256, max_seqs=2)
        seq = store.create_sequence(capacity=8)
        seq.extend(*prefill)
        got = []
        for step in range(steps):
            n = 1 + step % 2
            views = [seq.append(layer, data[step, layer, 0, :n], data[step, layer, 1, :n]) for layer in range(L)]
            for layer, (k, v) in enumerate(views):  # pending: as given, in float32
                np.testing.assert_array_equal(k[-n:], data[step, layer, 0, :n].astype(np.float32))
                np.testing.assert_array_equal(v[-n:], data[step, layer, 1, :n].astype(np.float32))
            seq.commit()
            for layer, (k, v) in enumerate(views):
                for which, view in enumerate((k, v)):
                    _, _, want = reference(data[step, layer, which, :n])
                    np.testing.assert_array_equal(_bits(view[-n:]), _bits(want))
                np.testing.assert_array_equal(k, seq.keys(layer))
                got.append((k.copy(), v.copy()))
        K, V, KS, VS = store._engine.K, store._engine.V, store._engine.KS, store._engine.VS
        results.append((got, K.copy(), V.copy(), KS.copy(), VS.copy()))
    (g0, *a0), (g1, *a1) = results
    for x, y in zip(a0, a1, strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))
    for (k0, v0), (k1, v1) in zip(g0, g1, strict=True):
        np.testing.assert_array_equal(_bits(k0), _bits(k1))
        np.testing.assert_array_equal(_bits(v0), _bits(v1))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_pending_value_is_refused_at_commit_on_both_paths(path, make_store, bad):
    L, H, D = 2, 2, 8
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=64, max_seqs=2)
    seq = store.create_sequence(capacity=16)
    seq.extend(np.ones((L, 2, H, D), np.float16), np.ones((L, 2, H, D), np.float16))
    before = [seq.keys(layer).copy() for layer in range(L)]
    k = np.ones((H, D), np.float16)
    bad_v = k.copy()
    bad_v[1, 3] = bad
    seq.append(0, k, k)
    seq.append(1, k, bad_v)
    with pytest.raises(shmkv.InvalidArgumentError, match=r"pending v of layer 1, token 2 \(head 1\)"):
        seq.commit()
    assert seq.length == 2
    for layer in range(L):
        np.testing.assert_array_equal(seq.keys(layer), before[layer])
    for layer in range(L):  # the handle goes on: its next step starts from the committed tokens
        kv = seq.append(layer, k, k)
        assert kv[0].shape[0] == 3
    seq.commit()
    np.testing.assert_array_equal(seq.keys(1)[2], np.ones((H, D), np.float32))


def _run(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_numba_is_imported_only_when_an_int8_store_quantizes():
    _numba()
    code = (
        "import sys, numpy as np, shmkv\n"
        "from shmkv.testing import unique_name\n"
        "print('numba' in sys.modules)\n"
        "st = shmkv.create(unique_name('qi'), layers=1, kv_heads=1, head_dim=4, dtype='float16', max_tokens=8,"
        " max_seqs=1)\n"
        "st.create_sequence(capacity=4).extend(np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))\n"
        "st.close()\n"
        "print('numba' in sys.modules)\n"
        "st = shmkv.create(unique_name('qi'), layers=1, kv_heads=1, head_dim=4, dtype='int8', max_tokens=8,"
        " max_seqs=1)\n"
        "st.create_sequence(capacity=4).extend(np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))\n"
        "st.close()\n"
        "print('numba' in sys.modules)\n"
    )
    assert _run(code).split() == ["False", "False", "True"]
    assert _run(code, SHMKV_NUMBA="0").split() == ["False", "False", "False"]


@pytest.mark.slow
def test_a_generic_numba_target_uses_the_integer_conversion(tmp_path):
    """NUMBA_CPU_NAME=generic (portable caches in container images): numba then compiles for a
    CPU without F16C, where LLVM lowers the float16 conversion to a helper numba does not link
    (calling it segfaults on the first int8 write). The kernels take the
    integer conversion there, and an int8 decode gives the numpy path's bytes."""
    _numba()
    code = (
        "import numpy as np, shmkv\n"
        "from shmkv.testing import unique_name\n"
        "from shmkv._sequence import quant\n"
        "J = quant.kernels()\n"
        "print(J is not None and J._F16C)\n"
        "st = shmkv.create(unique_name('qg'), layers=2, kv_heads=2, head_dim=64, dtype='int8', max_tokens=256,"
        " max_seqs=2)\n"
        "s = st.create_sequence(capacity=64)\n"
        "k = np.random.default_rng(3).standard_normal((2, 5, 2, 64)).astype(np.float16)\n"
        "s.extend(k[:, :4], k[:, :4])\n"
        "views = [s.append(layer, k[layer, 4], k[layer, 4])[0] for layer in range(2)]\n"
        "s.commit()\n"
        "print(np.concatenate([v.ravel() for v in views] + [s.keys(0).ravel(), s.values(1).ravel()]).tobytes().hex())\n"
        "st.close()\n"
    )
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    generic = _run(code, NUMBA_CPU_NAME="generic", **env).split()
    assert generic[0] == "False"  # no F16C for that target
    assert generic[1] == _run(code, SHMKV_NUMBA="0", **env).split()[1]


_CTRL_C_IN_A_COMPILE = """
import signal, sys, numpy as np, shmkv
import llvmlite.binding.executionengine as ee
from shmkv.testing import unique_name

string_at = ee.string_at

def ctrl_c_then(*args):  # called inside LLVM's ctypes callback as a loop compiles: the Ctrl-C lands there
    ee.string_at = string_at
    print("ctrl-c", flush=True)
    signal.raise_signal(signal.SIGINT)
    return string_at(*args)

ee.string_at = ctrl_c_then
k = np.frombuffer(bytes.fromhex(sys.argv[1]), np.float16).reshape(2, 3, 2, 64)
st = shmkv.create(unique_name("qc"), layers=2, kv_heads=2, head_dim=64, dtype="int8", max_tokens=64, max_seqs=2)
try:
    try:
        st.create_sequence(capacity=8).extend(k, k)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    s = st.create_sequence(capacity=8)
    s.extend(k, k)
    print(np.concatenate([s.keys(0).ravel(), s.values(1).ravel()]).astype(np.float32).tobytes().hex())
finally:
    st.close()
    st.unlink()
"""


@pytest.mark.slow
def test_a_ctrl_c_while_a_loop_compiles_waits_for_the_compile(tmp_path):
    """A Ctrl-C that lands in LLVM's callback into Python while numba compiles a loop (the first
    int8 write, numba's cache empty) is raised from the write once the compile ends: no
    "Exception ignored" traceback, no Ctrl-C lost; the process carries on with the compiled
    loops, whose values are the reference's."""
    _numba()
    k = np.random.default_rng(SEED).standard_normal((2, 3, 2, 64)).astype(np.float16)
    out = subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_COMPILE, k.tobytes().hex()], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0 and "Exception ignored" not in out.stderr, out.stderr
    lines = out.stdout.split()
    assert lines[:2] == ["ctrl-c", "interrupted"], out.stdout
    want = np.concatenate([reference(k[0])[2].ravel(), reference(k[1])[2].ravel()])
    np.testing.assert_array_equal(np.frombuffer(bytes.fromhex(lines[2]), np.float32), want)  # (-0.0 == 0.0)
