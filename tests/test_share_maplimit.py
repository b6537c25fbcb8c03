"""A reuse in a process at its map limit copies instead of raising (issue 23, the last item).

A reuse that would borrow a donor's pages (``create_sequence(prefix=)``, ``copy_prefix`` or
``fork`` into an empty sequence) maps the span in this process at borrow time
(``Sharing.borrow`` -> ``Shares.set``). When the kernel refuses (ENOMEM: the process holds
``vm.max_map_count`` mappings), the borrow is undone inside its transaction and the span's cells
are copied instead: the caller gets a sequence of private cells, bit for bit the donor's prefix.
Only where the refused mapping cannot be undone here is it a ShareError (and then the whole
operation is rolled back).

The refusal is simulated by patching ``share.libc_mmap`` to fail as the kernel does; the last test
puts a child process at the real limit instead."""

from __future__ import annotations

import errno
import gc

import numpy as np
import pytest

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv._engine.table.header import SPAN_CELLS
from shmkv.store._store import engine_of
from _maplimit_scenes import PROMPT, data_mappings, kv_content, kv_pair, lim_store, make_donor, refusing

def _unshared(store, seq):
    """``seq`` borrows nothing: no span in the table, none mapped or pending in this process."""
    e = engine_of(store)
    slot = e.slot_of(seq.id)
    sh = e.shares
    return int(e.table_np[slot, SPAN_CELLS]) == 0 and slot not in sh.cur and slot not in sh.unmapped \
        and slot not in sh.dirty


