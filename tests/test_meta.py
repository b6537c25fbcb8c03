"""Per-sequence metadata: seq.meta, across processes and snapshots."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv.testing import run_in_process


def read_meta(name: str, seq_id: int) -> dict:
    store = shmkv.attach(name, readonly=True)
    try:
        return store.sequence(seq_id).meta
    finally:
        store.close()


def write_meta(name: str, seq_id: int, meta: dict) -> None:
    store = shmkv.attach(name)
    try:
        seq = store.sequence(seq_id, write=True)
        seq.meta = meta
        seq.release()
    finally:
        store.close()


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_meta_set_in_one_process_is_read_in_another(store, start_method):
    seq = store.create_sequence(capacity=8)
    assert seq.meta == {}
    seq.meta = {"request": "r-17", "user": 42, "tags": ["a", "b"]}
    seq.extend(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)))
    got = run_in_process(read_meta, store.name, seq.id, start_method=start_method, timeout=60)
    assert got == {"request": "r-17", "user": 42, "tags": ["a", "b"]}
    seq.release()
    run_in_process(write_meta, store.name, seq.id, {"request": "r-18"}, start_method=start_method, timeout=60)
    assert store.sequence(seq.id).meta == {"request": "r-18"}


def test_meta_survives_a_snapshot_and_is_per_sequence(store, make_store, tmp_path):
    a = store.create_sequence(capacity=8)
    b = store.create_sequence(capacity=8)
    a.meta = {"request": "a"}
    b.extend(np.ones((2, 2, 2, 4)), np.ones((2, 2, 2, 4)))
    store.save(tmp_path / "m.shmkv")
    other = make_store()
    other.restore(tmp_path / "m.shmkv")
    assert other.sequence(a.id).meta == {"request": "a"}
    assert other.sequence(b.id).meta == {}
    assert a.fork().meta == {}  # a fork is a new request
    a.free()
    c = store.create_sequence(capacity=8)  # the freed row's metadata does not leak into a new sequence
    assert c.meta == {}


def test_meta_errors_change_nothing(store):
    seq = store.create_sequence(capacity=8)
    seq.meta = {"keep": 1}
    for bad, match in [({"x": "y" * 600}, "600|bytes"), ({"f": object()}, "cannot be packed"), ([1, 2], "dict")]:
        with pytest.raises(shmkv.InvalidArgumentError, match=match):
            seq.meta = bad
        assert seq.meta == {"keep": 1}
    seq.release()
    with pytest.raises(shmkv.ReadOnlyError):
        seq.meta = {"nope": 1}
    assert store.sequence(seq.id).meta == {"keep": 1}
