"""Batches of sequences: ``store.create_sequences(n, capacity, prefix=)`` (every
sequence or none) and ``store.batch_kv(seqs, layer, pending=, writable=)`` (one layer of
several sequences as ``[B, T, kv_heads, head_dim]``: a strided view of the shared cells
when the rows sit equally spaced, else a gathered copy). Values are checked against the
numpy arrays written (float32: stored == written) and against per-sequence reads; the
torch side is tests/test_transformers.py (the adapter reads batches through it).
"""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv._sequence import quant as _quant

H, D = 2, 4  # the plugin's default layout: layers=2, kv_heads=2, head_dim=4, float32


def kv(rng: np.random.Generator, b: int, layers: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[b, layers, n, H, D]``: one ``extend`` input per row."""
    return (rng.standard_normal((b, layers, n, H, D)).astype(np.float32),
            rng.standard_normal((b, layers, n, H, D)).astype(np.float32))


def filled(store: shmkv.Store, b: int, n: int, capacity: int = 16, seed: int = 0):
    """``b`` sequences made together, each extended by ``n`` random tokens; with the references."""
    k, v = kv(np.random.default_rng(seed), b, store.layout.layers, n)
    seqs = store.create_sequences(b, capacity)
    for s, kr, vr in zip(seqs, k, v, strict=True):
        s.extend(kr, vr, tokens=range(n))
    return seqs, k, v


def shares_store(a: np.ndarray, seqs: list[shmkv.Sequence], layer: int) -> list[bool]:
    """Per row: does ``a`` share memory with that sequence's cells of ``layer``."""
    return [np.shares_memory(a, s.keys(layer)) or np.shares_memory(a, s.values(layer)) for s in seqs]


# -- store.create_sequences --------------------------------------------------------------------


def test_create_sequences_are_leased_adjacent_and_equally_spaced(store):
    seqs, _, _ = filled(store, 3, 5, capacity=16)
    assert len({s.id for s in seqs}) == 3
    assert all(s.writable and s.capacity == 16 and len(s) == 5 for s in seqs)
    # first fit in an empty store: the ranges follow each other, capacity cells apart
    ptrs = [s.keys(0).__array_interface__["data"][0] for s in seqs]
    step = 16 * H * D * 4
    assert [p - ptrs[0] for p in ptrs] == [0, step, 2 * step]
    info = {i.id: i for i in store.sequences()}
    assert all(info[s.id].lease_pid > 0 for s in seqs)


def test_create_sequences_is_all_or_none(make_store):
    store = make_store(max_tokens=64, max_seqs=4)
    keep = store.create_sequence(capacity=16)
    before = [i.id for i in store.sequences()]
    with pytest.raises(shmkv.CacheFullError):  # the fourth of four does not fit in the 48 cells left
        store.create_sequences(4, 12)
    assert [i.id for i in store.sequences()] == before  # the three made were freed
    with pytest.raises(shmkv.CacheFullError):  # no fourth table row (max_seqs=4)
        store.create_sequences(4, 4)
    assert [i.id for i in store.sequences()] == before
    with pytest.raises(shmkv.InvalidArgumentError, match="prefix"):
        store.create_sequences(2, 4, prefix=[[1, 2, 3]])
    with pytest.raises(shmkv.InvalidArgumentError, match="n="):
        store.create_sequences(-1, 4)
    assert [i.id for i in store.sequences()] == before
    seqs = store.create_sequences(3, 16)  # exactly the room left
    assert len(seqs) == 3 and keep.capacity == 16
    assert store.create_sequences(0, 16) == []


def test_create_sequences_reuses_a_cached_prefix_per_row(store):
    rng = np.random.default_rng(1)
    k, v = kv(rng, 1, 2, 40)
    donor = store.create_sequence(capacity=64)
    prompt = np.arange(100, 140)
    donor.extend(k[0], v[0], tokens=prompt)
    donor.finish()
    other = np.arange(500, 520)
    hits0 = store.stats().prefix_hits
    a, b = store.create_sequences(2, 64, prefix=[prompt[:33], other])
    assert (len(a), len(b)) == (32, 0)  # at most len - 1 reused; a miss on the other row
    assert store.stats().prefix_hits == hits0 + 1
    ka, va = a.kv(1)
    np.testing.assert_array_equal(ka, k[0, 1, :32])
    np.testing.assert_array_equal(va, v[0, 1, :32])
    assert a.tokens.tolist() == prompt[:32].tolist()


# -- store.batch_kv: zero-copy when equally spaced ---------------------------------------------


@pytest.mark.parametrize("layer", [0, 1])
def test_batch_kv_of_rows_made_together_is_a_readonly_view(store, layer):
    seqs, k, v = filled(store, 3, 7)
    K, V = store.batch_kv(seqs, layer)
    assert K.shape == V.shape == (3, 7, H, D)
    np.testing.assert_array_equal(K, k[:, layer])
    np.testing.assert_array_equal(V, v[:, layer])
    for i, s in enumerate(seqs):  # the same as per-sequence reads
        np.testing.assert_array_equal(K[i], s.keys(layer))
        np.testing.assert_array_equal(V[i], s.values(layer))
    assert shares_store(K, seqs, layer) == [True] * 3
    assert shares_store(V, seqs, layer) == [True] * 3
    assert not K.flags.writeable and not V.flags.writeable
    with pytest.raises(ValueError):
        K[0, 0, 0, 0] = 1.0


def test_batch_kv_writable_views_write_the_shared_cells(store):
    seqs, k, _ = filled(store, 2, 4)
    K, V = store.batch_kv(seqs, 0, writable=True)
    assert V.flags.writeable
    assert K.flags.writeable
    K[1, 2] = 9.0  # row 1, token 2: that sequence's cell, seen by every reader
    other = shmkv.attach(store.name, readonly=True)
    try:
        np.testing.assert_array_equal(other.sequence(seqs[1].id).keys(0)[2], np.full((H, D), 9.0, np.float32))
        np.testing.assert_array_equal(other.sequence(seqs[0].id).keys(0), k[0, 0])
    finally:
        other.close()
    reader = store.sequence(seqs[0].id)  # a read handle: read-only views only
    with pytest.raises(shmkv.ReadOnlyError, match="writable"):
        store.batch_kv([reader, seqs[1]], 0, writable=True)
    K2, _ = store.batch_kv([reader, seqs[1]], 0)  # read: handles of any kind
    assert shares_store(K2, seqs, 0) == [True, True]


def test_batch_kv_pending_includes_each_handles_appended_tokens(store):
    seqs, k, v = filled(store, 3, 5)
    k2, v2 = kv(np.random.default_rng(7), 3, 2, 2)
    for s, kr, vr in zip(seqs, k2, v2, strict=True):
        s.append(0, kr[0], vr[0])  # a forward between its layers: layer 0 only
    K, V = store.batch_kv(seqs, 0, pending=True)
    np.testing.assert_array_equal(K, np.concatenate([k[:, 0], k2[:, 0]], 1))
    np.testing.assert_array_equal(V, np.concatenate([v[:, 0], v2[:, 0]], 1))
    assert shares_store(K, seqs, 0) == [True] * 3
    Kc, _ = store.batch_kv(seqs, 0)  # committed only
    np.testing.assert_array_equal(Kc, k[:, 0])
    K1, _ = store.batch_kv(seqs, 1, pending=True)  # nothing pending on layer 1: the committed ones
    np.testing.assert_array_equal(K1, k[:, 1])
    for s, kr, vr in zip(seqs, k2, v2, strict=True):
        s.append(1, kr[1], vr[1])
        s.commit()
    K, _ = store.batch_kv(seqs, 1)
    np.testing.assert_array_equal(K, np.concatenate([k[:, 1], k2[:, 1]], 1))


# -- store.batch_kv: a gathered copy otherwise -------------------------------------------------


def test_batch_kv_after_a_relocation_is_a_copy_and_right(store):
    seqs, k, v = filled(store, 3, 6, capacity=8)
    K0, _ = store.batch_kv(seqs, 0)
    assert shares_store(K0, seqs, 0) == [True] * 3
    k2, v2 = kv(np.random.default_rng(3), 3, 2, 4)
    seqs[1].extend(k2[1], v2[1])  # 10 tokens > capacity 8: row 1 moves to a larger range
    seqs[1].truncate(6)  # equal lengths again, row 1 elsewhere
    K, V = store.batch_kv(seqs, 0)
    np.testing.assert_array_equal(K, k[:, 0])
    np.testing.assert_array_equal(V, v[:, 0])
    assert shares_store(K, seqs, 0) == [False] * 3
    assert K.flags.writeable  # a fresh array
    # every row grown the same way: equal lengths, no longer equally spaced in general; always right
    for i in (0, 2):
        seqs[i].extend(k2[i], v2[i])
    seqs[1].extend(k2[1], v2[1])
    K, V = store.batch_kv(seqs, 1)
    np.testing.assert_array_equal(K, np.concatenate([k[:, 1], k2[:, 1]], 1))
    np.testing.assert_array_equal(V, np.concatenate([v[:, 1], v2[:, 1]], 1))


def test_batch_kv_out_of_order_rows_are_gathered(store):
    seqs, k, v = filled(store, 3, 4)
    order = [2, 0, 1]
    K, V = store.batch_kv([seqs[i] for i in order], 0)
    np.testing.assert_array_equal(K, k[order, 0])
    np.testing.assert_array_equal(V, v[order, 0])
    assert shares_store(K, seqs, 0) == [False] * 3
    K, _ = store.batch_kv([seqs[2]], 1)  # one row: always a view
    np.testing.assert_array_equal(K, k[2:, 1])
    assert shares_store(K, seqs, 1) == [False, False, True]


def test_batch_kv_refuses_unequal_lengths_and_foreign_handles(store, make_store):
    seqs, _, _ = filled(store, 2, 4)
    seqs[1].truncate(3)
    with pytest.raises(shmkv.InvalidArgumentError, match="equal lengths"):
        store.batch_kv(seqs, 0)
    with pytest.raises(shmkv.InvalidArgumentError, match="empty"):
        store.batch_kv([], 0)
    with pytest.raises(shmkv.InvalidArgumentError, match="layer=2"):
        store.batch_kv(seqs[:1], 2)
    other = make_store()
    with pytest.raises(shmkv.InvalidArgumentError, match="another attachment"):
        other.batch_kv(seqs, 0)
    seqs[0].truncate(0)
    seqs[1].truncate(0)
    K, V = store.batch_kv(seqs, 0)
    assert K.shape == V.shape == (2, 0, H, D)


def test_batch_kv_on_a_readonly_attachment(store):
    seqs, k, _ = filled(store, 2, 3)
    ro = shmkv.attach(store.name, readonly=True)
    try:
        handles = [ro.sequence(s.id) for s in seqs]
        K, _ = ro.batch_kv(handles, 1)
        np.testing.assert_array_equal(K, k[:, 1])
        assert not K.flags.writeable and np.shares_memory(K, handles[1].keys(1))
        with pytest.raises(shmkv.ReadOnlyError):
            ro.batch_kv(handles, 1, writable=True)
    finally:
        ro.close()


# -- storage dtypes and layer kinds -------------------------------------------------------------


def test_batch_kv_bfloat16_decodes_and_stays_zero_copy(make_store):
    store = make_store(dtype="bfloat16")
    seqs, k, v = filled(store, 3, 5)
    for layer in range(2):
        K, V = store.batch_kv(seqs, layer)
        for i, s in enumerate(seqs):
            np.testing.assert_array_equal(np.asarray(K[i], np.float32), np.asarray(s.keys(layer), np.float32))
            np.testing.assert_array_equal(np.asarray(V[i], np.float32), np.asarray(s.values(layer), np.float32))
        # bfloat16 keeps 8 significant bits: relative error <= 2^-8 (round to nearest even)
        np.testing.assert_allclose(np.asarray(K, np.float32), k[:, layer], rtol=2.0**-8, atol=0)
        np.testing.assert_allclose(np.asarray(V, np.float32), v[:, layer], rtol=2.0**-8, atol=0)
        if _quant.BF16 is not None:  # ml_dtypes: views of the stored bits
            assert K.dtype == _quant.BF16
            assert shares_store(K, seqs, layer) == [True] * 3
    if _quant.BF16 is not None:
        Kw, _ = store.batch_kv(seqs, 0, writable=True)
        Kw[2, 4] = 1.5  # exactly representable in bfloat16
        assert float(np.asarray(seqs[2].keys(0), np.float32)[4, 0, 0]) == 1.5


def test_batch_kv_int8_is_a_dequantized_copy(make_store):
    store = make_store(dtype="int8")
    seqs, k, v = filled(store, 3, 5)
    for layer in range(2):
        K, V = store.batch_kv(seqs, layer, writable=True)
        assert K.dtype == np.float32 and K.flags.writeable
        assert shares_store(K, seqs, layer) == [False] * 3
        for i, s in enumerate(seqs):
            np.testing.assert_array_equal(K[i], s.keys(layer))
            np.testing.assert_array_equal(V[i], s.values(layer))
        # absmax per (token, head) / 254 (+ float32 rounding)
        for got, ref in ((K, k[:, layer]), (V, v[:, layer])):
            bound = np.abs(ref).max(-1, keepdims=True) / 254 * (1 + 1e-6) + 1e-12
            assert (np.abs(got - ref) <= bound).all()


def test_batch_kv_sliding_layers(make_store):
    """A sliding layer's tokens sit in per-slot window buffers: rows made together, written
    alike, sit equally spaced there too (a view); an out-of-order batch is a copy. Values
    always equal per-sequence reads of what each layer holds."""
    store = make_store(layer_types=["full", "sliding"], window=4, memory=4)
    seqs = store.create_sequences(3, 16)
    rng = np.random.default_rng(5)
    k, v = kv(rng, 3, 2, 11)
    for step in range(0, 11, 2):  # several commits: the window buffer compacts on the way
        for s, kr, vr in zip(seqs, k, v, strict=True):
            s.extend(kr[:, step:step + 2], vr[:, step:step + 2], in_steps=True)
    for layer in (0, 1):
        K, V = store.batch_kv(seqs, layer)
        held = len(seqs[0].held_positions(layer))
        assert K.shape == (3, held, H, D)
        np.testing.assert_array_equal(K, k[:, layer, 11 - held:])
        np.testing.assert_array_equal(V, v[:, layer, 11 - held:])
        assert shares_store(K, seqs, layer) == [True] * 3
        Kr, _ = store.batch_kv(seqs[::-1], layer)
        np.testing.assert_array_equal(Kr, k[::-1, layer, 11 - held:])
        assert shares_store(Kr, seqs, layer) == [False] * 3
