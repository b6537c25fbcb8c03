"""``shmkv verify`` (``cli.verify``) reads the table and the header through the engine's typed
accessors (``Rows.table_rows``, ``undo_log``, ``next_id``): each invariant it checks is reported
when the words break it, and a store as the API leaves it has none."""

from __future__ import annotations

import numpy as np

from shmkv import cli
from shmkv._engine.header import ENC_SLOT, GEN, ID, START, STATE, W_NEXT_ID, W_UNDO_COUNT, W_UNDO_PID
from shmkv.store._store import engine_of


def test_each_broken_word_is_reported_and_the_rest_is_not(make_store) -> None:
    store = make_store()
    a = store.create_sequence(capacity=8)
    b = store.create_sequence(capacity=8)
    a.set_encoder(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)))
    assert cli.verify(store) == []
    e = engine_of(store)

    gen = a._row[GEN]
    a._row[GEN] = gen + 1
    assert cli.verify(store) == [f"sequence {a.id}: generation {gen + 1} is odd (a structural change is "
                                 "running or died)"]
    a._row[GEN] = gen

    b._row[ID] = a.id
    problems = cli.verify(store)
    assert problems == ["sequence ids repeat"], problems
    b._row[ID] = b.id

    next_id = e.hdr[W_NEXT_ID]
    b._row[ID] = next_id
    assert cli.verify(store) == [f"sequence {next_id}: id not below next id {next_id}"]
    b._row[ID] = b.id

    enc = a._row[ENC_SLOT] - 1  # the encoder cache's own row: its range must not overlap a sequence's
    enc_start = e.table_np[enc, START]
    e.table_np[enc, START] = b._row[START] + 2
    problems = cli.verify(store)
    assert len(problems) == 1 and problems[0].endswith(f"overlap at cell {b._row[START] + 2}"), problems
    assert f"encoder of {e.table_np[enc, ID]}" in problems[0] and f"sequence {b.id}" in problems[0]
    e.table_np[enc, START] = enc_start

    free = [slot for slot in range(store.layout.max_seqs) if e.table_np[slot, STATE] == 0]
    e.table_np[free[0], STATE] = 7
    assert cli.verify(store) == ["a sequence slot has an unknown state"]
    e.table_np[free[0], STATE] = 0

    e.hdr[W_UNDO_PID], e.hdr[W_UNDO_COUNT] = 4242, 2  # (read only: verify takes no lock)
    try:
        problems = cli.verify(store)
    finally:
        e.hdr[W_UNDO_COUNT], e.hdr[W_UNDO_PID] = 0, 0
    assert len(problems) == 1 and problems[0].startswith("a structural operation of pid 4242 left 2 row(s)")
    assert cli.verify(store) == []
