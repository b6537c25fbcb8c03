"""An int8 store's ``set_encoder`` quantizes before it takes the store lock: a process's first
quantization loads or compiles the compiled loops (``_sequence/quant_jit.py``: about 0.3 s to
import numba, seconds to compile), which under the lock would stall every other process's
structural operations. The values read back are those of ``_quant.quantize_int8``, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from shmkv._sequence import quant as _quant
from shmkv.store._store import engine_of

L, H, D = 3, 2, 16


@pytest.mark.parametrize("src", ["float32", "float16", "float64-strided"])
def test_int8_set_encoder_quantizes_while_the_lock_is_not_held(make_store, monkeypatch, src):
    rng = np.random.default_rng(5)
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=256, max_seqs=4)
    e = engine_of(st)
    if src == "float64-strided":  # a non-contiguous input (the numpy path, not a compiled loop)
        ek = rng.standard_normal((L, D, 7, H)).transpose(0, 2, 3, 1)
        ev = rng.standard_normal((L, D, 7, H)).transpose(0, 2, 3, 1)
    else:
        ek = rng.standard_normal((L, 7, H, D)).astype(src)
        ev = rng.standard_normal((L, 7, H, D)).astype(src)
    want = [(_quant.dequantize_int8(*_quant.quantize_int8(ek[i])),
             _quant.dequantize_int8(*_quant.quantize_int8(ev[i]))) for i in range(L)]
    held: list[bool] = []
    real = _quant.quantize_into

    def spy(x, codes, scales, **kw):
        held.append(e.lock_owned())  # (this thread: the store lock is re-entrant per process)
        return real(x, codes, scales, **kw)

    monkeypatch.setattr(_quant, "quantize_into", spy)
    seq = st.create_sequence(capacity=8)
    seq.set_encoder(ek, ev)
    assert held and not any(held), held
    monkeypatch.undo()
    assert seq.encoder_length == 7
    for layer in range(L):
        k, v = seq.encoder_kv(layer)
        np.testing.assert_array_equal(k, want[layer][0])
        np.testing.assert_array_equal(v, want[layer][1])
    # a replacement, and a reader in another handle, see the same
    seq.set_encoder(ek[:, :3], ev[:, :3])
    other = st.sequence(seq.id)
    assert other.encoder_length == 3
    np.testing.assert_array_equal(other.encoder_kv(L - 1)[0], want[L - 1][0][:3])
