"""Reads of shared prefix pages give, in every process and thread, the bytes a store that never
shares would hold (a reference built with sharing off, or a copy): in another process (fork,
spawn, forkserver; a read-only attachment; another PID namespace; a process with sharing off),
in a fork child that inherited the spans, in threads reading while spans come and go, after the
cells a process mapped as a span were freed and reused by another process, after structural
operations on donors and borrowers, and in a full store evicting them. Views of a borrower
outlive the attachment's close and the store's removal; attaching and closing leaks nothing.
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _sharing_scenes import (D, H, L, PROMPT, holds_token_kv, kv_of_tokens, kv_pair, make_donor, seeded_donor,
                             sharing_store, token_donor)
from procs.share import read_inherited, read_sequence
from procs.share_reads import digest, free_and_reuse, kv

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv._engine.table.header import START
from shmkv.store._store import engine_of
from shmkv.testing import run_in_process


def _with_borrower(store, seed=1):
    """A finished donor of PROMPT tokens (K/V ``seed``) and a borrower of all of them."""
    prompt = np.arange(1000, 1000 + PROMPT)
    d = store.create_sequence(capacity=1024, prefix=prompt)
    k, v = kv(seed, L, PROMPT, H, D)
    d.extend(k, v, tokens=prompt)
    d.finish()
    f = store.create_sequence(capacity=1024, prefix=np.r_[prompt, [7]])
    assert len(f) == PROMPT and store.stats().shared_tokens > 0  # it did borrow
    return d, f


def _reference(make_store, dtype, seed, n, tokens=None):
    """The same K/V written into a store that never shares: the bytes a read must give."""
    share.ENABLED = False
    try:
        ref = sharing_store(make_store, dtype)
        s = ref.create_sequence(capacity=1024)
        k, v = kv(seed, L, n, H, D)
        s.extend(k, v, tokens=tokens)
        return s
    finally:
        share.ENABLED = True


def _content(seq) -> list[tuple[bytes, bytes]]:
    return [(np.asarray(seq.keys(i)).tobytes(), np.asarray(seq.values(i)).tobytes()) for i in range(L)]


def _same(a: list, b: list) -> bool:
    return a == b  # a bool: pytest's diff of megabytes would take minutes


# -- in other processes ----------------------------------------------------------------------------


@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_borrower_read_in_another_process(make_store, method, readonly):
    store = sharing_store(make_store)
    rng = np.random.default_rng(8)
    _, prompt = make_donor(store, rng)
    b = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [1]]))
    want = [(b.keys(i).tobytes(), b.values(i).tobytes()) for i in range(3)]
    assert run_in_process(read_sequence, store.name, b.id, readonly, start_method=method, timeout=60) == want
    if method == "fork":
        assert run_in_process(read_inherited, b, 3, start_method="fork", timeout=60) == want


def test_a_borrower_made_after_the_reader_attached(make_store):
    store = sharing_store(make_store)
    reader = shmkv.attach(store.name, readonly=True)
    try:
        rng = np.random.default_rng(10)
        _, prompt = make_donor(store, rng)
        b = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [1]]))
        seen = reader.sequence(b.id)
        assert [seen.keys(i).tobytes() for i in range(3)] == [b.keys(i).tobytes() for i in range(3)]
        b.truncate(3)  # un-shared here; the reader re-maps at its next read
        k, v = kv_pair(rng, 10)
        b.extend(k, v)
        assert [seen.keys(i).tobytes() for i in range(3)] == [b.keys(i).tobytes() for i in range(3)]
    finally:
        reader.close()


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_cells_of_a_freed_borrower_reused_by_another_process_read_right(make_store, dtype, readonly,
                                                                         start_method, tmp_path):
    """This process mapped borrower F's span; another process frees F and writes a new sequence G
    on F's very cells. Every read path of G here gives G's bytes, not the donor's (a stale alias),
    and so does a snapshot saved here; a write here (truncate + extend on G) lands in G only."""
    store = sharing_store(make_store, dtype)
    d, f = _with_borrower(store)
    reader = shmkv.attach(store.name, readonly=True) if readonly else store
    try:
        rf = reader.sequence(f.id)
        assert _same(_content(rf), _content(d))  # F's span mapped in this process now
        eng = engine_of(store)
        f_start = int(eng.row(eng.slot_of(f.id))[START])
        f.release()
        gid, g_start = run_in_process(free_and_reuse, store.name, f.id, 1024, 7, 200, start_method=start_method,
                                      timeout=60)
        assert g_start == f_start  # (G on F's very cells: the case this test is about)
        ref = _reference(make_store, dtype, 7, 200, tokens=np.arange(5000, 5200))
        g = reader.sequence(gid)
        want = _content(ref)
        assert _same(_content(g), want)
        for layer in range(L):
            k, v = g.kv(layer)
            assert (k.tobytes(), v.tobytes()) == want[layer]
            tk, tv = g.torch_kv(layer)
            rk, rv = ref.torch_kv(layer)
            assert tk.numpy().tobytes() == rk.numpy().tobytes() and tv.numpy().tobytes() == rv.numpy().tobytes()
        if dtype == "float16":
            K, V = reader.batch_kv([g], 1)
            assert (K[0].tobytes(), V[0].tobytes()) == want[1]
        path = str(tmp_path / "g.snap")
        reader.save(path, seq_ids=[gid])
        loaded = sharing_store(make_store, dtype)
        loaded.restore(path)
        assert _same(_content(loaded.sequence(gid)), want)
        if not readonly:  # this process writes G after the other process's change
            w = store.sequence(gid, write=True)
            w.truncate(150)
            ref.truncate(150)
            k, v = kv(9, L, 30, H, D)
            w.extend(k, v)
            ref.extend(k, v)
            assert _same(_content(w), _content(ref))
        assert _same(_content(d), _content(_reference(make_store, dtype, 1, PROMPT)))  # the donor intact
    finally:
        if readonly:
            reader.close()


def test_a_fork_child_with_inherited_spans_reads_cells_its_parent_reused(make_store):
    """The parent maps a borrower's span, forks (the child inherits the mappings and the epoch),
    then frees the borrower and writes a new sequence on its cells: the child reads the new bytes."""
    import multiprocessing as mp

    from procs.share_reads import read_inherited_after

    from shmkv.testing import start_in_process

    store = sharing_store(make_store)
    d, f = _with_borrower(store)
    assert _same(_content(f), _content(d))
    eng = engine_of(store)
    f_start = int(eng.row(eng.slot_of(f.id))[START])
    recv, send = mp.get_context("fork").Pipe(duplex=False)
    child = start_in_process(read_inherited_after, store, recv, start_method="fork", timeout=60)
    try:
        f.free()
        g = store.create_sequence(capacity=1024)
        assert int(eng.row(eng.slot_of(g.id))[START]) == f_start
        k, v = kv(7, L, 200, H, D)
        g.extend(k, v)
        send.send(g.id)
        got = child.result()
    finally:
        send.close()
        recv.close()
    want = _content(_reference(make_store, "float16", 7, 200))
    assert got == tuple(a + b for a, b in want) and _same(_content(g), want)


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


def test_a_child_forked_while_a_thread_holds_the_span_lock_reads_right(make_store):
    """A child forked while another thread is inside Shares.sync/apply (holding the span lock)
    reads after the span epoch moved: it gets a fresh lock, not the held copy."""
    st = sharing_store(make_store)
    d, p = seeded_donor(st)
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


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
@pytest.mark.parametrize("readonly", [True, False])
def test_a_reader_in_another_pid_namespace_reads_the_borrower(make_store, readonly):
    store = sharing_store(make_store)
    d, f = _with_borrower(store)
    f.release()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from procs.share_reads import digest; "
            "print(*digest(sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1'))")
    out = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", code,
                          os.path.dirname(__file__), store.name, str(f.id), "1" if readonly else "0"],
                         capture_output=True, text=True, timeout=60, check=True)
    h, n = out.stdout.split()
    assert (h, int(n)) == digest(store.name, d.id, True)


def test_a_process_with_sharing_off_reads_and_copies_on_write_borrowers(make_store):
    """SHMKV_SHARE=0 in one process: it still follows the spans others made (reads them, copies on
    write when it truncates one), and its own reuses copy."""
    store = sharing_store(make_store)
    _, prompt = token_donor(store, capacity=1024)
    f = store.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
    f.release()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from procs.share_reads import cow_and_reuse; "
            "print(cow_and_reuse(sys.argv[2], int(sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), store.name, str(f.id)],
                         env={**os.environ, "SHMKV_SHARE": "0"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) == 96 == store.stats().shared_tokens  # f keeps 96 cells shared; the reuse copied
    assert len(store.sequences()) == 3
    for info in store.sequences():
        assert holds_token_kv(store.sequence(info.id)) is True


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_the_span_sync_reads_a_table_that_another_process_writes_meanwhile(make_store, method):
    """A lock-free span sync (``Shares.wanted``) reads the live table while other processes write
    it: it works on a copy of the span column (numpy's nonzero over the live column raised
    "number of non-zero array elements changed" when a count changed between its passes)."""
    import multiprocessing as mp

    from procs.share_reads import flip_free_rows_span_words

    store = make_store(layers=1, kv_heads=1, head_dim=8, max_tokens=8192, max_seqs=4096)
    ctx = mp.get_context(method)
    started, stop, flips = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    child = ctx.Process(target=flip_free_rows_span_words, args=(store.name, started, stop, flips))
    child.start()
    try:
        assert started.wait(60)
        shares = engine_of(store).shares
        for _ in range(3000):
            assert shares.wanted() == {}  # (free rows: none wanted, whatever their span word says)
    finally:
        stop.set()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0 and flips.value > 0


# -- after structural operations, equal to copies ------------------------------------------------------


OPS = ["remove", "shift_left", "truncate", "clear", "copy_prefix_into_borrower", "copy_prefix_into_donor",
       "fork_borrower", "restore_donor"]


def _apply(op, store, donor, borrower, tmp_path):
    """Run ``op`` on a donor (write handle) and a borrower; returns extra sequences to compare."""
    if op == "remove":
        donor.remove(10, 20)
        borrower.remove(5, 7)
    elif op == "shift_left":
        donor.shift_left(3)
        borrower.shift_left(5)
    elif op in ("truncate", "clear"):
        for s, n, seed in ((donor, 100, 11), (borrower, 77, 12)):
            s.truncate(n) if op == "truncate" else s.clear()
            k, v = kv(seed, L, 50, H, D)
            s.extend(k, v)
    elif op in ("copy_prefix_into_borrower", "copy_prefix_into_donor"):
        o = store.create_sequence(capacity=1024)
        k, v = kv(5, L, 200, H, D)
        o.extend(k, v, tokens=np.arange(200))
        store.copy_prefix(o.id, (borrower if op == "copy_prefix_into_borrower" else donor).id, 150)
    elif op == "fork_borrower":
        g = borrower.fork()
        k, v = kv(13, L, 20, H, D)
        g.extend(k, v)
        borrower.truncate(9)
        k, v = kv(14, L, 20, H, D)
        borrower.extend(k, v)
        return [g]
    elif op == "restore_donor":
        path = str(tmp_path / "d.snap")
        store.save(path, seq_ids=[donor.id])
        donor.truncate(3)
        k, v = kv(15, L, 40, H, D)
        donor.extend(k, v)
        store.restore(path, seq_ids=[donor.id])
    return []


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_structural_ops_on_donor_and_borrower_equal_copies(make_store, dtype, op, tmp_path):
    """The same operations on a sharing store and on copies (sharing off) give the same bytes:
    donor and borrower each keep their own content, in this process and in a spawned reader."""
    store = sharing_store(make_store, dtype)
    d, f = _with_borrower(store)
    d = store.sequence(d.id, write=True)
    extra = _apply(op, store, d, f, tmp_path)
    share.ENABLED = False
    try:
        rs = sharing_store(make_store, dtype)
        rd, rf = _with_borrower_copy(rs)
        rextra = _apply(op, rs, rd, rf, tmp_path)
    finally:
        share.ENABLED = True
    for got, want in zip([d, f, *extra], [rd, rf, *rextra], strict=True):
        assert _same(_content(got), _content(want))
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.positions, want.positions)
    h, n = run_in_process(digest, store.name, f.id, True, timeout=60)
    assert (h, n) == run_in_process(digest, rs.name, rf.id, True, timeout=60)


def _with_borrower_copy(store):
    prompt = np.arange(1000, 1000 + PROMPT)
    d = store.create_sequence(capacity=1024, prefix=prompt)
    k, v = kv(1, L, PROMPT, H, D)
    d.extend(k, v, tokens=prompt)
    d.finish()
    f = store.create_sequence(capacity=1024, prefix=np.r_[prompt, [7]])
    assert len(f) == PROMPT and store.stats().shared_tokens == 0
    return store.sequence(d.id, write=True), f


# -- views, attachments ------------------------------------------------------------------------------


def _maps_and_fds() -> tuple[int, int]:
    with open("/proc/self/maps") as m:
        return sum(1 for _ in m), len(os.listdir("/proc/self/fd"))


def test_attach_close_cycles_over_borrowers_leak_no_mapping_nor_descriptor(make_store):
    store = sharing_store(make_store)
    d, _ = _with_borrower(store)
    prompt = np.arange(1000, 1000 + PROMPT)
    fs = [store.create_sequence(capacity=1024, prefix=np.r_[prompt, [i]]) for i in range(4)]

    def cycle(n: int) -> None:
        for i in range(n):
            a = shmkv.attach(store.name, readonly=bool(i % 2))
            assert a.sequence(fs[i % 4].id).keys(0).tobytes() == d.keys(0).tobytes()
            a.close()
        gc.collect()

    cycle(4)
    before = _maps_and_fds()
    cycle(24)
    assert _maps_and_fds() == before


def test_a_view_of_a_borrower_outlives_close_and_free(make_store):
    store = sharing_store(make_store)
    d, f = _with_borrower(store)
    want = _content(d)
    a = shmkv.attach(store.name, readonly=True)
    k0 = a.sequence(f.id).keys(0)
    a.close()
    assert k0.tobytes() == want[0][0]  # valid memory after close (never a segfault), same bytes
    del k0
    gc.collect()


def test_a_removed_store_leaves_borrower_views_readable(make_store):
    store = sharing_store(make_store, persistent=True)
    d, f = _with_borrower(store)
    want = _content(d)
    ro = shmkv.attach(store.name, readonly=True)
    views = [(ro.sequence(f.id).keys(i), ro.sequence(f.id).values(i)) for i in range(L)]
    ro.close()
    shmkv.remove(store.name)
    assert [(k.tobytes(), v.tobytes()) for k, v in views] == want
    with pytest.raises(shmkv.StoreNotFound):
        shmkv.attach(store.name)


# -- one process, three readers (rw attachment, ro attachment, the writer's own store object) while
# a writer borrows, copies on write, frees, reuses cells, removes and forks ------------------------


def _writer(store, ops: int, rng) -> int:
    prompt = np.arange(1000, 1300)
    spans = 0
    for _ in range(ops):
        live = [s.id for s in store.sequences() if s.id != 1]
        op = 1 if len(live) > 16 else int(rng.integers(0, 5))
        if op == 0 or len(live) < 2:  # a borrower (shares when the match covers a page unit)
            toks = np.r_[prompt[: rng.integers(20, 300)], 9000 + rng.integers(0, 1000, 5)]
            f = store.create_sequence(capacity=512, prefix=toks)
            k, v = kv_of_tokens(toks[len(f):])
            f.extend(k, v, tokens=toks[len(f):])
            f.release()
        elif op == 1:  # free one, and a new sequence likely on its cells
            store.sequence(int(rng.choice(live)), write=True).free()
            toks = 5000 + rng.integers(0, 3000, rng.integers(10, 400))
            g = store.create_sequence(capacity=512)
            k, v = kv_of_tokens(toks)
            g.extend(k, v, tokens=toks)
            g.release()
        elif op == 2:  # truncate (copy-on-write inside a span) and extend
            s = store.sequence(int(rng.choice(live)), write=True)
            s.truncate(int(rng.integers(0, len(s) + 1)))
            toks = 7000 + rng.integers(0, 1000, rng.integers(1, 50))
            k, v = kv_of_tokens(toks)
            s.extend(k, v, tokens=toks)
            s.release()
        elif op == 3:
            s = store.sequence(int(rng.choice(live)), write=True)
            if len(s) > 10:
                s.remove(int(rng.integers(0, 5)), int(rng.integers(5, 10)))
            s.release()
        else:
            s = store.sequence(int(rng.choice(live)))
            if len(s):
                s.fork().release()
        spans += store.stats().shared_tokens > 0
    return spans


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_threads_reading_while_spans_come_and_go(make_store, seed):
    import threading

    store = sharing_store(make_store, max_tokens=32768)
    token_donor(store)
    done = threading.Event()
    results: list[dict[str, int]] = []

    def reader(mode: str) -> None:
        s = store if mode == "same" else shmkv.attach(store.name, readonly=mode == "ro")
        got = {"ok": 0, "bad": 0}
        try:
            while not done.is_set() or not got["ok"]:
                for info in s.sequences():
                    try:
                        r = holds_token_kv(s.sequence(info.id))
                    except shmkv.SequenceNotFound:
                        continue
                    if r is not None:
                        got["ok" if r else "bad"] += 1
        finally:
            if s is not store:
                s.close()
            results.append(got)

    threads = [threading.Thread(target=reader, args=(m,), daemon=True) for m in ("rw", "ro", "same")]
    for t in threads:
        t.start()
    try:
        spans = _writer(store, 300, np.random.default_rng(seed))
    finally:
        done.set()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert spans > 10  # (the writer's operations ran over shared pages)
    assert len(results) == 3 and all(r["ok"] for r in results)
    assert sum(r["bad"] for r in results) == 0, results


def test_a_reader_thread_beside_borrows_and_unshares(make_store):
    """Threads of one process share its mappings: a thread reading borrowers while another makes,
    un-shares and frees them reads every committed token's own K/V."""
    import threading

    store = sharing_store(make_store)
    rng = np.random.default_rng(14)
    d, prompt = make_donor(store, rng)
    want = [np.asarray(d.keys(i)).copy() for i in range(3)]
    keep = store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [1]]))
    stop, errors = threading.Event(), []

    def read() -> None:
        try:
            while not stop.is_set():
                k, _ = store.sequence(keep.id).read(1)
                if not np.array_equal(k[:PROMPT], want[1]):
                    errors.append("wrong keys")
        except BaseException as e:  # (reported below)
            errors.append(repr(e))

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(40):
            b = store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [2 + i]]))
            b.truncate(int(rng.integers(0, PROMPT)))
            b.free()
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive() and errors == []


