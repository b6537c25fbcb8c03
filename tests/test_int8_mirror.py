"""int8 decoding in O(1) a token: append's views come from the write handle's
dequantized mirror; they must equal a dequantization of what the shared cells hold at every
step, across truncate, copy_prefix into the sequence, another process's writes and a lease
take-over. And any finite float input of any float dtype is quantized without a warning."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv._sequence import quant as _quant
from shmkv.testing import start_in_process
from procs.int8 import take_over_and_write

SEED = 2424
L, H, D = 3, 2, 16


def _dequantized(x: np.ndarray) -> np.ndarray:
    return _quant.dequantize_int8(*_quant.quantize_int8(x))


def _step(seq: shmkv.Sequence, rng: np.random.Generator, n: int, dtype: type = np.float32) -> None:
    """Append n tokens to every layer (in one or two appends), checking every returned view:
    before the commit, the committed tokens dequantized and the pending ones as given; after
    it, the dequantization of the shared cells, which hold the pending ones quantized."""
    views = []
    for layer in range(L):
        committed = seq.keys(layer), seq.values(layer)  # int8: dequantized copies of the cells
        pending: list[np.ndarray] = []
        for part in ([n] if n < 2 else [1, n - 1]):
            kv = (rng.standard_normal((2, part, H, D)) * rng.uniform(0.01, 50)).astype(dtype)
            pending.append(kv)
            k, v = seq.append(layer, kv[0], kv[1])
            for i, got in enumerate((k, v)):
                want = np.concatenate([committed[i], *(x[i].astype(np.float32) for x in pending)])
                np.testing.assert_array_equal(got, want)
            assert k.dtype == np.float32 and not k.flags.writeable
        views.append((k, v, np.concatenate(pending, axis=1).astype(np.float32)))
    seq.commit()
    for layer, (k, v, new) in enumerate(views):
        np.testing.assert_array_equal(k, seq.keys(layer))
        np.testing.assert_array_equal(v, seq.values(layer))
        np.testing.assert_array_equal(k[-n:], _dequantized(new[0]))  # the same codes as quantize_int8's
        np.testing.assert_array_equal(v[-n:], _dequantized(new[1]))


@pytest.mark.slow
def test_int8_append_views_equal_the_dequantized_cells_at_every_step(make_store):
    print(f"seed={SEED}")
    rng = np.random.default_rng(SEED)
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=4096, max_seqs=8)
    seq = store.create_sequence(capacity=8)  # small: the sequence grows (moves) on the way
    donor = store.create_sequence(capacity=64)
    donor.extend(*rng.standard_normal((2, L, 40, H, D)).astype(np.float32))
    for step in range(120):
        _step(seq, rng, int(rng.integers(1, 4)), np.float16 if step % 3 == 1 else np.float32)
        if step % 7 == 3:
            seq.truncate(max(0, seq.length - int(rng.integers(1, 5))))  # speculative rollback
        if step % 31 == 17:
            store.copy_prefix(donor.id, seq.id, int(rng.integers(1, 40)))  # new content, same handle
        if step % 23 == 11:  # a prefill through extend, then appends go on after it
            seq.extend(*rng.standard_normal((2, L, 5, H, D)).astype(np.float16))
        if step % 13 == 5:  # pending tokens dropped: the cells they took are written again
            seq.append(0, *rng.standard_normal((2, 2, H, D)))
            assert seq.discard() == 2
    assert seq.length > 0


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_int8_mirror_after_another_process_wrote(make_store, method):
    rng = np.random.default_rng(SEED + 1)
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=1024, max_seqs=4)
    seq = store.create_sequence(capacity=64)
    for _ in range(5):
        _step(seq, rng, 1)
    sid = seq.id
    seq.release()  # the lease goes to another process, which writes and gives it back
    n = start_in_process(take_over_and_write, store.name, sid, 7, SEED, start_method=method, timeout=120).result()
    assert n == 12
    again = store.sequence(sid, write=True)  # a new write handle: its mirror starts from the cells
    for _ in range(4):
        _step(again, rng, 2)
    assert again.length == 20


def test_int8_mirror_after_a_lease_take_over_of_the_same_sequence(make_store):
    """A handle whose lease was taken over refuses to write; the new holder's views are right."""
    rng = np.random.default_rng(SEED + 2)
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=1024, max_seqs=4)
    seq = store.create_sequence(capacity=64)
    _step(seq, rng, 3)
    seq.release()
    b = store.sequence(seq.id, write=True)
    _step(b, rng, 2)
    with pytest.raises(shmkv.ShmkvError):
        seq.append(0, np.ones((H, D)), np.ones((H, D)))
    _step(b, rng, 1)
    assert b.length == 6


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_any_float_input_to_an_int8_store_without_a_warning(make_store, dtype):
    """pytest runs with filterwarnings=error: a warning here fails the test (float16
    input must not warn 'overflow encountered in cast' on a first write)."""
    rng = np.random.default_rng(SEED + 3)
    x32 = (rng.standard_normal((2, L, 6, H, D)) * 3).astype(np.float32)
    x32[:, :, 0] = 0.0  # an all-zero token
    if dtype == "bfloat16":
        ml = pytest.importorskip("ml_dtypes")
        x = x32.astype(ml.bfloat16)
    else:
        x = x32.astype(dtype)
    exact = x.astype(np.float64)  # the values the store was given (float64 holds each exactly)
    if dtype == "float64":
        exact[0, 0, 1, 0, 0] = 3.0e38  # near float32's maximum: still finite in float32
        x = exact.copy()
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=64)
    seq = store.create_sequence(capacity=16)
    seq.extend(x[0, :, :4], x[1, :, :4])
    views = [seq.append(layer, x[0, layer, 4:], x[1, layer, 4:])[0] for layer in range(L)]
    seq.commit()
    for layer, k in enumerate(views):  # after the commit: the dequantized cells
        want = _quant.dequantize_int8(*_quant.quantize_int8(exact[0, layer].astype(np.float32)))
        np.testing.assert_array_equal(k, want)
        bound = np.abs(exact[0, layer]).max(axis=-1, keepdims=True) / 254
        assert np.all(np.abs(k - exact[0, layer]) <= bound * (1 + 2.0**-15) + 2.0**-148)
    for value in (np.inf, -np.inf, np.nan, 1e39):  # 1e39: beyond float32 (only float64 holds it)
        if value == 1e39 and dtype != "float64":
            continue
        bad = x[0, 0, :2].copy()
        bad[1, 0, 3] = value
        # refused by append, or (float16 and float32 on a write handle's fast path) by the commit
        with pytest.raises(shmkv.InvalidArgumentError, match="NaN or infinity"):
            seq.append(0, x[0, 0, :2], bad)  # in v: k is fine
            for layer in range(1, L):
                seq.append(layer, x[0, layer, :2], x[0, layer, :2])
            seq.commit()
        assert seq.length == 6 and seq.pending == 0
        with pytest.raises(shmkv.InvalidArgumentError, match="NaN or infinity"):
            seq.extend(np.stack([bad] * L), np.stack([bad] * L))
    assert seq.length == 6 and seq.pending == 0
    k, _ = seq.append(0, x[0, 0, :2], x[0, 0, :2])  # and the handle writes on
    np.testing.assert_array_equal(k[:6], seq.keys(0))


