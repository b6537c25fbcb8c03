"""Running out of room."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shmkv
from shmkv._sequence.room import make_room


def test_filling_the_store_keeps_committed_tokens(make_store):
    store = make_store(layers=2, kv_heads=1, head_dim=2, max_tokens=40, max_seqs=4)
    a = store.create_sequence(capacity=10)
    b = store.create_sequence(capacity=10)
    for i in range(10):
        b.extend(np.full((2, 1, 1, 2), -i), np.full((2, 1, 1, 2), -i))
    written = 0
    with pytest.raises(shmkv.CacheFullError, match="max_tokens=40") as info:
        while True:
            a.extend(np.full((2, 1, 1, 2), written), np.full((2, 1, 1, 2), written))
            written += 1
    assert isinstance(info.value, MemoryError)
    # a moved from [0, 10) to the free [20, 40) and cannot grow further: no room
    # after it, and [0, 10) is too small (no compaction: it would move other writers' cells)
    assert a.length == written == 20
    np.testing.assert_array_equal(a.keys(1)[:, 0, 0], np.arange(written))
    np.testing.assert_array_equal(b.keys(0)[:, 0, 0], -np.arange(10))
    # the failed extend left nothing pending; after freeing room, writing goes on
    assert a.pending == 0
    b.free()
    a.extend(np.full((2, 1, 1, 2), 99), np.full((2, 1, 1, 2), 99))
    np.testing.assert_array_equal(a.keys(0)[:, 0, 0], [*range(20), 99])


def test_sequence_slots_run_out(make_store):
    store = make_store(max_seqs=2)
    store.create_sequence(capacity=1)
    store.create_sequence(capacity=1)
    with pytest.raises(shmkv.CacheFullError, match="max_seqs=2"):
        store.create_sequence(capacity=1)


def test_capacity_larger_than_store(store):
    with pytest.raises(shmkv.CacheFullError, match="max_tokens"):
        store.create_sequence(capacity=store.layout.max_tokens + 1)


def test_store_larger_than_dev_shm_fails_cleanly_when_written(make_store):
    st = os.statvfs("/dev/shm")
    shm_size = st.f_blocks * st.f_frsize
    # a store whose arena is twice the size of /dev/shm: creating it is fine
    # (pages are not allocated), and so are capacities larger than /dev/shm (a range's pages are
    # allocated as its writes need them); allocating more pages than /dev/shm holds is not
    per_token = 2 * 1 * 8 * 128 * 2  # K and V of 1 layer, 8 heads, 128 dims, float16
    max_tokens = 2 * shm_size // per_token
    store = make_store(layers=1, kv_heads=8, head_dim=128, dtype="float16", max_tokens=max_tokens, max_seqs=2)
    seq = store.create_sequence(capacity=16)
    seq.extend(np.ones((1, 16, 8, 128)), np.ones((1, 16, 8, 128)))
    seq._w.grow(max_tokens - 200)  # the growth an append triggers: cells, not pages
    assert seq.capacity == max_tokens - 200
    with pytest.raises(shmkv.CacheFullError, match="/dev/shm"):
        # the room an append of that many tokens makes first (the append itself would need
        # the memory in this process): ENOSPC from posix_fallocate, no SIGBUS
        make_room(seq._w, max_tokens - 200)
    other = store.create_sequence(capacity=100)  # its pages: none yet
    assert seq.length == 16
    np.testing.assert_array_equal(seq.keys(0), np.ones((16, 8, 128)))
    for s in (seq, other):  # both append after the failure
        s.append(0, np.full((8, 128), 2.0, np.float16), np.full((8, 128), 3.0, np.float16))
        s.commit()
    assert seq.length == 17 and other.length == 1
    np.testing.assert_array_equal(seq.values(0)[16], np.full((8, 128), 3.0))


def test_reserved_intervals_merge():
    """The per-process record of reserved cells (Pages.reserve skips what it covers)."""
    from shmkv._engine.memory.pages import add_interval as _add_interval

    spans: list[tuple[int, int]] = []
    for a, b in [(10, 20), (30, 40), (20, 30), (0, 5), (5, 8), (50, 60), (45, 55), (100, 110)]:
        _add_interval(spans, a, b)
    assert spans == [(0, 8), (10, 40), (45, 60), (100, 110)]
    _add_interval(spans, 0, 200)
    assert spans == [(0, 200)]