# -- allocation and eviction under pressure: spans never overlap what others write ---------------------


def _invariants(store) -> str | None:
    """No two live ranges overlap; a span's cells, and those a truncated borrower keeps taken
    (``SPAN_TAKEN``), are in no live range but their owner's (the row at the span's first cell,
    borrowing nothing, at least that long: it never writes them; or shorter and still flagged
    LENT: a lender that truncated below what it lent with no free range to move to, which writes
    nothing past its length until it moves, tests/test_sharing_lenders.py)."""
    from shmkv._engine.table.header import (CAPACITY, FLAGS, ID, LENGTH, LENT, LIVE, SPAN_CELLS, SPAN_PHYS,
                                            SPAN_TAKEN, STATE)

    t = engine_of(store).table_np
    live = t[t[:, STATE] == LIVE]
    ranges = sorted((int(r[START]), int(r[START] + r[CAPACITY]), int(r[ID])) for r in live)
    for (_, a1, i), (b0, _, j) in itertools.pairwise(ranges):
        if a1 > b0:
            return f"the ranges of sequences {i} and {j} overlap"
    for r in live[live[:, SPAN_TAKEN] > 0]:
        p, m = int(r[SPAN_PHYS]), int(r[SPAN_TAKEN])
        if r[SPAN_CELLS] > m:
            return f"sequence {r[ID]} maps {r[SPAN_CELLS]} span cells and keeps only {m} taken"
        for x in live:
            xs, xe = int(x[START]), int(x[START] + x[CAPACITY])
            if x[ID] == r[ID] or xe <= p or xs >= p + m:
                continue
            if not (xs == p and not x[SPAN_CELLS] and (x[LENGTH] >= m or x[FLAGS] & LENT)):
                return f"span [{p}, {p + m}) of {r[ID]} overlaps sequence {x[ID]} [{xs}, {xe}) of length {x[LENGTH]}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 4])