@pytest.mark.slow
@pytest.mark.parametrize("spans_from", [1, 3], ids=["first-array", "third-array"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("how", ["create", "copy_prefix", "fork"])
def test_a_refused_borrow_copies_the_prefix(make_store, monkeypatch, how, dtype, spans_from):
    """The kernel refuses the span's mapping (at its first array, or at its third after two
    were mapped and are put back): the reuse returns a sequence whose K, V (int8: codes and
    scales), token ids and positions are the donor's prefix bit for bit, from private cells:
    ``shared_tokens`` unchanged, no mapping left behind, every other sequence intact, and
    writes into those cells never reach the donor. Without the fallback it raised ShareError."""
    st = lim_store(make_store, dtype)
    rng = np.random.default_rng(23)
    d, p = make_donor(st, rng)
    c, _ = make_donor(st, rng, n=100, first=5000, finish=False)  # an unrelated row, leased
    b0 = st.create_sequence(capacity=1024, prefix=np.r_[p, [7]])  # a borrower mapped before
    assert st.stats().shared_tokens > 0
    dst = st.create_sequence(capacity=1024, prefix=[999_999]) if how == "copy_prefix" else None  # (a miss)
    parent = st.sequence(d.id) if how == "fork" else None  # (a read handle: d stays finished, all lent)
    want = kv_content(d, PROMPT)
    before = {s.id: kv_content(s) for s in (d, c, b0)}
    stats0 = st.stats()
    gc.collect()
    maps0 = data_mappings(st.name)
    calls = refusing(monkeypatch, st, spans_from=spans_from)

    if how == "create":
        s = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
    elif how == "copy_prefix":
        st.copy_prefix(d.id, dst.id, PROMPT)
        s = dst
    else:
        s = parent.fork()

    assert any(refused for _, refused in calls), "the reuse never tried to borrow: the test shows nothing"
    assert len(s) == PROMPT
    assert kv_content(s) == want
    assert _unshared(st, s)
    stats = st.stats()
    assert stats.shared_tokens == stats0.shared_tokens
    assert stats.sequences == stats0.sequences + (how != "copy_prefix")
    if how == "create":
        assert (stats.prefix_hits, stats.prefix_tokens_reused) == (stats0.prefix_hits + 1,
                                                                  stats0.prefix_tokens_reused + PROMPT)
    assert {i: kv_content(st.sequence(i)) for i in before} == before
    gc.collect()
    assert data_mappings(st.name) == maps0  # the refused attempt left no mapping

    monkeypatch.undo()  # the kernel allows mappings again: nothing pending re-maps the copy
    ro = shmkv.attach(st.name, readonly=True)
    try:
        assert kv_content(ro.sequence(s.id)) == want
        assert not engine_of(ro).shares.unmapped
    finally:
        ro.close()
    # its first cells are its own: a truncate into them and new tokens there leave the donor
    s.truncate(50)
    k, v = kv_pair(rng, 60)
    s.extend(k, v, tokens=np.arange(60))
    assert kv_content(d) == before[d.id] and kv_content(b0) == before[b0.id]
    e = engine_of(st)
    assert not e.shares.unmapped and not e.shares.dirty


def test_a_refusal_that_cannot_be_put_back_raises_and_leaves_nothing(make_store, monkeypatch):
    """No way around: two arrays of the span mapped, the third refused, and mapping their own
    pages back refused too (this process's cells there may show the donor's pages): the create
    raises ShareError naming vm.max_map_count and the fix, and is rolled back whole. Once the
    kernel allows it, the next entry of the lock puts the pages back: a new sequence on those
    cells reads its own bytes."""
    st = lim_store(make_store)
    rng = np.random.default_rng(5)
    d, p = make_donor(st, rng)
    before = {i.id: i for i in st.sequences()}
    want_d = kv_content(d)
    stats0 = st.stats()
    calls = refusing(monkeypatch, st, spans_from=3, put_back=False)
    with pytest.raises(shmkv.ShareError, match=r"vm\.max_map_count") as err:
        st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
    assert err.value.errno == errno.ENOMEM and "SHMKV_SHARE=0" in str(err.value)
    assert isinstance(err.value, shmkv.ShmkvError) and isinstance(err.value, OSError)
    assert {i.id: i for i in st.sequences()} == before
    assert st.stats().shared_tokens == stats0.shared_tokens
    # two arrays mapped, the third refused; then only tries to put their own pages back (the
    # refused borrow's, the fallback's, the rollback's and the next lock entry's): all refused
    assert calls[:3] == [(False, False)] * 2 + [(False, True)]
    assert len(calls) > 4 and set(calls[3:]) == {(True, True)}
    monkeypatch.undo()
    g = st.create_sequence(capacity=1024)
    k, v = kv_pair(rng, PROMPT)
    g.extend(k, v)
    e = engine_of(st)
    assert not e.shares.unmapped and not e.shares.dirty
    assert kv_content(g)[2] == np.asarray(k[0], np.float16).tobytes()  # its own pages, not the donor's
    assert kv_content(d) == want_d


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_process_at_the_real_limit_copies_the_prefix(make_store, start_method):
    """No patching: a child whose own mappings fill vm.max_map_count (all but 4) reuses a cached
    prefix and forks the donor. The kernel refuses the spans (ENOMEM); both copy: the donor's
    bytes, no span, nothing left unmapped, ``shared_tokens`` as before. Then this process,
    which can map, reads them alike, and its next reuse borrows again."""
    from procs.reuse_at_map_limit import reuse_at_the_limit
    from procs.map_filler import content

    from shmkv.testing import run_in_process

    st = lim_store(make_store)
    rng = np.random.default_rng(7)
    d, p = make_donor(st, rng)
    b0 = st.create_sequence(capacity=1024, prefix=np.r_[p, [7]])
    shared0 = st.stats().shared_tokens
    assert shared0 > 0
    want = content(st, d.id)
    out = run_in_process(reuse_at_the_limit, st.name, [*p.tolist(), 1], d.id, start_method=start_method,
                         timeout=120)
    (s_id, s_len, s_digest), (f_id, f_len, f_digest) = out["reuse"], out["fork"]
    assert (s_len, s_digest) == (PROMPT, want) and (f_len, f_digest) == (PROMPT, want)
    assert out["spans"] == [0, 0] and out["unmapped"] == [] and out["shared_tokens"] == shared0
    assert content(st, s_id) == want and content(st, f_id) == want and content(st, b0.id) == want
    assert st.stats().shared_tokens == shared0
    b1 = st.create_sequence(capacity=1024, prefix=np.r_[p, [8]])
    assert st.stats().shared_tokens > shared0
    assert kv_content(b1) == kv_content(d)


@pytest.mark.slow
@pytest.mark.parametrize("free", [1, 2, 3, 4])
def test_a_refused_span_is_put_back_whatever_mappings_are_free(make_store, free):
    """No patching: a child left exactly ``free`` mappings under vm.max_map_count. A span's array
    mapped in the middle of the data segment's region costs two, and the kernel maps it with one
    free: with an odd count free the child ends one over the limit, where the kernel refuses
    every mmap, the put-back of the arrays mapped before the refusal too. Whatever the count, the
    refused span is put back: the child's own reuse copies the donor's prefix (no ShareError),
    another process's borrower is refused at a read and a copy_prefix from it gives its bytes;
    after each the child is within the limit, no row left dirty, only that borrower unmapped."""
    import multiprocessing as mp

    from procs.reuse_at_map_limit import put_back_with_free
    from procs.map_filler import content

    from shmkv.testing import start_in_process

    st = lim_store(make_store)
    rng = np.random.default_rng(11)
    d, p = make_donor(st, rng)
    want = content(st, d.id)
    ctx = mp.get_context("fork")
    got, ready = ctx.Queue(), ctx.Event()
    child = start_in_process(put_back_with_free, st.name, free, [*p.tolist(), 1], got, ready, start_method="fork",
                             timeout=120)
    try:
        assert ready.wait(60)
        b = st.create_sequence(capacity=1024, prefix=np.r_[p, [2]])
        k, v = kv_pair(rng, 40)
        b.extend(k, v, tokens=np.arange(2, 42))
        b.finish()
        assert engine_of(st).table_np[engine_of(st).slot_of(b.id), SPAN_CELLS] > 0
        got.put(b.id)
        out = child.result()
    finally:
        child.kill()
        got.close()
    clean = {"over": False, "dirty": [], "unmapped": []}
    slot_b = engine_of(st).slot_of(b.id)
    assert isinstance(out["reuse"], tuple), out["reuse"]
    s_id, s_len, s_digest, s_span = out["reuse"]
    assert (s_len, s_digest, s_span) == (PROMPT, want, 0) and content(st, s_id) == want
    assert out["after_reuse"] == clean
    assert out["read"] == "refused"
    assert out["after_read"] == {**clean, "unmapped": [slot_b]}
    assert isinstance(out["copy"], tuple), out["copy"]
    dst_id, dst_k = out["copy"]
    assert dst_k.shape[0] == len(b) - 3 and np.array_equal(dst_k, np.asarray(b.keys(0))[: len(b) - 3])
    assert np.array_equal(np.asarray(st.sequence(dst_id).keys(0)), dst_k)
    assert out["after_copy"] == {**clean, "unmapped": [slot_b]}


@pytest.mark.parametrize("end", ["exception", "kill"])
def test_a_fallback_cut_short_leaves_nothing(make_store, monkeypatch, end):
    """The fallback runs inside the create's transaction: an exception right after its copy
    (raised in this process), or a SIGKILL there (a child), and the store is as before the
    create: same sequences, no span, the donor intact; the next reuse borrows and reads right."""
    from procs.reuse_at_map_limit import die_in_the_fallback

    from shmkv._engine.spans.lending import Sharing
    from shmkv.testing import ChildFailed, start_in_process

    st = lim_store(make_store)
    rng = np.random.default_rng(11)
    d, p = make_donor(st, rng)
    before = st.sequences()
    want_d = kv_content(d)
    stats0 = st.stats()
    prompt = np.r_[p, [1]]
    if end == "exception":
        refusing(monkeypatch, st)
        real = Sharing._copy_span

        def copy_then_fail(self, start, src, m):
            real(self, start, src, m)
            raise KeyboardInterrupt

        monkeypatch.setattr(Sharing, "_copy_span", copy_then_fail)
        with pytest.raises(KeyboardInterrupt):
            st.create_sequence(capacity=1024, prefix=prompt)
        monkeypatch.undo()
    else:
        child = start_in_process(die_in_the_fallback, st.name, prompt.tolist(), start_method="fork", timeout=60)
        with pytest.raises(ChildFailed, match="killed by signal 9"):
            child.result()
    s = st.create_sequence(capacity=1024, prefix=prompt)  # (its lock entry rolls a dead child's create back)

    def rows(infos):  # (generations aside: the donor now lends)
        return {(i.id, i.length, i.capacity, i.start, i.finished) for i in infos if i.id != s.id}

    assert rows(st.sequences()) == rows(before)
    assert st.stats().shared_tokens > stats0.shared_tokens  # s borrows: nothing left in the way
    assert kv_content(s) == want_d and kv_content(d) == want_d
    e = engine_of(st)
    assert not e.shares.unmapped and not e.shares.dirty


@pytest.mark.parametrize("kind", [{"layer_types": ["full", "sliding", "full"], "window": 48, "memory": 1024},
                                  {"layer_types": ["chunked", "full", "full"], "chunk": 64, "memory": 1024}],
                         ids=["sliding", "chunked"])
def test_a_refused_borrow_on_bounded_layers_equals_a_copy(make_store, monkeypatch, kind):
    """Layouts with sliding or chunked layers (which copy anyway): a refused borrow gives what
    a reuse with sharing off gives, on every layer, bit for bit."""
    st = lim_store(make_store, **kind)
    rng = np.random.default_rng(3)
    _, p = make_donor(st, rng)
    monkeypatch.setattr(share, "ENABLED", False)
    ref = st.create_sequence(capacity=1024, prefix=np.r_[p, [2]])
    monkeypatch.undo()
    shared0 = st.stats().shared_tokens
    calls = refusing(monkeypatch, st)
    s = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
    assert any(refused for _, refused in calls)
    assert len(s) == len(ref) > 0 and kv_content(s) == kv_content(ref)
    assert _unshared(st, s) and st.stats().shared_tokens == shared0
