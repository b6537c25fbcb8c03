"""``shmkv verify`` (``cli.verify``) reads the table and the header through the engine's typed
accessors (``Rows.table_rows``: the rows and their span words from one copy; ``undo_log``,
``next_id``): each invariant it checks is reported when the words break it, and a store as the
API leaves it has none."""

from __future__ import annotations

import numpy as np
import pytest

from shmkv import cli
from shmkv._engine.table.header import ENC_SLOT, GEN, ID, START, STATE, W_NEXT_ID, W_UNDO_COUNT, W_UNDO_PID
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


@pytest.mark.parametrize("dtype", ["float32", "int8"])  # a page unit of 1 cell, and of 32
def test_each_broken_span_word_is_reported(make_store, dtype) -> None:
    """The shared pages' words (``_engine/table/audit.py``): a borrower's span and its donor's flag."""
    from shmkv._engine.table import header as h

    store = make_store(layers=2, kv_heads=32, head_dim=32, dtype=dtype, max_tokens=1024, max_seqs=8)
    prompt = list(range(1, 41))
    k = np.ones((2, 40, 32, 32), np.float32)
    donor = store.create_sequence(capacity=64, prefix=prompt)
    donor.extend(k, -k, tokens=prompt)
    donor.finish()
    borrower = store.create_sequence(capacity=64, prefix=[*prompt[:32], 7])
    other = store.create_sequence(capacity=16)
    e = engine_of(store)
    unit = e.page_unit
    d, b, o = e.row(e.slot_of(donor.id)), e.row(e.slot_of(borrower.id)), e.row(e.slot_of(other.id))
    assert unit == (1 if dtype == "float32" else 32), unit
    assert b[h.SPAN_CELLS] >= unit and b[h.SPAN_PHYS] == d[h.START] and d[h.FLAGS] & h.LENT, "no span to break"
    assert cli.verify(store) == []

    def reported(row, word, value, expect):
        was = row[word]
        row[word] = value
        try:
            problems = cli.verify(store)
            assert any(expect in p for p in problems), problems
        finally:
            row[word] = was
        assert cli.verify(store) == []

    reported(d, h.FLAGS, d[h.FLAGS] & ~h.LENT, f"sequence {donor.id} lends cells")
    reported(b, h.SPAN_TAKEN, b[h.SPAN_CELLS] - 1, "not whole page units")
    if unit > 1:  # (int8)
        reported(b, h.SPAN_TAKEN, b[h.SPAN_TAKEN] + 1, "not whole page units")
    reported(b, h.LENGTH, b[h.SPAN_CELLS] - 1, f"holds {b[h.SPAN_CELLS] - 1} tokens")
    reported(b, h.SPAN_PHYS, o[h.START] + 1, f"overlap the range [{o[h.START]}, {o[h.START] + o[h.CAPACITY]})")
    reported(b, h.SPAN_PHYS, o[h.START], f"sequence {other.id} lends cells")  # (taken for its owner)
    reported(b, h.SPAN_PHYS, b[h.START], "inside its own range")
    reported(b, h.SPAN_PHYS, e.cells - 1, "outside the arena")
    reported(b, h.SPAN_TAKEN, d[h.CAPACITY] + unit, "run past its owner")
    words = [b[w] for w in (h.SPAN_PHYS, h.SPAN_CELLS, h.SPAN_TAKEN)]
    b[h.SPAN_PHYS], b[h.SPAN_CELLS], b[h.SPAN_TAKEN] = unit, 0, 0
    try:
        assert [p for p in cli.verify(store) if "with no cell taken" in p], cli.verify(store)
    finally:
        b[h.SPAN_PHYS], b[h.SPAN_CELLS], b[h.SPAN_TAKEN] = words
    spans = e.hdr[h.W_SPANS]
    e.hdr[h.W_SPANS] = spans | 1
    try:
        assert [p for p in cli.verify(store) if "span epoch" in p and "is odd" in p]
    finally:
        e.hdr[h.W_SPANS] = spans
