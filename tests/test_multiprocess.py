"""Several processes on one store."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from procs.store_ops import (
    attach_and_exit,
    hold_lease,
    reader_loop,
    token_kv,
    value,
    write_sequence,
    write_through_readonly_mapping,
    writer_loop,
)
from conftest import START_METHODS

import shmkv
from shmkv.testing import ChildFailed, run_in_process, start_in_process


@pytest.mark.parametrize("method,dtype", [(m, "float32") for m in START_METHODS]
                         + [("spawn", "bfloat16"), ("fork", "int8")])  # values exceed float16
def test_child_writes_parent_reads(make_store, method, dtype):
    store = make_store(layers=3, kv_heads=2, head_dim=4, dtype=dtype)
    seq_id = run_in_process(write_sequence, store.name, 11, start_method=method, timeout=60)
    seq = store.sequence(seq_id)
    assert seq.length == 11
    assert seq.tokens.tolist() == [1000 + p for p in range(11)]
    assert seq.positions.tolist() == list(range(11))
    for layer in range(3):
        k, v = seq.kv(layer)
        for pos in range(11):
            want_k, want_v = token_kv(seq_id, layer, pos, 2, 4)
            if dtype == "float32":
                np.testing.assert_array_equal(k[pos], want_k)
                np.testing.assert_array_equal(v[pos], want_v)
            else:  # constant rows: int8 within absmax/254, 16-bit within 2^-8 relative
                np.testing.assert_allclose(np.asarray(k[pos], np.float64), want_k, rtol=2.0**-8)
                np.testing.assert_allclose(np.asarray(v[pos], np.float64), want_v, rtol=2.0**-8)
    assert seq.lease_pid == 0  # the child released it


@pytest.mark.parametrize("method", START_METHODS)
def test_two_writers_and_a_reader(make_store, method):
    # Small capacities force moves while the reader reads; stalls between layers
    # leave pending cells beyond the published length.
    store = make_store(layers=3, kv_heads=2, head_dim=4, max_tokens=4096, max_seqs=4)
    a = store.create_sequence(capacity=8)
    b = store.create_sequence(capacity=8)
    ids = [a.id, b.id]
    a.release()
    b.release()
    n = 400
    reader = start_in_process(reader_loop, store.name, ids, n, 120.0, start_method=method, timeout=150)
    writers = [start_in_process(writer_loop, store.name, i, n, 7, start_method=method, timeout=150) for i in ids]
    assert [w.result() for w in writers] == [n, n]
    seen = reader.result()
    assert seen["reads"] > 0
    for i in ids:
        s = store.sequence(i)
        assert s.length == n
        assert s.positions.tolist() == list(range(n))


def test_lease_conflict_then_takeover_after_sigkill(store, tmp_path):
    seq = store.create_sequence(capacity=8)
    seq.extend(np.full((2, 3, 2, 4), 5.0), np.full((2, 3, 2, 4), 6.0), tokens=[1, 2, 3])
    seq.release()
    ready = tmp_path / "ready"
    child = start_in_process(hold_lease, store.name, seq.id, str(ready), start_method="spawn", timeout=60)
    try:
        t_end = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < t_end, "child never took the lease"
            time.sleep(0.01)
        with pytest.raises(shmkv.LeaseError, match=str(child.pid)):
            store.sequence(seq.id, write=True)
        with pytest.raises(shmkv.LeaseError):
            store.copy_prefix(store.create_sequence(capacity=2).id, seq.id, 0)
    finally:
        child.kill(signal.SIGKILL)
    with pytest.raises(ChildFailed, match="signal 9"):
        child.result()
    w = store.sequence(seq.id, write=True)  # the holder is dead: take over
    assert w.length == 4  # the child's committed token survived, its pending one did not
    np.testing.assert_array_equal(w.keys(0)[:3], np.full((3, 2, 4), 5.0))
    np.testing.assert_array_equal(w.keys(1)[3], token_kv(seq.id, 1, 3, 2, 4)[0])
    assert w.tokens.tolist()[:3] == [1, 2, 3]
    for layer in range(2):
        w.append(layer, np.zeros((2, 4)), np.zeros((2, 4)))
    assert w.commit() == 5
    np.testing.assert_array_equal(w.keys(0)[4], np.zeros((2, 4)))


def test_second_handle_in_same_process_conflicts(store):
    seq = store.create_sequence()
    with pytest.raises(shmkv.LeaseError, match="another handle"):
        store.sequence(seq.id, write=True)
    seq.release()
    w = store.sequence(seq.id, write=True)
    assert w.writable and not seq.writable
    with pytest.raises(shmkv.ReadOnlyError):
        seq.append(0, np.zeros((2, 4)), np.zeros((2, 4)))
    del w  # dropped without release(): the lease is given back
    import gc

    gc.collect()
    assert store.sequence(seq.id, write=True).writable


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "close", "kill"])
def test_attaching_process_exit_leaves_store_usable(store, how):
    seq = store.create_sequence(capacity=8)
    seq.extend(np.ones((2, 2, 2, 4)), np.ones((2, 2, 2, 4)))
    child = start_in_process(attach_and_exit, store.name, how, start_method="spawn", timeout=60)
    if how == "kill":
        with pytest.raises(ChildFailed):
            child.result()
    else:
        child.result()
    again = shmkv.attach(store.name)
    assert again.sequence(seq.id).length == 2
    seq.extend(np.zeros((2, 1, 2, 4)), np.zeros((2, 1, 2, 4)))
    assert again.sequence(seq.id).length == 3
    assert os.getpid() in again.clients()
    again.close()


def test_views_are_zero_copy(store):
    """The README's claim: append, keys, values and kv hand out the shared memory itself."""
    seq = store.create_sequence(capacity=8)
    k, v = seq.append(0, np.ones((2, 4)), np.ones((2, 4)))
    assert np.shares_memory(k, store._engine.K) and np.shares_memory(v, store._engine.V)
    seq.append(1, np.ones((2, 4)), np.ones((2, 4)))
    seq.commit()
    for view in (seq.keys(0), seq.values(1), *seq.kv(1)):
        assert view.base is not None and not view.flags.owndata
        assert np.shares_memory(view, store._engine.K) or np.shares_memory(view, store._engine.V)
    ro = shmkv.attach(store.name, readonly=True)
    try:
        assert np.shares_memory(ro.sequence(seq.id).keys(0), ro._engine.K)  # another mapping, no copy
    finally:
        ro.close()


