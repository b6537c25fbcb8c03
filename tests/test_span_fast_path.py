"""The no-span fast path of structural changes (issue 23's "truncate within 5% of before"):
a store in which no span ever existed (span epoch 0) skips the span checks of every row
change, and a process's own span changes keep its reservation record. Both must give exactly
what the span path gives."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv._engine.table import header as _header
from shmkv._engine.spans import mappings as share
from shmkv._engine.memory.intervals import covers
from shmkv.store._store import engine_of

L, H, D = 3, 4, 64


def _store(make_store):
    return make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=32)


def _start(store, seq_id):
    return next(s.start for s in store.sequences() if s.id == seq_id)


def _content(seq):
    return [(np.asarray(seq.keys(i)).tobytes(), np.asarray(seq.values(i)).tobytes()) for i in range(L)] + [
        seq.tokens.tobytes()]


def _kv(seed, n):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, n, H, D)), rng.standard_normal((L, n, H, D))


def _script(st):
    """The same operations on any store: a prompt donor, a reuse of it (a borrow when sharing
    is on), a plain sequence; speculative truncates, copy_prefix into an empty and into a full
    sequence, appends after each. Returns every sequence's content after each step."""
    prompt = np.arange(1000, 1300)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    k, v = _kv(1, 300)
    d.extend(k, v, tokens=prompt)
    d.finish()
    b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [7]])  # reuses 300 tokens
    plain = st.create_sequence(capacity=1024)
    k2, v2 = _kv(2, 200)
    plain.extend(k2, v2)
    seqs = [d, b, plain]
    out = [[_content(s) for s in seqs]]
    kk, vv = _kv(3, 1)
    for step in range(6):  # speculative decoding: append a draft token, roll it back, keep one
        for s in (b, plain):
            for layer in range(L):
                s.append(layer, kk[layer, 0], vv[layer, 0])
            s.commit()
            s.truncate(s.length - 1)
            for layer in range(L):
                s.append(layer, kk[layer, 0] + step, vv[layer, 0] - step)
            s.commit()
        out.append([_content(s) for s in seqs])
    b.truncate(100)  # into its span (with sharing: copy-on-write)
    plain.truncate(150)
    out.append([_content(s) for s in seqs])
    empty = st.create_sequence(capacity=1024)
    empty.release()
    st.copy_prefix(d.id, empty.id, 280)  # into an empty sequence (with sharing on a page unit: a borrow)
    st.copy_prefix(b.id, plain.id, 100)  # into a sequence that holds tokens
    seqs.append(st.sequence(empty.id, write=True))
    out.append([_content(s) for s in seqs])
    k3, v3 = _kv(4, 40)
    for s in seqs[1:]:
        s.extend(k3, v3)
    out.append([_content(s) for s in seqs])
    return out


def test_no_span_fast_path_and_span_path_give_the_same_results(make_store, monkeypatch):
    shared = _store(make_store)
    with_spans = _script(shared)
    assert shared.stats().shared_tokens > 0 and engine_of(shared).hdr[_header.W_SPANS] > 0
    monkeypatch.setattr(share, "ENABLED", False)
    plain = _store(make_store)
    without = _script(plain)
    assert plain.stats().shared_tokens == 0
    assert engine_of(plain).hdr[_header.W_SPANS] == 0  # no span ever: every change took the fast path
    assert with_spans == without


def test_the_first_borrow_of_a_store_still_settles(make_store):
    """The fast path is decided on the span epoch at each bracket: a row that starts borrowing
    or lending in the store's first span change is still settled afterwards (a donor truncated
    into the cells it lent moves, its borrower keeps the old bytes)."""
    st = _store(make_store)
    e = engine_of(st)
    assert e.hdr[_header.W_SPANS] == 0
    src = st.create_sequence(capacity=1024)
    k, v = _kv(5, 300)
    src.extend(k, v)
    src.finish()
    dst = st.create_sequence(capacity=1024)
    dst.release()
    before = _content(src)
    st.copy_prefix(src.id, dst.id, 300)  # the store's first span
    assert e.hdr[_header.W_SPANS] > 0 and st.stats().shared_tokens > 0
    start = _start(st, src.id)
    src = st.sequence(src.id, write=True)
    src.truncate(10)  # into what it lent: it moves, the borrower keeps its cells
    assert _start(st, src.id) != start
    k2, v2 = _kv(6, 290)
    src.extend(k2, v2)
    assert _content(dst) == before
    assert np.asarray(src.keys(0))[10:].tobytes() == k2[0].astype(np.float16).tobytes()


def test_own_span_changes_keep_the_reservation_record(make_store):
    """A process's own borrow punches only the borrower's pages, and takes exactly those out of
    its reservation record (Shares.punch): the rest of the record stays (no fallocate again of
    every range it reserved, e.g. a copy_prefix's fresh range after a borrow). A span change by
    another attachment drops the record (its punches are not known here:
    tests/test_share_edges.py::test_01...)."""
    st = _store(make_store)
    e = engine_of(st)
    prompt = np.arange(500, 800)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    k, v = _kv(7, 300)
    d.extend(k, v, tokens=prompt)
    d.finish()
    ds = _start(st, d.id)
    assert covers(e.pages.record()[False], ds, ds + 300)  # (its pages: what it wrote, tests/test_lazy_pages.py)
    b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
    assert st.stats().shared_tokens > 0
    bs, u = _start(st, b.id), e.page_unit
    rec = e.pages.record()[False]
    assert covers(rec, ds, ds + 300)  # kept across this process's own span change
    assert not covers(rec, bs, bs + u)  # ... but for the borrower's punched pages
    b.free()  # its span released (the holes stay): still this process's own change
    assert covers(e.pages.record()[False], ds, ds + 300)
    c = shmkv.attach(st.name)
    try:
        c.create_sequence(capacity=1024, prefix=np.r_[prompt, [2]])  # a borrow by another attachment
        assert c.stats().shared_tokens > 0
        assert e.pages.record() == ([], [])  # dropped: re-reserved on next use
    finally:
        c.close()


@pytest.mark.parametrize("sharing", [True, False])
def test_length_reads_no_cells_and_follows_the_row(make_store, monkeypatch, sharing):
    """seq.length, capacity and remaining_capacity skip the shared-page mapping check (they read
    no cells) and still see another attachment's changes at once."""
    monkeypatch.setattr(share, "ENABLED", sharing)
    st = _store(make_store)
    prompt = np.arange(100, 400)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    k, v = _kv(8, 300)
    d.extend(k, v, tokens=prompt)
    d.finish()
    b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [3]])
    b.release()
    c = shmkv.attach(st.name)
    try:
        seen = c.sequence(b.id)
        assert (seen.length, seen.capacity) == (300, 1024)
        w = st.sequence(b.id, write=True)
        w.truncate(37)
        assert seen.length == 37 and seen.remaining_capacity == 1024 - 37
        assert np.asarray(seen.keys(0)).tobytes() == np.asarray(w.keys(0)).tobytes()
        assert (st.stats().shared_tokens > 0) == sharing
    finally:
        c.close()
