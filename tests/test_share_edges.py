"""Edge cases of shared prefix pages, a test each (numbered in the order they were pinned)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv._sequence.room import chunk
from shmkv.store._store import engine_of

L, H, D = 3, 4, 64


def _store(make_store, **kw):
    args = dict(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=32)
    args.update(kw)
    return make_store(**args)


def _donor(store, n=300, capacity=1024, first=1000, finish=True):
    prompt = np.arange(first, first + n)
    d = store.create_sequence(capacity=capacity, prefix=prompt)
    rng = np.random.default_rng(n)
    shape = (store.layout.layers, n - len(d), store.layout.kv_heads, store.layout.head_dim)
    d.extend(rng.standard_normal(shape), rng.standard_normal(shape), tokens=prompt[len(d):])
    if finish:
        d.finish()
    return d, prompt


def _reap(pid: int, timeout: float = 20.0) -> int | None:
    """The child's exit code, or None when it did not end in ``timeout`` (then it is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_06_fork_while_a_thread_holds_the_span_lock(make_store):
    """A child forked while another thread is inside Shares.sync/apply (holding the span lock)
    reads after the span epoch moved: it gets a fresh lock, not the held copy."""
    st = _store(make_store)
    d, p = _donor(st)
    want = np.asarray(d.keys(0)).copy()
    reader = shmkv.attach(st.name, readonly=True)
    try:
        reader.sequence(d.id).keys(0)
        st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])  # the span epoch moves
        inside, leave = threading.Event(), threading.Event()

        def syncing() -> None:
            with engine_of(reader).shares.lock:  # where a thread is during sync/apply
                inside.set()
                leave.wait(30)

        t = threading.Thread(target=syncing)
        t.start()
        try:
            assert inside.wait(10)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    code = 0 if np.array_equal(np.asarray(reader.sequence(d.id).keys(0)), want) else 2
                finally:
                    os._exit(code)
        finally:
            leave.set()
            t.join()
        assert _reap(pid) == 0
    finally:
        reader.close()


def _start(store, seq_id):
    return next(s.start for s in store.sequences() if s.id == seq_id)


def _content(seq, layers=L):
    return [(np.asarray(seq.keys(i)).tobytes(), np.asarray(seq.values(i)).tobytes()) for i in range(layers)] + [
        seq.tokens.tobytes()]


def test_07_a_live_donor_rolls_back_one_token_in_place(make_store):
    """A leased donor lends all but its last page unit: B (same prompt + 1) borrows less than
    A's length, and A's speculative rollback by one token neither moves nor copies it."""
    st = _store(make_store, max_tokens=2048)
    u = engine_of(st).page_unit
    a, p = _donor(st, n=38 * u, capacity=512, finish=False)  # a whole number of units, still leased
    b = st.create_sequence(capacity=512, prefix=np.r_[p, [1]])
    assert len(b) == 38 * u and st.stats().shared_tokens == 37 * u
    start = _start(st, a.id)
    a.truncate(38 * u - 1)
    assert _start(st, a.id) == start


def test_07_a_donor_in_a_full_store_truncates_below_its_loans(make_store):
    """No free range to move to: the donor's truncate still succeeds (it never fails for want of
    room because of sharing); it keeps lending the cells it no longer holds, so its next extend
    is CacheFullError, nothing written, until a range is free; then it moves and writes, and
    its borrower reads its own tokens throughout."""
    st = _store(make_store, max_tokens=2048)
    a, p = _donor(st, n=304, capacity=512)
    a = st.sequence(a.id, write=True)  # taken back: it may truncate and write again
    b = st.create_sequence(capacity=512, prefix=np.r_[p, [1]])
    shared = st.stats().shared_tokens
    assert shared > 100
    b_before = _content(b)
    fillers = []
    while st.stats().largest_free_range:  # the rest of the store in use
        fillers.append(st.create_sequence(capacity=st.stats().largest_free_range))
    a.truncate(100)
    rng = np.random.default_rng(7)
    k = rng.standard_normal((L, 200, H, D))
    with pytest.raises(shmkv.CacheFullError, match="lent its first"):
        a.extend(k, k)
    assert len(a) == 100 and _content(b) == b_before and st.stats().shared_tokens == shared
    fillers[-1].free()
    a.extend(k, k)
    assert _content(b) == b_before
    assert np.array_equal(np.asarray(a.keys(0))[100:], k[0].astype(np.float16))
    assert st.stats().shared_tokens == shared  # the borrower's span stays: its cells are its own now


