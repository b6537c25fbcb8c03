"""A process at its map limit (``vm.max_map_count``, or shmkv's own mapping budget) copies where
it would borrow, reads right what it can map, and refuses the rest.

A reuse that would borrow a donor's pages (``create_sequence(prefix=)``, ``copy_prefix`` or
``fork`` into an empty sequence) maps the span in this process at borrow time
(``Sharing.borrow`` -> ``Shares.set``). When the kernel refuses (ENOMEM), the borrow is undone
inside its transaction and the span's cells are copied instead: the caller gets a sequence of
private cells, bit for bit the donor's prefix. Only where the refused mapping cannot be undone
here is it a ShareError (and then the whole operation is rolled back).

A borrower another process made whose span this process cannot map is unreadable here: every
read path raises ShareError naming the limit and the fix (never zeros), while every other row
reads right; a span refused halfway is put back before any other row is read on its cells; and
copies from such a borrower (copy_prefix, fork, a prefix reuse) read its shared cells where they
physically are, the donor's pages, whatever the donor became.

Most tests simulate the refusal by patching ``share.libc_mmap`` to fail as the kernel does; the
others put a child process at the real limit (tests/procs/map_filler.py).
"""

from __future__ import annotations

import errno
import gc

import numpy as np
import pytest
from _sharing_scenes import (D, H, L, PROMPT, data_mappings, holds_token_kv, kv_and_tokens, kv_content, kv_pair,
                             make_donor, refusing, seeded_donor, sharing_store, start_of, token_donor)

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv._engine.table.header import SPAN_CELLS
from shmkv.store._store import engine_of


def _unshared(store, seq):
    """``seq`` borrows nothing: no span in the table, none mapped or pending in this process."""
    e = engine_of(store)
    slot = e.slot_of(seq.id)
    sh = e.shares
    return int(e.table_np[slot, SPAN_CELLS]) == 0 and slot not in sh.cur and slot not in sh.unmapped \
        and slot not in sh.dirty


# -- a refused borrow copies ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("spans_from", [1, 3], ids=["first-array", "third-array"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("how", ["create", "copy_prefix", "fork"])
def test_a_refused_borrow_copies_the_prefix(make_store, monkeypatch, how, dtype, spans_from):
    """The kernel refuses the span's mapping (at its first array, or at its third after two
    were mapped and are put back): the reuse returns a sequence whose K, V (int8: codes and
    scales), token ids and positions are the donor's prefix bit for bit, from private cells:
    ``shared_tokens`` unchanged, no mapping left behind, every other sequence intact, and
    writes into those cells never reach the donor."""
    st = sharing_store(make_store, dtype)
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


@pytest.mark.parametrize("kind", [{"layer_types": ["full", "sliding", "full"], "window": 48, "memory": 1024},
                                  {"layer_types": ["chunked", "full", "full"], "chunk": 64, "memory": 1024}],
                         ids=["sliding", "chunked"])
def test_a_refused_borrow_on_bounded_layers_equals_a_copy(make_store, monkeypatch, kind):
    """Layouts with sliding or chunked layers (which copy anyway): a refused borrow gives what
    a reuse with sharing off gives, on every layer, bit for bit."""
    st = sharing_store(make_store, **kind)
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


def test_a_refusal_that_cannot_be_put_back_raises_and_leaves_nothing(make_store, monkeypatch):
    """No way around: two arrays of the span mapped, the third refused, and mapping their own
    pages back refused too (this process's cells there may show the donor's pages): the create
    raises ShareError naming vm.max_map_count and the fix, and is rolled back whole. Once the
    kernel allows it, the next entry of the lock puts the pages back: a new sequence on those
    cells reads its own bytes."""
    st = sharing_store(make_store)
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