def test_readonly_attach(store):
    seq = store.create_sequence(capacity=8)
    seq.extend(np.ones((2, 2, 2, 4)), np.ones((2, 2, 2, 4)))
    ro = shmkv.attach(store.name, readonly=True)
    try:
        r = ro.sequence(seq.id)
        k, v = r.kv(0)
        assert not k.flags.writeable and not v.flags.writeable
        with pytest.raises(ValueError):
            k.flags.writeable = True  # the mapping itself is read-only
        with pytest.raises(ValueError):
            k[0] = 0
        with pytest.raises(shmkv.ReadOnlyError):
            ro.create_sequence()
        with pytest.raises(shmkv.ReadOnlyError):
            ro.sequence(seq.id, write=True)
        with pytest.raises(shmkv.ReadOnlyError):
            ro.copy_prefix(seq.id, seq.id + 1, 1)
        for call in (lambda: r.append(0, np.zeros((2, 4)), np.zeros((2, 4))), r.commit,
                     lambda: r.truncate(0), r.clear, lambda: r.shift_left(1), lambda: r.remove(0, 1),
                     r.free, r.fork):
            with pytest.raises(shmkv.ReadOnlyError):
                call()
        assert r.length == 2  # nothing changed
        assert ro.stats().tokens == 2
    finally:
        ro.close()


def test_writing_through_readonly_mapping_faults(store):
    seq = store.create_sequence(capacity=8)
    seq.extend(np.ones((2, 2, 2, 4)), np.ones((2, 2, 2, 4)))
    with pytest.raises(ChildFailed, match=f"signal {int(signal.SIGSEGV)}"):
        run_in_process(write_through_readonly_mapping, store.name, start_method="spawn", timeout=60)
    np.testing.assert_array_equal(seq.keys(0), np.ones((2, 2, 4)))


def test_value_function_is_exact_in_float32():
    # the concurrency test relies on exact equality
    v = value(3, 2, 399, 1)
    assert np.float32(v) == v