@pytest.mark.parametrize("sharing", [True, False])
def test_04_no_aligned_range_copies_instead_of_evicting(make_store, monkeypatch, sharing):
    """int8 3x40: a page unit of 1,024 cells. A 2,100-token donor and a request of capacity
    2,105 in a 5,003-cell store: only an unaligned range (at cell 2,100) fits; the request takes
    it and copies the prefix, evicting nothing (as before shared pages; sharing off: no
    alignment at all)."""
    monkeypatch.setattr(share, "ENABLED", sharing)
    n = 2100
    st = make_store(layers=2, kv_heads=3, head_dim=40, dtype="int8", max_tokens=5003, max_seqs=8)
    assert engine_of(st).page_unit == 1024
    d, p = _donor(st, n=n, capacity=n, first=0)
    want = _content(d, 2)
    f = st.create_sequence(capacity=n + 5, prefix=np.r_[p, [1]])
    assert len(f) == n and st.stats().evictions == 0
    assert d.id in [i.id for i in st.sequences()]
    assert _content(f, 2) == want and _content(d, 2) == want



def test_05_stats_and_info_count_a_span_once_when_its_donor_is_gone(make_store, capsys):
    """int8 4x64 (page unit 256): 4 borrowers of a 300-token donor read a 256-cell span and hold
    44 cells each; the donor freed, the span's one copy is still held (by them): 432 cells."""
    from shmkv.cli import main

    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=16384, max_seqs=32)
    assert engine_of(st).page_unit == 256
    d, p = _donor(st, n=300)
    for i in range(4):
        st.create_sequence(capacity=1024, prefix=np.r_[p, [i]])
    s = st.stats()
    assert (s.shared_tokens, s.span_cells) == (4 * 256, 256)
    kv = s.bytes_per_token - 16
    assert s.bytes_held == (300 + 4 * 44) * kv + 1500 * 16  # the donor holds the span
    d.free()
    s = st.stats()
    assert (s.tokens, s.shared_tokens, s.span_cells) == (1200, 4 * 256, 256)
    assert s.bytes_held == (256 + 4 * 44) * kv + 1200 * 16
    assert main(["info", st.name]) == 0
    out = capsys.readouterr().out
    assert f"sharing ratio {s.bytes_used / s.bytes_held:.2f}" in out
    from shmkv.cli._words import size

    assert f"({size(256 * kv)} held once)" in out  # (in the unit that reads best: KiB here)



def test_01_a_range_punched_by_another_attachment_is_reserved_again(make_store):
    """Attachment C reserved cells R (a sequence written and freed there); attachment B's
    borrower at R punches R's pages out and is freed (the holes stay). C's next sequence at R
    allocates them again (fallocate, a chunk ahead of its first append: _sequence/room.py)
    before anything writes: on a full /dev/shm that is a CacheFullError, never a SIGBUS at
    the first append. (C's record of what it reserved is stale: the borrow moved the span epoch.)"""
    st = _store(make_store)
    _, p = _donor(st, n=300, capacity=1024)
    c = shmkv.attach(st.name)
    try:
        fd = engine_of(st)._dseg.fileno()
        x = c.create_sequence(capacity=1024)
        full = np.ones((L, 1024, H, D))
        x.extend(full, full)  # C allocates all of R
        r = _start(c, x.id)
        x.free()
        before = os.fstat(fd).st_blocks
        f = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
        m = st.stats().shared_tokens
        assert _start(st, f.id) == r and m > 0
        f.free()
        holes = os.fstat(fd).st_blocks
        assert holes < before  # the borrower's punched pages: holes
        y = c.create_sequence(capacity=1024)
        assert _start(c, y.id) == r
        one = np.ones((H, D), np.float16)
        for layer in range(L):
            y.append(layer, one, one)
        e = engine_of(st)
        cells = chunk(1024, e.page_unit, e.kv_bytes(L))
        assert cells <= m  # (the chunk lies inside the old holes)
        # allocated before the write: the whole chunk's K/V pages, not only the token's own page
        assert (os.fstat(fd).st_blocks - holes) * 512 >= cells * 2 * L * H * D * 2
        y.commit()
        k = np.ones((L, 10, H, D))
        y.extend(k, k)
        assert np.array_equal(np.asarray(y.keys(0)), np.ones((11, H, D), np.float16))
    finally:
        c.close()