@pytest.mark.parametrize("end", ["exception", "kill"])
def test_a_fallback_cut_short_leaves_nothing(make_store, monkeypatch, end):
    """The fallback runs inside the create's transaction: an exception right after its copy
    (raised in this process), or a SIGKILL there (a child), and the store is as before the
    create: same sequences, no span, the donor intact; the next reuse borrows and reads right."""
    from procs.reuse_at_map_limit import die_in_the_fallback

    from shmkv._engine.spans.lending import Sharing
    from shmkv.testing import ChildFailed, start_in_process

    st = sharing_store(make_store)
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


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_process_at_the_real_limit_copies_the_prefix(make_store, start_method):
    """No patching: a child whose own mappings fill vm.max_map_count (all but 4) reuses a cached
    prefix and forks the donor. The kernel refuses the spans (ENOMEM); both copy: the donor's
    bytes, no span, nothing left unmapped, ``shared_tokens`` as before. Then this process,
    which can map, reads them alike, and its next reuse borrows again."""
    from procs.reuse_at_map_limit import reuse_at_the_limit
    from procs.map_filler import content

    from shmkv.testing import run_in_process

    st = sharing_store(make_store)
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

    st = sharing_store(make_store)
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


def test_at_the_mapping_cap_reuses_copy_and_read_right(make_store, monkeypatch):
    """With a budget of 3 borrowers (share.MAP_BUDGET lowered: 2 mappings x 6 arrays each), the
    4th and 5th reuses copy; every reuse reads right; a freed borrower makes room for a sharing one."""
    monkeypatch.setattr(share, "MAP_BUDGET", 3 * 2 * 2 * L)
    store = sharing_store(make_store)
    _, prompt = token_donor(store)
    fs, shared = [], []
    for i in range(5):
        fs.append(store.create_sequence(capacity=512, prefix=np.r_[prompt, [i]]))
        shared.append(store.stats().shared_tokens)
    assert shared == [296, 592, 888, 888, 888]
    for f in fs:
        assert holds_token_kv(f) is True
    fs[0].free()
    store.create_sequence(capacity=512, prefix=np.r_[prompt, [9]])
    assert store.stats().shared_tokens == 888
    for info in store.sequences():
        assert holds_token_kv(store.sequence(info.id)) is True


# -- a borrower this process cannot map -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_process_at_its_map_limit_reads_every_other_row(make_store, tmp_path, start_method, readonly):
    """A child whose own mappings fill vm.max_map_count (all but 4) while a new borrower B
    appears: its sync maps what it can; B's span, refused, leaves B unreadable there and every
    read path of B raises ShareError naming the limit and the fix (never zeros), while the
    donor, an unrelated row and a borrower mapped before read right. A copy from B (a prefix
    reuse and a copy_prefix, shared or not, and a fork) reads B's span where it physically is
    (the donor's cells, readable there): B's bytes, never holes.
    Its mappings freed, the next read maps B and gives its bytes bit for bit (a save and a reuse
    from B too)."""
    import multiprocessing as mp

    from procs.map_filler import content, near_the_limit

    from shmkv.testing import start_in_process

    st = sharing_store(make_store)
    d, p = seeded_donor(st)
    c, _ = seeded_donor(st, n=100, first=5000)
    b0 = st.create_sequence(capacity=1024, prefix=np.r_[p, [7]])
    ctx = mp.get_context(start_method)
    got, ready = ctx.Queue(), ctx.Event()
    child = start_in_process(near_the_limit, st.name, readonly, str(tmp_path / "b.snap"), got, ready,
                             start_method=start_method, timeout=120)
    try:
        assert ready.wait(60)
        b = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
        rng = np.random.default_rng(2)
        k = rng.standard_normal((L, 40, H, D))
        b.extend(k, -k, tokens=np.arange(1, 41))  # B alone holds these: reuses from it take B
        b.finish()
        assert st.stats().shared_tokens >= 2 * 296
        got.put((d.id, c.id, b0.id, b.id))
        out = child.result()
    finally:
        child.kill()
        got.close()
    assert out["unmapped"] == [engine_of(st).slot_of(b.id)]
    assert out["others"] == {i: content(st, i) for i in (d.id, c.id, b0.id)}
    reads = ["keys", "values", "kv", "read", "raw_keys", "iter_tokens", "head", "torch_kv", "batch_kv", "save",
             "save_all"]
    writes = ["batch_kv_pending", "torch_kv_pending", "append", "forward"]
    copies = ["fork", "reuse_shared", "reuse_copied", "copy_prefix_shared", "copy_prefix_copied"]
    want_paths = {w: "refused" for w in reads}  # every path, compared whole: a failure shows each one
    if not readonly:
        want_paths.update({w: "refused" for w in writes})
        want_paths.update({w: "returned data" for w in copies})
    assert out["paths"] == want_paths, f"what each path did: {out['paths']}; mappings after it: {out['maps']}"
    bk = np.asarray(b.keys(0))
    if not readonly:
        assert sorted(out["copies"]) == ["copy_prefix_False", "copy_prefix_True", "fork", "reuse_False", "reuse_True"]
        for got_k in out["copies"].values():
            assert got_k.shape[0] >= len(b) - 3 and np.array_equal(got_k, bk[: got_k.shape[0]])
    want = content(st, b.id)
    assert out["after"] == want and out["after_unmapped"] == []
    assert np.array_equal(np.asarray(b.keys(0))[:296], np.asarray(d.keys(0))[:296])  # the donor's bytes
    loaded = sharing_store(make_store)
    loaded.restore(str(tmp_path / "b.snap"))
    assert content(loaded, b.id) == want
    if not readonly:
        assert out["reused"] == (len(b), want)
    assert {s.id for s in st.sequences()} == {d.id, c.id, b0.id, b.id}  # the refused ones left nothing


