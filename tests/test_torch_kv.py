"""seq.torch_kv: torch tensors on the shared cache. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv

torch = pytest.importorskip("torch")


def filled(store: shmkv.Store, n: int = 5) -> shmkv.Sequence:
    lay = store.layout
    rng = np.random.default_rng(3)
    seq = store.create_sequence(capacity=16)
    shape = (lay.layers, n, lay.kv_heads, lay.head_dim)
    seq.extend(rng.standard_normal(shape), rng.standard_normal(shape))
    return seq


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
def test_zero_copy_on_a_read_write_attachment(make_store, dtype):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype=dtype)
    seq = filled(store)
    reader = store.sequence(seq.id)  # a read handle of a read-write attachment
    k, v = reader.torch_kv(1)
    want = {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64,
            "bfloat16": torch.bfloat16}[dtype]
    assert k.dtype == want and v.dtype == want and tuple(k.shape) == (5, 2, 4)
    nk, nv = seq.kv(1)
    np.testing.assert_array_equal(k.float().numpy(), np.asarray(nk, np.float32))
    np.testing.assert_array_equal(v.float().numpy(), np.asarray(nv, np.float32))
    raw = seq.raw_keys(1)[0]
    assert k.data_ptr() == raw.ctypes.data  # the shared cells themselves
    k[2, 1, 3] = 42.0  # writing into the tensor writes the shared cache
    assert float(np.asarray(seq.keys(1), np.float32)[2, 1, 3]) == 42.0
    other = shmkv.attach(store.name)  # ... which every attachment sees
    try:
        assert float(np.asarray(other.sequence(seq.id).keys(1), np.float32)[2, 1, 3]) == 42.0
    finally:
        other.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_copies_on_a_read_only_attachment(make_store, dtype):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype=dtype)
    seq = filled(store)
    ro = shmkv.attach(store.name, readonly=True)
    try:
        k, _ = ro.sequence(seq.id).torch_kv(0)  # no "non-writable array" warning (an error here)
        np.testing.assert_array_equal(k.float().numpy(), np.asarray(seq.keys(0), np.float32))
        assert k.data_ptr() != seq.raw_keys(0)[0].ctypes.data
        k[0] = 99.0  # a private copy
        assert float(np.asarray(seq.keys(0), np.float32)[0, 0, 0]) != 99.0
    finally:
        ro.close()


def test_int8_gives_dequantized_copies(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="int8")
    seq = filled(store)
    k, v = seq.torch_kv(1)
    assert k.dtype == torch.float32
    np.testing.assert_array_equal(k.numpy(), seq.keys(1))
    np.testing.assert_array_equal(v.numpy(), seq.values(1))


def test_sliding_layer_and_empty_sequence(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, dtype="float32", layer_types=["full", "sliding"],
                       window=3)
    seq = filled(store, n=6)
    k, _ = seq.torch_kv(1)
    np.testing.assert_array_equal(k.numpy(), seq.keys(1))  # the tokens the sliding layer holds
    assert k.data_ptr() == seq.raw_keys(1)[0].ctypes.data
    empty = store.create_sequence(capacity=4)
    k, _ = empty.torch_kv(0)
    assert tuple(k.shape) == (0, 2, 4)
    with pytest.raises(shmkv.InvalidArgumentError):
        seq.torch_kv(2)


def test_import_shmkv_does_not_import_torch():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import shmkv, sys; assert 'torch' not in sys.modules"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind", ["bfloat16", "requires_grad"])
def test_tensors_numpy_cannot_read_are_refused_saying_what_to_pass(make_store, kind):
    """append, extend and a batch's put given a tensor numpy cannot read (torch's bfloat16, one
    that requires grad) say so and what to pass (t.float(), t.detach()); the sequence is as it
    was, and it takes what the message says to pass."""
    store = make_store(layers=1, kv_heads=2, head_dim=4, dtype="bfloat16")
    seq = store.create_sequence()
    t = torch.ones((1, 2, 4), dtype=torch.bfloat16) if kind == "bfloat16" else torch.ones((1, 2, 4), requires_grad=True)
    hint = "t.float()" if kind == "bfloat16" else "detach"
    with pytest.raises(shmkv.InvalidArgumentError, match=rf"append: k cannot be read as an array .*{hint}"):
        seq.append(0, t, t)
    with pytest.raises(shmkv.InvalidArgumentError, match=rf"extend: k_all cannot be read .*{hint}"):
        seq.extend(t[None], t[None])
    assert len(seq) == 0 and seq.pending == 0
    seq.append(0, t.float() if kind == "bfloat16" else t.detach(), np.zeros((1, 2, 4)))
    seq.commit()
    assert len(seq) == 1 and seq.keys(0).astype(np.float32).tolist() == [[[1.0] * 4] * 2]
