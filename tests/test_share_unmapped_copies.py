"""Copies from a borrower this process cannot map (its span refused: vm.max_map_count) read
its shared cells where they physically are, the donor's pages, never through its unmapped
cells (``Shares.sources``; review 32 finding 3 and review 33, whose repros these are): a
copy_prefix, a fork and a prefix reuse give B's bytes, whatever n is against the span's end,
also when the span's owner is gone or moved off its loans."""

from __future__ import annotations


import numpy as np
import pytest

import shmkv
from shmkv._engine.spans import mappings as share
from _maplimit_scenes import D, H, L, PROMPT, kv_content, lim_store, make_donor, refusing
from shmkv._engine.table.header import SPAN_CELLS
from shmkv.store._store import engine_of


def _unmapped_borrower(make_store, monkeypatch, dtype="float16"):
    """A donor D (300 tokens, finished) and a borrower B of its first page units made through a
    second attachment; then this process refuses span mappings, so the first attachment's
    next lock entry leaves B unmapped (unreadable) there. Returns (st, other, B, dst, B's bytes)."""
    st = lim_store(make_store, dtype)
    other = shmkv.attach(st.name)
    dst = st.create_sequence(capacity=1024, prefix=[999_999])  # a miss: empty, on a page unit
    rng = np.random.default_rng(33)
    _, prompt = make_donor(other, rng)
    b = other.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
    k = rng.standard_normal((L, 40, H, D))
    b.extend(k, -k, tokens=np.arange(1, 41))
    b.finish()
    span = int(engine_of(other).table_np[engine_of(other).slot_of(b.id), SPAN_CELLS])
    assert span >= PROMPT - 8, "B borrows nothing: the scene shows nothing"
    want = kv_content(other.sequence(b.id), len(b))
    refusing(monkeypatch, st, other)
    with engine_of(st).locked():  # its sync: B's span refused here
        pass
    assert engine_of(st).slot_of(b.id) in engine_of(st).shares.unmapped
    return st, other, b, dst, want, span


@pytest.mark.parametrize("n_from_span_end", [0, -2, 3])
def test_copy_prefix_from_an_unmapped_borrower_copies(make_store, monkeypatch, n_from_span_end):
    """docs/prefix-cache.md: "A create, copy_prefix or fork that would borrow in such a process
    copies the prefix instead ... That copy reads the shared pages where they physically live, so
    it works even when its donor is itself a borrower unreadable in that process. It raises the
    same error ... only when the kernel also refuses to put back the pages of the refused mapping."
    n at the span's end and past it: the copy works. n two cells short of the span's end (so the
    copy's tail [n // unit * unit, n) lies inside B's span): that tail too is read at its
    physical cells, never through B's unmapped cells (review 33; it raised ShareError)."""
    st, other, b, dst, want, span = _unmapped_borrower(make_store, monkeypatch)
    try:
        n = span + n_from_span_end
        st.copy_prefix(b.id, dst.id, n)
        assert len(dst) == n
        got = kv_content(dst, n)
        assert got == [w[: len(g)] for w, g in zip(want, got, strict=True)]
    finally:
        monkeypatch.undo()
        other.close()


def test_fork_of_an_unmapped_borrower_inside_its_span_copies(make_store, monkeypatch):
    """The same through fork(n): a fork of B's first span - 2 tokens in the process where B is
    unmapped (its span refused) would borrow span - 10 cells (refused too) and copy, its tail
    read at its physical cells too (review 33; it raised ShareError)."""
    st, other, b, _dst, want, span = _unmapped_borrower(make_store, monkeypatch)
    try:
        w = st.sequence(b.id, write=True)
        try:
            f = w.fork(span - 2)
            try:
                got = kv_content(f, span - 2)
                assert got == [x[: len(g)] for x, g in zip(want, got, strict=True)]
            finally:
                f.free()
        finally:
            w.release()
    finally:
        monkeypatch.undo()
        other.close()


@pytest.mark.parametrize("donor_fate", ["freed", "moved"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_the_fallback_copies_physical_cells_whose_owner_is_gone(make_store, monkeypatch, donor_fate, dtype):
    """The owner D freed (its lent cells then held by B's span alone), or moved off
    its loans (leased, truncated to 8 tokens with a free range, then written past them), and a
    copy_prefix from B (unmapped here) into an empty sequence, its borrow refused, copies B's
    bytes from the physical cells; D's new tokens never show in it."""
    st = lim_store(make_store, dtype)
    other = shmkv.attach(st.name)
    dst = st.create_sequence(capacity=1024, prefix=[999_999])
    try:
        rng = np.random.default_rng(34)
        d, prompt = make_donor(other, rng)
        b = other.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
        b.finish()
        eo = engine_of(other)
        span = int(eo.table_np[eo.slot_of(b.id), SPAN_CELLS])
        assert span > 0
        want = kv_content(other.sequence(b.id), span)
        if donor_fate == "freed":
            other.sequence(d.id, write=True).free()
        else:
            w = other.sequence(d.id, write=True)
            start0 = int(eo.table_np[eo.slot_of(d.id), share.START])
            w.truncate(8)
            x = np.full((H, D), 5.0, np.float32)
            for _ in range(20):
                for layer in range(L):
                    w.append(layer, x, x)
                w.commit()
            assert int(eo.table_np[eo.slot_of(d.id), share.START]) != start0
            w.release()
        assert kv_content(other.sequence(b.id), span) == want
        refusing(monkeypatch, st, other)
        st.copy_prefix(b.id, dst.id, span)
        assert engine_of(st).slot_of(b.id) in engine_of(st).shares.unmapped  # the case of 5f4e516
        assert int(engine_of(st).table_np[engine_of(st).slot_of(dst.id), SPAN_CELLS]) == 0  # copied
        assert kv_content(dst, span) == want
        monkeypatch.undo()
        assert kv_content(st.sequence(b.id), span) == want
    finally:
        monkeypatch.undo()
        other.close()


@pytest.mark.parametrize("n_from_span_end", [0, -2])
def test_a_reuse_of_an_unmapped_borrower_copies(make_store, monkeypatch, n_from_span_end):
    """The create path of the same finding: D freed, so B is the only holder of the prompt; a
    create_sequence(prefix=) in the process where B is unmapped reuses B's first n tokens and
    would borrow n // unit * unit of them (refused): it copies, also two tokens short of the
    span's end (its tail inside B's span: review 33; it raised ShareError)."""
    st, other, b, dst, want, span = _unmapped_borrower(make_store, monkeypatch)
    try:
        eo = engine_of(other)
        d_id = next(s.id for s in other.sequences() if s.id not in (b.id, dst.id))
        monkeypatch.undo()
        other.sequence(d_id, write=True).free()
        refusing(monkeypatch, st, other)
        n = span + n_from_span_end
        toks = np.asarray(other.sequence(b.id).tokens)[:n]
        s = st.create_sequence(capacity=1024, prefix=np.r_[toks, [77_777]])
        try:
            assert len(s) == n
            assert int(eo.table_np[eo.slot_of(s.id), SPAN_CELLS]) == 0
            got = kv_content(s, n)
            assert got == [w[: len(g)] for w, g in zip(want, got, strict=True)]
        finally:
            s.free()
    finally:
        monkeypatch.undo()
        other.close()