def test_int8_pending_tokens_live_in_the_mirror_until_commit(make_store):
    """Pending int8 tokens are quantized at commit: until then torch_kv/batch_kv(pending=True)
    show them as given (as append's views do), the shared cells are not read for them, and the
    handle's own changes between append and commit (meta, growth) keep them."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(SEED + 4)
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=1024, max_seqs=4)
    seq = store.create_sequence(capacity=4)
    _step(seq, rng, 3)
    kv = (rng.standard_normal((2, L, 3, H, D)) * 7).astype(np.float16)
    views = []
    for layer in range(L):
        views.append(seq.append(layer, kv[0, layer], kv[1, layer]))  # grows past capacity 4 on layer 0
        if layer == 0:
            seq.meta = {"request": 7}  # our own change: the pending tokens stay
    for layer in range(L):
        want_k = np.concatenate([seq.keys(layer), kv[0, layer].astype(np.float32)])
        tk, tv = seq.torch_kv(layer, pending=True)
        np.testing.assert_array_equal(tv.numpy(), views[layer][1])
        np.testing.assert_array_equal(tk.numpy(), want_k)
        np.testing.assert_array_equal(views[layer][0], want_k)
        bk, _ = store.batch_kv([seq], layer, pending=True)
        np.testing.assert_array_equal(bk[0], want_k)
    assert seq.commit() == 6 and seq.meta == {"request": 7}
    for layer in range(L):
        k, v = views[layer]
        np.testing.assert_array_equal(k, seq.keys(layer))
        np.testing.assert_array_equal(v, seq.values(layer))
        np.testing.assert_array_equal(k[3:], _dequantized(kv[0, layer].astype(np.float32)))
        assert torch.equal(seq.torch_kv(layer)[0], torch.from_numpy(seq.keys(layer)))


def test_int8_commit_refuses_non_finite_pending_tokens_and_keeps_the_committed(make_store):
    rng = np.random.default_rng(SEED + 5)
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=1024, max_seqs=4)
    seq = store.create_sequence(capacity=64)
    _step(seq, rng, 2)
    before = [seq.keys(layer) for layer in range(L)]
    for layer in range(L):
        k = rng.standard_normal((H, D)).astype(np.float32)
        if layer == 2:
            k[1, 5] = np.nan
        seq.append(layer, k, k)  # the fast path: refused at commit, not here
    with pytest.raises(shmkv.InvalidArgumentError, match=r"layer 2, token 2 \(head 1\) holds nan"):
        seq.commit()
    assert seq.length == 2 and seq.pending == 0
    for layer in range(L):
        np.testing.assert_array_equal(seq.keys(layer), before[layer])
    _step(seq, rng, 1)  # and the handle writes on
    assert seq.length == 3