def test_a_full_store_evicting_donors_and_borrowers_keeps_every_cell(make_store, seed):
    """A store of 3,072 cells: borrowers of two prompts created, truncated (copy-on-write), freed,
    removed from, shifted, finished and evicted at random; after every operation the table's
    invariants hold and every cell of every sequence holds its token's K/V."""
    rng = np.random.default_rng(seed)
    store = sharing_store(make_store, max_tokens=3072, max_seqs=24)
    prompts = [np.arange(1000, 1400), np.arange(2000, 2300)]
    spans = 0
    for it in range(300):
        live = [s.id for s in store.sequences()]
        op = int(rng.integers(0, 7))
        s = None
        try:
            if op <= 2 or not live:
                p = prompts[int(rng.integers(0, 2))]
                toks = np.r_[p[: rng.integers(1, len(p))], 9000 + rng.integers(0, 1000, rng.integers(1, 40))]
                s = store.create_sequence(capacity=int(rng.integers(len(toks), len(toks) + 64)), prefix=toks)
                k, v = kv_of_tokens(toks[len(s):])
                s.extend(k, v, tokens=toks[len(s):])
                s.finish() if rng.random() < 0.7 else s.release()
            elif op == 3:
                s = store.sequence(int(rng.choice(live)), write=True)
                s.truncate(int(rng.integers(0, len(s) + 1)))
                toks = 7000 + rng.integers(0, 999, rng.integers(1, 60))
                k, v = kv_of_tokens(toks)
                s.extend(k, v, tokens=toks)
                s.finish() if rng.random() < 0.5 else s.release()
            elif op == 4:
                store.sequence(int(rng.choice(live)), write=True).free()
            elif op == 5:
                s = store.sequence(int(rng.choice(live)), write=True)
                if len(s) > 10:
                    s.remove(int(rng.integers(0, 5)), int(rng.integers(5, 10)))
                s.finish()
            else:
                s = store.sequence(int(rng.choice(live)), write=True)
                if len(s) > 5:
                    s.shift_left(int(rng.integers(1, 5)))
                s.release()
        except shmkv.CacheFullError:
            if s is not None:
                s.release()
        spans += store.stats().shared_tokens > 0
        assert _invariants(store) is None, (it, _invariants(store))
        for info in store.sequences():
            assert holds_token_kv(store.sequence(info.id)) is True, (it, info)
    assert spans > 100 and store.stats().evictions > 50