def _refusing_calls(monkeypatch, fail):
    """share.libc_mmap refusing (ENOMEM, as at vm.max_map_count) the calls ``fail(i)`` names (1-based)."""
    import ctypes
    import errno

    real, calls = share.libc_mmap, []

    def mmap(*args):
        if args[3] & share.MAP_ANONYMOUS:  # the spare's page (Spare): not a cell's mapping
            return real(*args)
        calls.append(args)
        if fail(len(calls)):
            ctypes.set_errno(errno.ENOMEM)
            return share.MAP_FAILED
        return real(*args)

    monkeypatch.setattr(share, "libc_mmap", mmap)
    return calls


@pytest.mark.parametrize("revert_fails", [False, True])
def test_a_span_refused_halfway_is_put_back_or_undone_before_reuse(make_store, monkeypatch, revert_fails):
    """The kernel refuses B's third array: the two mapped before it go back to B's own pages
    (or, when that is refused too, B's cells stay marked and are put back before any other row
    is read there). B raises on reads until a retry maps it; then, B freed and its cells
    reused by G, this attachment reads G's bytes, not the donor's."""
    st = sharing_store(make_store)
    d, p = seeded_donor(st)
    ro = shmkv.attach(st.name, readonly=True)
    try:
        sh = engine_of(ro).shares
        want_d = kv_and_tokens(ro.sequence(d.id))
        b = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
        # the sync: arrays 1, 2 mapped, 3 refused, 1 and 2 put back (or refused: calls >= 3, the
        # put-back of 1 tried twice, the second with the spare given up: share.Spare); then every
        # retry (at each read) refused
        calls = _refusing_calls(monkeypatch, lambda i: i >= 3 if revert_fails else i == 3 or i > 5)
        rb = ro.sequence(b.id)
        assert len(rb) == 300  # not a read of cells: no error
        with pytest.raises(share.ShareError, match=r"vm\.max_map_count"):
            rb.keys(0)
        assert len(calls) == 6
        if revert_fails:
            assert calls[3] == calls[4] and calls[3][0] - sh.base == calls[3][5]  # (its own pages)
        slot = engine_of(st).slot_of(b.id)
        assert list(sh.unmapped) == [slot] and list(sh.dirty) == ([slot] if revert_fails else [])
        assert (kv_and_tokens(ro.sequence(d.id)) == want_d) is True  # (a bool: a diff of bytes takes minutes)
        monkeypatch.undo()
        if not revert_fails:
            assert (kv_and_tokens(rb) == kv_and_tokens(b)) is True
        start = start_of(st, b.id)
        b.free()
        g = st.create_sequence(capacity=1024)
        assert start_of(st, g.id) == start
        rng = np.random.default_rng(5)
        k = rng.standard_normal((L, 300, H, D))
        g.extend(k, -k)
        assert (kv_and_tokens(ro.sequence(g.id)) == kv_and_tokens(g)) is True
        assert not sh.unmapped and not sh.dirty
    finally:
        ro.close()


