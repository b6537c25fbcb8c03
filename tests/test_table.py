"""The sequence table: id -> row in O(1) for every process. A created sequence lives
in row id % max_seqs (its id is chosen so); ids only grow and are never reused."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv._engine.table.header import ID, LIVE, STATE


def _row_of(store: shmkv.Store, seq_id: int) -> int:
    t = store._engine.table_np
    rows = np.flatnonzero((t[:, ID] == seq_id) & (t[:, STATE] == LIVE))
    assert rows.size == 1
    return int(rows[0])


def test_id_lookup_after_thousands_of_create_free_cycles(make_store):
    store = make_store(layers=1, kv_heads=1, head_dim=2, max_tokens=256, max_seqs=8)
    other = shmkv.attach(store.name)  # no hints: it finds rows from the ids alone
    try:
        rng = np.random.default_rng(0)
        live: dict[int, int] = {}  # id -> its one token's value
        freed: list[int] = []
        last = 0
        for step in range(3000):
            if len(live) < 7 and (not live or rng.random() < 0.55):
                seq = store.create_sequence(capacity=int(rng.integers(1, 4)))
                assert seq.id > last  # ids only grow
                last = seq.id
                seq.extend(np.full((1, 1, 1, 2), step), np.full((1, 1, 1, 2), -step))
                seq.release()
                live[seq.id] = step
                assert _row_of(store, seq.id) == seq.id % 8
            else:
                gone = int(rng.choice(list(live)))
                store.sequence(gone, write=True).free()
                del live[gone]
                freed.append(gone)
            if step % 100 == 0:
                for sid, val in live.items():
                    for st in (store, other):
                        assert st.sequence(sid).keys(0)[0, 0, 0] == val
                for sid in freed[-20:]:
                    with pytest.raises(shmkv.SequenceNotFound):
                        other.sequence(sid)
        assert sorted(i.id for i in other.sequences()) == sorted(live)
    finally:
        other.close()


def test_restored_ids_are_found_whatever_their_row(make_store, tmp_path):
    """A restore keeps a snapshot's ids: a sequence gets its id's own row when that row is free,
    another row otherwise (then a lookup scans once); every process finds it."""
    src = make_store(layers=1, kv_heads=1, head_dim=2, max_tokens=64, max_seqs=4)
    ids = []
    for i in range(3):
        s = src.create_sequence(capacity=2)
        s.extend(np.full((1, 1, 1, 2), i), np.full((1, 1, 1, 2), i))
        ids.append(s.id)
        s.release()
    path = tmp_path / "t.shmkv"
    src.save(path)
    dst = make_store(layers=1, kv_heads=1, head_dim=2, max_tokens=64, max_seqs=4)
    for _ in range(4):
        dst.create_sequence(capacity=1).free()
    blocker = dst.create_sequence(capacity=1)  # takes the row one of the snapshot's ids wants
    assert blocker.id % 4 == ids[0] % 4 and blocker.id not in ids
    assert dst.restore(path) == ids
    fresh = shmkv.attach(dst.name, readonly=True)
    try:
        for i, sid in enumerate(ids):
            assert fresh.sequence(sid).keys(0)[0, 0, 0] == i
        assert fresh.sequence(blocker.id).length == 0
        assert _row_of(dst, ids[0]) != ids[0] % 4 and _row_of(dst, ids[1]) == ids[1] % 4
    finally:
        fresh.close()
    blocker.free()
    assert dst.create_sequence(capacity=1).id > max(ids)  # restored ids are not handed out again
