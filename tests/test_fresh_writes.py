"""Fresh ranges written through the data segment's descriptor (issue 16): a prefill, a move
into a new range, a load. The data must equal a numpy reference, and a full /dev/shm during
such a write (fault-injected: ENOSPC from os.pwrite / os.sendfile at the Nth call) must be a
clean CacheFullError with nothing half-published and the store still usable."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from test_snapshot import _content, _fill

import shmkv
from shmkv.testing import unique_name


class _Calls:
    """Counts the calls of an ``os`` function; from call ``fail_at`` on (1-based), raises
    OSError(``err``) instead, until ``fail_at`` is set back to 0."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, fail_at: int = 0, err: int = errno.ENOSPC):
        self.calls, self.fail_at, self.err = 0, fail_at, err
        real = getattr(os, name)

        def spy(*args: object) -> object:
            self.calls += 1
            if self.fail_at and self.calls >= self.fail_at:
                raise OSError(self.err, os.strerror(self.err))
            return real(*args)

        monkeypatch.setattr(os, name, spy)


def _kv(rng: np.random.Generator, layers: int, n: int, dtype: object = np.float64) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((layers, n, 2, 8)).astype(dtype),
            rng.standard_normal((layers, n, 2, 8)).astype(dtype))


def _stored(seq: shmkv.Sequence) -> tuple[np.ndarray, np.ndarray]:
    layers = range(seq.store.layout.layers)
    return np.stack([seq.keys(i) for i in layers]), np.stack([seq.values(i) for i in layers])


def test_a_move_into_a_new_range_writes_through_the_descriptor(make_store, monkeypatch):
    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float16", max_tokens=4096, max_seqs=4)
    rng = np.random.default_rng(9)
    a = store.create_sequence(capacity=100)
    store.create_sequence(capacity=10)  # right after a: a cannot grow in place
    k, v = _kv(rng, 2, 100)
    a.extend(k, v)
    start = store.sequences()[0].start
    writes = _Calls(monkeypatch, "pwrite")
    k2, v2 = _kv(rng, 2, 50)
    a.extend(k2, v2)  # past its capacity: moved to a fresh range
    info = next(i for i in store.sequences() if i.id == a.id)
    assert info.start != start and info.capacity >= 150
    assert writes.calls >= 4  # the 100 kept tokens of K and V of 2 layers, copied through the descriptor
    want = np.concatenate([k, k2], axis=1).astype(np.float16)
    np.testing.assert_array_equal(_stored(a)[0], want)
    np.testing.assert_array_equal(_stored(a)[1], np.concatenate([v, v2], axis=1).astype(np.float16))


def test_full_dev_shm_during_a_move_is_cache_full(make_store, monkeypatch):
    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=4096, max_seqs=4)
    rng = np.random.default_rng(10)
    a = store.create_sequence(capacity=100)
    store.create_sequence(capacity=10)
    k, v = _kv(rng, 2, 100)
    a.extend(k, v)
    before = next(i for i in store.sequences() if i.id == a.id)
    writes = _Calls(monkeypatch, "pwrite", fail_at=2)
    k2, v2 = _kv(rng, 2, 50)
    with pytest.raises(shmkv.CacheFullError, match="/dev/shm"):
        a.extend(k2, v2)
    after = next(i for i in store.sequences() if i.id == a.id)
    assert (after.start, after.capacity, after.length) == (before.start, before.capacity, 100)
    assert a.pending == 0
    np.testing.assert_array_equal(_stored(store.sequence(a.id))[0], k.astype(np.float32))
    writes.fail_at = 0
    a.extend(k2, v2)
    np.testing.assert_array_equal(_stored(a)[0], np.concatenate([k, k2], axis=1).astype(np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16", "int8"])
def test_load_through_the_descriptor_is_bit_identical(make_store, tmp_path, monkeypatch, dtype):
    # arrays of up to 30 x 4 x 512 values: most bytes are past what the header read buffers
    store = make_store(layers=3, kv_heads=4, head_dim=512, dtype=dtype, max_tokens=512, max_seqs=8)
    _fill(store, np.random.default_rng(11))
    before = _content(store)
    path = tmp_path / "s.shmkv"
    store.save(path)
    copies = _Calls(monkeypatch, "sendfile")
    loaded = shmkv.load(path, name=unique_name())
    try:
        assert copies.calls > 0
        assert _content(loaded) == before
        # the loaded sequences go on: appends after the loaded tokens
        info = max(loaded.sequences(), key=lambda i: i.length)
        w = loaded.sequence(info.id, write=True)
        w.extend(np.ones((3, 2, 4, 512)), np.ones((3, 2, 4, 512)))
        assert len(w) == info.length + 2
        np.testing.assert_array_equal(w.keys(1)[: info.length], store.sequence(info.id).keys(1))
    finally:
        loaded.close()


def test_load_without_sendfile_copies_through_a_buffer(make_store, tmp_path, monkeypatch):
    store = make_store(layers=2, kv_heads=4, head_dim=512, dtype="float16", max_tokens=512, max_seqs=8)
    _fill(store, np.random.default_rng(12))
    before = _content(store)
    path = tmp_path / "s.shmkv"
    store.save(path)
    _Calls(monkeypatch, "sendfile", fail_at=1, err=errno.EINVAL)  # no sendfile between these files
    loaded = shmkv.load(path, name=unique_name())
    try:
        assert _content(loaded) == before
    finally:
        loaded.close()


@pytest.mark.parametrize("call", ["sendfile", "pwrite"])
def test_full_dev_shm_during_a_load_is_cache_full(make_store, tmp_path, monkeypatch, call):
    store = make_store(layers=2, kv_heads=4, head_dim=512, dtype="float32", max_tokens=512, max_seqs=8)
    _fill(store, np.random.default_rng(13))
    before = _content(store)
    path = tmp_path / "s.shmkv"
    store.save(path)
    if call == "pwrite":  # the buffered copy, when the kernel has no sendfile for these files
        _Calls(monkeypatch, "sendfile", fail_at=1, err=errno.EINVAL)
    writes = _Calls(monkeypatch, call, fail_at=3)
    name = unique_name()
    with pytest.raises(shmkv.CacheFullError, match="/dev/shm"):
        shmkv.load(path, name=name)
    assert name not in shmkv.list_stores()  # the half-loaded store is gone
    # restore into a store that has these sequences: unchanged, all or nothing
    writes.calls = 0
    for info in store.sequences():
        w = store.sequence(info.id, write=True)
        w.truncate(max(0, info.length - 1))
        w.release()
    damaged = _content(store)
    with pytest.raises(shmkv.CacheFullError):
        store.restore(path)
    assert _content(store) == damaged
    writes.fail_at = 0
    assert store.restore(path) == sorted(before)
    assert _content(store) == before
