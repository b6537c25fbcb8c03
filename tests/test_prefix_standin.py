"""Lazy index entries of copied prefixes (a create over a cached prefix must not insert
an index entry for every block it reused). A sequence created from a donor's prefix (a reuse,
copy_prefix, fork) gets no entries for the blocks it copied: the donor's entries stand for them
(FLAGS STANDIN), and when the donor stops holding them (freed, evicted, truncated, rewritten by
remove/shift_left/copy_prefix/restore) the copies get entries of their own first. So a match keeps
finding every live holder, in every process, also after a crash half-way through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from procs.prefix import check, kv_for, serve

import shmkv
from shmkv import cli
from shmkv._engine.table import header as _header
from shmkv._engine.prefixes.index import LEADMARK
from shmkv._engine.prefixes.hashes import BLOCK, LEAD
from shmkv.testing import run_in_process

HERE = os.path.dirname(__file__)
# float32, 2 KV heads x 128 dims: 1 KiB a cell, a page unit of 4 cells (reuses borrow pages)
LAYOUT = dict(layers=2, kv_heads=2, head_dim=128, dtype="float32", max_tokens=2048, max_seqs=16)


def P(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.int64)


def uncovered(store: shmkv.Store) -> list[tuple[int, int]]:
    """(sequence id, block or LEADMARK | j) of every block or lead a live sequence has indexed
    that no valid index entry names: the lookup could not reach it (the invariant this keeps)."""
    e = store._engine
    t, hashes, index = e.table_np, e._hashes, e.index
    out = []
    for slot in np.flatnonzero(t[:, _header.STATE] == _header.LIVE).tolist():
        row = t[slot]
        start = int(row[_header.START])
        for blk in range(int(row[_header.IDX_BLOCKS])):
            if not index.holders(int(hashes[start + (blk + 1) * BLOCK - 1])):
                out.append((int(row[_header.ID]), blk))
        for j in LEAD[: _header.leads(int(row[_header.FLAGS]))]:
            if not index.holders(int(hashes[start + j - 1])):
                out.append((int(row[_header.ID]), LEADMARK | j))
    return out


def entries_of(store: shmkv.Store, seq_id: int) -> int:
    """Valid index entries naming sequence ``seq_id``."""
    e = store._engine
    ent = np.frombuffer(e.index._t, np.int64).reshape(-1, 4)
    return sum(1 for i in np.flatnonzero(ent[:, 1] == seq_id).tolist() if e.index._valid(i))


@pytest.fixture
def st(make_store):
    return make_store(**LAYOUT)


def _donor_and_copies(st, copies=3, system_n=64, own=20):
    """A finished donor of ``system_n`` tokens and ``copies`` released requests that reused it."""
    system = P(1, system_n)
    d, _ = serve(st, system)
    d.finish()
    reqs = []
    for i in range(copies):
        p = np.concatenate([system, P(10 + i, own) + 30_000])
        s, n = serve(st, p)
        assert n == system_n
        s.release()
        reqs.append((s.id, p))
    return system, d.id, reqs


def test_a_reuse_inserts_no_entries_for_what_it_copied(st):
    system, did, reqs = _donor_and_copies(st)
    flags = int(st._engine.table_np[st._engine.slot_of(did), _header.FLAGS])
    assert flags & _header.STANDIN
    for sid, p in reqs:  # only the request's own block (tokens 64..79) and nothing it copied
        assert entries_of(st, sid) == 1
        assert st.match_prefix(np.concatenate([p, [5]])) == len(p)
    assert entries_of(st, did) == len(system) // BLOCK + len(LEAD)
    assert uncovered(st) == []


@pytest.mark.parametrize("how", ["free", "evict", "truncate", "shift_left", "remove", "copy_prefix_into",
                                 "restore_over"])
def test_copies_are_found_after_the_donor_stops_holding_the_prefix(st, tmp_path, how):
    system, did, reqs = _donor_and_copies(st)
    q = np.concatenate([system, [7, 7, 7]])
    assert st.match_prefix(q) == len(system)
    snap = tmp_path / "d.shmkv"
    if how == "free":
        st.sequence(did, write=True).free()
    elif how == "evict":  # the donor is the one finished sequence: a create needing a row evicts it
        fillers = []
        while did in [i.id for i in st.sequences()]:
            fillers.append(st.create_sequence(capacity=4))
        assert st.stats().evictions == 1
        for f in fillers:
            f.free()
    elif how == "truncate":
        st.sequence(did, write=True).truncate(10)
    elif how == "shift_left":
        st.sequence(did, write=True).shift_left(1)
    elif how == "remove":
        st.sequence(did, write=True).remove(3, 4, shift=lambda layer, k, d: k)
    elif how == "copy_prefix_into":  # the donor's content replaced by another's
        o, _ = serve(st, P(98, 30))
        st.copy_prefix(o.id, did, 20)
    elif how == "restore_over":  # the donor's content replaced by a snapshot's of the same id
        d = st.sequence(did, write=True)
        st.save(snap, seq_ids=[did])
        d.truncate(0)
        k, v = kv_for(P(97, 30), 2, 2, 128)
        d.extend(k, v, tokens=P(97, 30))
        d.release()
        st.sequence(reqs[0][0], write=True).release()
        st.restore(snap)  # back to the system prompt: a holder again (its own entries)
        st.sequence(did, write=True).truncate(0)  # and gone again: the copies must be found
    assert uncovered(st) == []
    assert st.match_prefix(q) == len(system), how
    for _, p in reqs:
        assert st.match_prefix(np.concatenate([p, [5]])) == len(p)
    s, n = serve(st, np.concatenate([system, P(50, 9)]))  # and reused, equal to a recompute
    assert n == len(system)
    check(s, np.concatenate([system, P(50, 9)]), st.layout)
    # the copies go one by one: the last one is still found
    for sid, _ in reqs:
        st.sequence(sid, write=True).free()
        assert uncovered(st) == []
    assert st.match_prefix(q) == len(system)  # s, the last reuse, still holds it
    s.free()
    assert uncovered(st) == []


def test_a_copys_own_truncate_and_rewrites_keep_the_rest_found(st):
    system, did, reqs = _donor_and_copies(st)
    a, b, c = (st.sequence(sid, write=True) for sid, _ in reqs)
    a.truncate(20)
    b.shift_left(2)
    c.remove(1, 2, shift=lambda layer, k, d: k)
    for s in (a, b, c):
        s.release()
    assert uncovered(st) == []
    st.sequence(did, write=True).free()
    assert uncovered(st) == []
    assert st.match_prefix(np.concatenate([system[:20], [1, 2]])) == 20  # a: its first 20 tokens
    assert st.match_prefix(np.concatenate([system, [1]])) == 20  # nobody holds more of it now


def test_chains_forks_and_copy_prefix(st):
    system, did, reqs = _donor_and_copies(st, copies=1)
    b1, p1 = reqs[0]
    # a request over b1's whole prompt: copies b1's own block too (b1 stands for it)
    p2 = np.concatenate([p1, P(20, 16) + 30_000])
    s2, n = serve(st, p2)
    assert n == len(p1)
    fork = st.sequence(did).fork()  # a fork copies the donor
    dst = st.create_sequence(capacity=80)
    st.copy_prefix(b1, dst.id, 70)
    for s in (s2, dst):
        s.release()
    for gone in (did, b1):
        st.sequence(gone, write=True).free()
        assert uncovered(st) == []
    assert st.match_prefix(np.concatenate([p2, [1]])) == len(p2)
    assert st.match_prefix(np.concatenate([p1, [1]])) == len(p1)
    assert st.match_prefix(np.concatenate([system, [1]])) == len(system)
    s2.free()
    assert st.match_prefix(np.concatenate([p1[:70], [1]])) == 70  # dst (copy_prefix of b1's 70)
    fork.free()
    dst.free()
    assert uncovered(st) == [] and st.match_prefix(np.concatenate([system, [1]])) == 0


def _free_in_child(name: str, sid: int) -> None:
    s = shmkv.attach(name)
    try:
        s.sequence(sid, write=True).free()
    finally:
        s.close()


def test_the_donor_freed_by_another_process(st):
    system, did, _reqs = _donor_and_copies(st)
    run_in_process(_free_in_child, st.name, did)
    assert uncovered(st) == []
    ro = shmkv.attach(st.name, readonly=True)
    try:
        assert ro.match_prefix(np.concatenate([system, [3]])) == len(system)
    finally:
        ro.close()


def test_random_operations_keep_every_holder_found(st):
    """Mixed creates over shared prompts, truncates, removes, shift_lefts, forks, copy_prefix,
    finishes and frees (evictions when full): after each, every block or lead a live sequence has
    indexed has a valid entry, and each live sequence's indexed prefix is matched in full."""
    rng = np.random.default_rng(23)
    prompts = [P(i, int(n)) for i, n in enumerate((70, 40, 9, 33))]
    for step in range(160):
        live = [i.id for i in st.sequences()]
        r = rng.random()
        try:
            if r < 0.35 or not live:
                base = prompts[int(rng.integers(0, len(prompts)))]
                own = P(1000 + step, int(rng.integers(1, 20)))
                p = np.concatenate([base[: int(rng.integers(1, len(base) + 1))], own])
                s, _ = serve(st, p)
                (s.finish if rng.random() < 0.6 else s.release)()
            else:
                sid = int(rng.choice(live))
                x = rng.random()
                if x < 0.15:
                    st.sequence(sid, write=True).free()
                    continue
                s = st.sequence(sid, write=True)
                n = len(s)
                if x < 0.35:
                    s.truncate(int(rng.integers(0, n + 1)))
                elif x < 0.45 and n > 2:
                    s.remove(1, 2, shift=lambda layer, k, d: k)
                elif x < 0.5 and n:
                    s.shift_left(1)
                elif x < 0.65:
                    s.fork(n=int(rng.integers(0, n + 1))).release()
                elif x < 0.75 and len(live) > 1:
                    other = int(rng.choice([i for i in live if i != sid]))
                    src = st.sequence(other)
                    st.copy_prefix(other, sid, int(rng.integers(0, len(src) + 1)))
                (s.finish if rng.random() < 0.5 else s.release)()
        except (shmkv.CacheFullError, shmkv.NotSupportedError):
            pass
        assert uncovered(st) == [], step
    e = st._engine
    for info in st.sequences():
        row = e.table_np[e.slot_of(info.id)]
        k = int(row[_header.IDX_BLOCKS]) * BLOCK
        if k:
            toks = st.sequence(info.id).tokens[:k]
            assert st.match_prefix(np.concatenate([toks, [1]])) >= k


