"""Attacks on shared prefix pages (issue 23, design B: a borrower's first cells remapped in place
in every process) that hold: each read is compared bit for bit with a reference built without
sharing (a store of the same layout, or a copy), across processes, after the cells a process
mapped as a span were freed and reused by another process, and after structural operations
on donors and borrowers. (Attacks that failed: /work/atk2-findings, not here.)"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _share_attack_children import digest, free_and_reuse, kv

import shmkv
from shmkv._engine import share
from shmkv._engine.header import START
from shmkv.store._store import engine_of
from shmkv.testing import run_in_process

L, H, D = 3, 4, 64  # float16: 512 bytes a cell, a page unit of 8 cells
PROMPT = 300


def _store(make_store, dtype="float16", **kw):
    return make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=32, **kw)


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
        ref = _store(make_store, dtype)
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


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_cells_of_a_freed_borrower_reused_by_another_process_read_right(make_store, dtype, readonly,
                                                                         start_method, tmp_path):
    """This process mapped borrower F's span; another process frees F and writes a new sequence G
    on F's very cells. Every read path of G here gives G's bytes, not the donor's (a stale alias),
    and so does a snapshot saved here; a write here (truncate + extend on G) lands in G only."""
    store = _store(make_store, dtype)
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
        assert g_start == f_start  # the attack needs G on F's cells
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
        loaded = _store(make_store, dtype)
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


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_structural_ops_on_donor_and_borrower_equal_copies(make_store, dtype, op, tmp_path):
    """The same operations on a sharing store and on copies (sharing off) give the same bytes:
    donor and borrower each keep their own content, in this process and in a spawned reader."""
    store = _store(make_store, dtype)
    d, f = _with_borrower(store)
    d = store.sequence(d.id, write=True)
    extra = _apply(op, store, d, f, tmp_path)
    share.ENABLED = False
    try:
        rs = _store(make_store, dtype)
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


def _maps_and_fds() -> tuple[int, int]:
    with open("/proc/self/maps") as m:
        return sum(1 for _ in m), len(os.listdir("/proc/self/fd"))


def test_attach_close_cycles_over_borrowers_leak_no_mapping_nor_descriptor(make_store):
    store = _store(make_store)
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
    store = _store(make_store)
    d, f = _with_borrower(store)
    want = _content(d)
    a = shmkv.attach(store.name, readonly=True)
    k0 = a.sequence(f.id).keys(0)
    a.close()
    assert k0.tobytes() == want[0][0]  # valid memory after close (never a segfault), same bytes
    del k0
    gc.collect()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
@pytest.mark.parametrize("readonly", [True, False])
def test_a_reader_in_another_pid_namespace_reads_the_borrower(make_store, readonly):
    store = _store(make_store)
    d, f = _with_borrower(store)
    f.release()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from _share_attack_children import digest; "
            "print(*digest(sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1'))")
    out = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", code,
                          os.path.dirname(__file__), store.name, str(f.id), "1" if readonly else "0"],
                         capture_output=True, text=True, timeout=60, check=True)
    h, n = out.stdout.split()
    assert (h, int(n)) == digest(store.name, d.id, True)