# -- the remote tier pushes the logical content of a borrower, and of cells reused after one ---------


def test_remote_push_of_borrowers_and_of_cells_reused_after_one(make_store):
    if shutil.which("redis-server") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is needed: CI must run this", pytrace=False)
        pytest.skip("needs redis-server")
    pytest.importorskip("redis")
    from shmkv.remote import RemoteTier
    from shmkv.testing._redis import RedisServer

    server = RedisServer()
    tier = RemoteTier(server.url, namespace="atk", chunk_tokens=64)
    try:
        store = sharing_store(make_store)
        _, f = _with_borrower(store)
        f.release()
        assert tier.push(store, f.id) == PROMPT // 64  # the borrower's chunks: its logical content
        # another process frees the borrower and writes a new prompt on its cells; pushed from here
        gid, _ = run_in_process(free_and_reuse, store.name, f.id, 1024, 7, 200, timeout=60)
        assert tier.push(store, gid) == 200 // 64
        other = sharing_store(make_store)
        for toks, seed, n in ((np.arange(1000, 1000 + PROMPT), 1, PROMPT), (np.arange(5000, 5200), 7, 200)):
            got = other.create_sequence(capacity=1024, prefix=np.r_[toks, [1]], tier=tier)
            whole = n // 64 * 64
            assert len(got) == whole
            ref = _reference(make_store, "float16", seed, n)
            for layer in range(L):
                assert got.keys(layer).tobytes() == ref.keys(layer)[:whole].tobytes()
                assert got.values(layer).tobytes() == ref.values(layer)[:whole].tobytes()
            got.free()
    finally:
        tier.close()
        server.stop()