def test_a_crash_while_copies_get_their_entries(make_store):
    """A process killed in the middle of giving the copies their entries (crash point free.rehomed,
    freeing the donor): the store verifies clean, the donor is still there (its free had not
    begun) and still stands for the copies; freeing it then leaves every copy found."""
    st = make_store(**LAYOUT)
    system, did, _reqs = _donor_and_copies(st)
    env = {**os.environ, "SHMKV_CRASH_AT": "free.rehomed",
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import sys, shmkv; s = shmkv.attach(sys.argv[1]); s.sequence(int(sys.argv[2]), write=True).free()")
    r = subprocess.run([sys.executable, "-c", code, st.name, str(did)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -signal.SIGKILL, f"free.rehomed not reached: {r.returncode}\n{r.stderr[-3000:]}"
    with st.transaction():  # the next lock holder recovers
        pass
    assert cli.verify(st) == []
    assert did in [i.id for i in st.sequences()]
    assert uncovered(st) == []
    q = np.concatenate([system, [4, 4]])
    assert st.match_prefix(q) == len(system)
    st.sequence(did, write=True).free()
    assert uncovered(st) == [] and st.match_prefix(q) == len(system)
    s, n = serve(st, q)
    assert n == len(system)
    check(s, q, st.layout)


@pytest.mark.slow
@pytest.mark.parametrize("system_n", [40, 6])  # past two whole blocks; below one block (a lead)
def test_a_copy_that_went_on_inside_a_block_is_matched_in_full(st, system_n):
    """A copy that holds more of a prompt than its source only inside a partial block has no entry
    there (nothing of its own completed a block): the match finds it through its source, which
    stands for it, in every process."""
    system = P(1, system_n)
    d, _ = serve(st, system)
    d.finish()
    p = np.concatenate([system, P(2, 5) + 30_000])
    s, n = serve(st, p)
    assert n == system_n
    s.finish()
    assert st.match_prefix(p) == len(p) - 1
    assert st.match_prefix(np.concatenate([p, [9]])) == len(p)
    assert run_in_process(_match_readonly, st.name, p.tolist()) == len(p) - 1
    s2, n2 = serve(st, np.concatenate([p, [3, 4]]))
    assert n2 == len(p)
    check(s2, np.concatenate([p, [3, 4]]), st.layout)


def _match_readonly(name: str, prompt: list[int]) -> int:
    s = shmkv.attach(name, readonly=True)
    try:
        return s.match_prefix(prompt)
    finally:
        s.close()