def test_a_read_of_an_unmapped_row_checks_before_it_copies(make_store, monkeypatch):
    """``read()`` of a row left unmapped here checks before it copies: a check after the copy
    would pass a copy of the holes when another thread maps the row again meanwhile (what the
    wrapped ``mapped`` does here after the copy)."""
    from shmkv._sequence.reader import SeqReader

    st = sharing_store(make_store)
    _, p = seeded_donor(st)
    real_mmap = share.libc_mmap
    ro = shmkv.attach(st.name, readonly=True)
    try:
        sh = engine_of(ro).shares
        b = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
        want = np.asarray(b.keys(0)).copy()
        assert np.abs(want[:296]).max() > 0
        _refusing_calls(monkeypatch, lambda i: True)
        rb = ro.sequence(b.id)
        with pytest.raises(share.ShareError):
            rb.keys(0)  # the sync refused: B is unmapped in this attachment
        slot = engine_of(st).slot_of(b.id)
        assert list(sh.unmapped) == [slot]
        real_mapped = SeqReader.mapped

        def mapped_then_another_thread_maps(self, read):
            value = real_mapped(self, read)
            monkeypatch.setattr(share, "libc_mmap", real_mmap)  # the kernel allows it now:
            sh.readable(slot, "B")  # another thread's read maps B again
            return value

        monkeypatch.setattr(SeqReader, "mapped", mapped_then_another_thread_maps)
        try:
            k, _ = rb.read(0)
        except share.ShareError:
            pass  # refused before anything was copied: right
        else:
            assert (np.asarray(k) == want).all(), "read() returned the holes of an unmapped row as data"
    finally:
        ro.close()


def _mapping_at(addr: int) -> tuple[int, int] | None:
    """The /proc/self/maps range that holds ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return lo, hi
    return None


def test_the_spare_stays_one_mapping_of_its_own_beside_twins(monkeypatch):
    """The spare is one mapping of one page, and mappings of its kind stay apart even right beside
    one another (the kernel never merges two anonymous shared mappings), so unmapping a spare
    gives exactly one mapping back."""
    real, calls = share.libc_mmap, []

    def recording(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(share, "libc_mmap", recording)
    spare = share.Spare()
    spare.keep()
    monkeypatch.setattr(share, "libc_mmap", real)
    assert spare.addr and _mapping_at(spare.addr) == (spare.addr, spare.addr + share.PAGE)
    _, length, prot, flags, fd, offset = calls[0]  # the spare's own mmap call
    page, fixed_noreplace, private = share.PAGE, 0x100000, 0x02
    hole = real(None, 3 * page, share.PROT_NONE, private | share.MAP_ANONYMOUS, -1, 0)
    assert hole not in (None, share.MAP_FAILED)
    share._munmap(hole, 3 * page)  # three free pages in a row, for three twins of the spare
    twins = []
    try:
        for at in (hole, hole + page, hole + 2 * page):
            got = real(at, length, prot, flags | fixed_noreplace, fd, offset)
            assert got == at, f"page {at:#x} of the hole was taken meanwhile"
            twins.append(at)
        assert [_mapping_at(at) for at in twins] == [(at, at + page) for at in twins]
    finally:
        for at in [*twins, spare.addr]:
            share._munmap(at, page)


# -- copies from a borrower this process cannot map read the physical cells ---------------------------


def _unmapped_borrower(make_store, monkeypatch, dtype="float16"):
    """A donor D (300 tokens, finished) and a borrower B of its first page units made through a
    second attachment; then this process refuses span mappings, so the first attachment's
    next lock entry leaves B unmapped (unreadable) there. Returns (st, other, B, dst, B's bytes)."""
    st = sharing_store(make_store, dtype)
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
    physical cells, never through B's unmapped cells."""
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
    read at its physical cells too."""
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
    st = sharing_store(make_store, dtype)
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
        assert engine_of(st).slot_of(b.id) in engine_of(st).shares.unmapped  # (unmapped here)
        assert int(engine_of(st).table_np[engine_of(st).slot_of(dst.id), SPAN_CELLS]) == 0  # copied
        assert kv_content(dst, span) == want
        monkeypatch.undo()
        assert kv_content(st.sequence(b.id), span) == want
    finally:
        monkeypatch.undo()
        other.close()


@pytest.mark.parametrize("n_from_span_end", [0, -2])
def test_a_reuse_of_an_unmapped_borrower_copies(make_store, monkeypatch, n_from_span_end):
    """The create path of the same: D freed, so B is the only holder of the prompt; a
    create_sequence(prefix=) in the process where B is unmapped reuses B's first n tokens and
    would borrow n // unit * unit of them (refused): it copies, also two tokens short of the
    span's end (its tail inside B's span)."""
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
