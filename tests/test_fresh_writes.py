"""Fresh ranges written through the data segment's descriptor: a prefill, a move
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


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("given", [np.float64, np.float32, np.int32])
def test_prefill_through_the_descriptor_equals_numpy(make_store, monkeypatch, dtype, given):
    store = make_store(layers=3, kv_heads=2, head_dim=8, dtype=dtype, max_tokens=4096, max_seqs=4)
    rng = np.random.default_rng(7)
    k, v = _kv(rng, 3, 1500, given)
    if given is np.int32:
        k, v = (rng.integers(-100, 100, k.shape).astype(np.int32) for _ in range(2))
    seq = store.create_sequence(capacity=2000)
    writes = _Calls(monkeypatch, "pwrite")
    assert seq.extend(k, v, tokens=np.arange(1500)) == 1500
    assert writes.calls >= 6  # K and V of 3 layers went through the descriptor
    # then appends into the rest of the range (pre-faulted by the prefill), through the mapping
    k2, v2 = _kv(rng, 3, 10)
    before = writes.calls
    for t in range(10):
        for layer in range(3):
            seq.append(layer, k2[layer, t], v2[layer, t])
        seq.commit(tokens=[1500 + t])
    assert writes.calls == before
    dt = np.dtype(dtype)
    want_k = np.concatenate([k.astype(dt), k2.astype(dt)], axis=1)
    want_v = np.concatenate([v.astype(dt), v2.astype(dt)], axis=1)
    got_k, got_v = _stored(store.sequence(seq.id))
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    assert seq.tokens.tolist() == list(range(1510))
    assert seq.positions.tolist() == list(range(1510))
    # a second extend writes cells the prefill pre-faulted: through the mapping, the same result
    k3, v3 = _kv(rng, 3, 5)
    seq.extend(k3, v3)
    np.testing.assert_array_equal(_stored(seq)[0][:, 1510:], k3.astype(dt))


def test_full_dev_shm_during_a_prefill_is_cache_full(make_store, monkeypatch):
    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=2048, max_seqs=4)
    rng = np.random.default_rng(8)
    other = store.create_sequence(capacity=10)
    ko, vo = _kv(rng, 2, 10)
    other.extend(ko, vo)
    seq = store.create_sequence(capacity=1000)
    k, v = _kv(rng, 2, 900)
    writes = _Calls(monkeypatch, "pwrite", fail_at=3)  # K of both layers written, then /dev/shm is full
    with pytest.raises(shmkv.CacheFullError, match="/dev/shm") as info:
        seq.extend(k, v)
    assert isinstance(info.value, MemoryError)
    assert writes.calls == 3
    # nothing published, nothing pending; the other sequence untouched
    assert seq.length == 0 and seq.pending == 0 and len(store.sequence(seq.id)) == 0
    np.testing.assert_array_equal(_stored(other)[0], ko.astype(np.float32))
    # room again: the same handle writes, and the store goes on
    writes.fail_at = 0
    seq.extend(k, v)
    got_k, got_v = _stored(seq)
    np.testing.assert_array_equal(got_k, k.astype(np.float32))
    np.testing.assert_array_equal(got_v, v.astype(np.float32))
    third = store.create_sequence(capacity=16)
    third.extend(*_kv(rng, 2, 16))
    assert len(third) == 16


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


def test_load_from_a_path_that_is_a_pipe(make_store, tmp_path):
    """A named pipe is a path but not a regular file: its arrays are read, not copied by the kernel."""
    import threading

    store = make_store(layers=2, kv_heads=4, head_dim=512, dtype="float16", max_tokens=512, max_seqs=8)
    _fill(store, np.random.default_rng(14))
    path = tmp_path / "fifo"
    os.mkfifo(path)

    def save() -> None:
        with open(path, "wb") as f:
            store.save(f)

    t = threading.Thread(target=save)
    t.start()
    loaded = shmkv.load(path, name=unique_name())
    t.join(timeout=60)
    try:
        assert _content(loaded) == _content(store)
    finally:
        loaded.close()


def test_a_fork_pre_faults_its_range_before_the_per_token_path(make_store):
    """A new range is allocated, not pre-faulted; a sequence's first append pre-faults it on the
    checked path. A fork's child takes its first append on the fast path: the fork pre-faults it
    (else the child's appends would fault page by page)."""
    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float16", max_tokens=4096, max_seqs=4)
    rng = np.random.default_rng(12)
    parent = store.create_sequence(capacity=64)
    k, v = _kv(rng, 2, 40)
    parent.extend(k, v)
    child = parent.fork(capacity=2048)
    info = next(i for i in store.sequences() if i.id == child.id)
    assert not store._engine.any_owed(info.start, info.capacity)  # every page of its range is in place
    k1, v1 = _kv(rng, 2, 1)
    for layer in range(2):
        child.append(layer, k1[layer], v1[layer])
    child.commit()
    np.testing.assert_array_equal(_stored(child)[0], np.concatenate([k, k1], axis=1).astype(np.float16))


def test_a_load_opens_one_descriptor_for_its_copies_and_closes_it(make_store, tmp_path, monkeypatch):
    """The kernel copies of a restore write through a descriptor of the segment's own: one for
    all the arrays (not one per array), closed with the store."""
    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float16", max_tokens=512, max_seqs=16)
    _fill(store, np.random.default_rng(13), n_seqs=6)
    path = tmp_path / "s.shmkv"
    store.save(path)
    opened: list[int] = []
    real_open = os.open

    def spy(p: object, *args: object, **kw: object) -> int:
        fd = real_open(p, *args, **kw)  # type: ignore[arg-type]
        if str(p).startswith("/proc/self/fd/"):
            opened.append(fd)
        return fd

    monkeypatch.setattr(os, "open", spy)
    copies = _Calls(monkeypatch, "sendfile")
    loaded = shmkv.load(path, name=unique_name())
    try:
        assert copies.calls > 1 and len(opened) == 1  # many kernel copies, one descriptor
        target = os.readlink(f"/proc/self/fd/{opened[0]}")
        assert target.endswith(".d")  # the data segment
        assert _content(loaded) == _content(store)
    finally:
        loaded.close()
    try:
        assert os.readlink(f"/proc/self/fd/{opened[0]}") != target  # closed (or the number reused)
    except FileNotFoundError:
        pass