def test_03_fork_and_copy_prefix_borrow(make_store):
    """fork() and store.copy_prefix() into an empty sequence on a page unit borrow the source's
    whole units (a live source: all but its last unit) and read exactly the source's tokens;
    writes after them stay each sequence's own."""
    st = _store(make_store)
    u = engine_of(st).page_unit
    d, _ = _donor(st, n=300, capacity=1024, finish=False)
    want = _content(d)
    child = d.fork()
    assert st.stats().shared_tokens == (300 - u) // u * u
    assert _content(child) == want
    dst = st.create_sequence(capacity=1024, prefix=[5, 6, 7])  # a miss, on a page unit
    st.copy_prefix(d.id, dst.id, 200)
    assert st.stats().shared_tokens == (300 - u) // u * u + 200 // u * u
    assert _content(dst) == [(k[: 200 * len(k) // 300], v[: 200 * len(v) // 300]) for k, v in want[:L]] + [
        want[L][: 200 * 8]]
    rng = np.random.default_rng(3)
    k = rng.standard_normal((L, 50, H, D))
    child.truncate(100)  # into its span: copy-on-write
    child.extend(k, k)
    dst.extend(k, k)
    d.extend(-k, -k)
    assert _content(d)[0][0][: len(want[0][0])] == want[0][0]
    assert np.array_equal(np.asarray(child.keys(0))[100:], k[0].astype(np.float16))
    assert np.array_equal(np.asarray(dst.keys(0))[200:], k[0].astype(np.float16))
    assert np.array_equal(np.asarray(d.keys(0))[300:], -k[0].astype(np.float16))
    assert np.asarray(child.keys(0))[:100].tobytes() == want[0][0][: 100 * H * D * 2]


@pytest.mark.slow
@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_02_a_process_at_its_map_limit_reads_every_other_row(make_store, tmp_path, start_method, readonly):
    """A child whose own mappings fill vm.max_map_count (all but 4) while a new borrower B
    appears: its sync maps what it can; B's span, refused, leaves B unreadable there and every
    read path of B raises ShareError naming the limit and the fix (never zeros), while the
    donor, an unrelated row and a borrower mapped before read right. A copy from B (a prefix
    reuse and a copy_prefix, shared or not, and a fork) reads B's span where it physically is
    (the donor's cells, readable there): B's bytes, never holes (review 32 finding 3, review 33).
    Its mappings freed, the next read maps B and gives its bytes bit for bit (a save and a reuse
    from B too)."""
    import multiprocessing as mp

    from procs.map_filler import content, near_the_limit

    from shmkv.testing import start_in_process

    st = _store(make_store)
    d, p = _donor(st)
    c, _ = _donor(st, n=100, first=5000)
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
    loaded = _store(make_store)
    loaded.restore(str(tmp_path / "b.snap"))
    assert content(loaded, b.id) == want
    if not readonly:
        assert out["reused"] == (len(b), want)
    assert {s.id for s in st.sequences()} == {d.id, c.id, b0.id, b.id}  # the refused ones left nothing


def _refusing(monkeypatch, fail):
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
def test_02_a_span_refused_halfway_is_put_back_or_undone_before_reuse(make_store, monkeypatch, revert_fails):
    """The kernel refuses B's third array: the two mapped before it go back to B's own pages
    (or, when that is refused too, B's cells stay marked and are put back before any other row
    is read there). B raises on reads until a retry maps it; then, B freed and its cells
    reused by G, this attachment reads G's bytes, not the donor's."""
    st = _store(make_store)
    d, p = _donor(st)
    ro = shmkv.attach(st.name, readonly=True)
    try:
        sh = engine_of(ro).shares
        want_d = _content(ro.sequence(d.id))
        b = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
        # the sync: arrays 1, 2 mapped, 3 refused, 1 and 2 put back (or refused: calls >= 3, the
        # put-back of 1 tried twice, the second with the spare given up: share.Spare); then every
        # retry (at each read) refused
        calls = _refusing(monkeypatch, lambda i: i >= 3 if revert_fails else i == 3 or i > 5)
        rb = ro.sequence(b.id)
        assert len(rb) == 300  # not a read of cells: no error
        with pytest.raises(share.ShareError, match=r"vm\.max_map_count"):
            rb.keys(0)
        assert len(calls) == 6
        if revert_fails:
            assert calls[3] == calls[4] and calls[3][0] - sh.base == calls[3][5]  # (its own pages)
        slot = engine_of(st).slot_of(b.id)
        assert list(sh.unmapped) == [slot] and list(sh.dirty) == ([slot] if revert_fails else [])
        assert (_content(ro.sequence(d.id)) == want_d) is True  # (a bool: a diff of bytes takes minutes)
        monkeypatch.undo()
        if not revert_fails:
            assert (_content(rb) == _content(b)) is True
        start = _start(st, b.id)
        b.free()
        g = st.create_sequence(capacity=1024)
        assert _start(st, g.id) == start
        rng = np.random.default_rng(5)
        k = rng.standard_normal((L, 300, H, D))
        g.extend(k, -k)
        assert (_content(ro.sequence(g.id)) == _content(g)) is True
        assert not sh.unmapped and not sh.dirty
    finally:
        ro.close()


def test_02_read_checks_before_it_copies(make_store, monkeypatch):
    """``read()`` of a row left unmapped here checks before it copies (review of 02ee588): it
    checked only after the copy, so a copy of the holes passed when another thread mapped the
    row again meanwhile (what the wrapped ``mapped`` does here after the copy)."""
    from shmkv._sequence.reader import SeqReader

    st = _store(make_store)
    _, p = _donor(st)
    real_mmap = share.libc_mmap
    ro = shmkv.attach(st.name, readonly=True)
    try:
        sh = engine_of(ro).shares
        b = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
        want = np.asarray(b.keys(0)).copy()
        assert np.abs(want[:296]).max() > 0
        _refusing(monkeypatch, lambda i: True)
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
