"""The automatic prefix cache (docs/design.md §8): reuse by token ids, across processes, with LRU
eviction."""

from __future__ import annotations

import os

import numpy as np
import pytest
from procs.prefix import check, kv_for, match_readonly, serve, serve_and_finish, stress_worker

import shmkv
from shmkv.testing import run_in_process, start_in_process


def prompt(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 30_000, n).astype(np.int64)


def finished_requests(store: shmkv.Store, prompts: list[np.ndarray], capacity: int) -> list[int]:
    """Serve and finish one request per prompt, in order; their ids (oldest use first)."""
    ids = []
    for p in prompts:
        s, _ = serve(store, p, capacity=capacity)
        s.finish()
        ids.append(s.id)
    return ids


@pytest.fixture
def big(make_store):
    return make_store(layers=3, kv_heads=2, head_dim=4, max_tokens=8192, max_seqs=32)


def test_token_granular_reuse_equals_recompute(big):
    rng = np.random.default_rng(1)
    system = prompt(rng, 300)  # not a multiple of 16
    a_prompt = np.concatenate([system, prompt(rng, 37)])
    a, n = serve(big, a_prompt)
    assert n == 0
    a.finish()
    b_prompt = np.concatenate([system, prompt(rng, 50) + 30_000])  # differs right after token 299
    assert big.match_prefix(b_prompt) == 300
    b, n = serve(big, b_prompt)
    assert n == 300
    check(b, b_prompt, big.layout)  # reused K/V, ids and positions equal a full recompute
    st = big.stats()
    assert (st.prefix_hits, st.prefix_misses, st.prefix_tokens_reused) == (1, 1, 300)
    # ends inside a block too: 5 tokens past the last whole block of a third prompt
    c_prompt = np.concatenate([b_prompt[:333], [7, 7, 7]])
    assert big.match_prefix(c_prompt) == 333


def test_caps_and_misses(big):
    rng = np.random.default_rng(2)
    p = prompt(rng, 64)
    a, _ = serve(big, p)
    a.finish()
    assert big.match_prefix(p) == 63  # identical: len - 1, one token left to compute
    s = big.create_sequence(capacity=80, prefix=p)
    assert len(s) == 63
    np.testing.assert_array_equal(s.keys(1), kv_for(p, 3, 2, 4)[0][1, :63])
    s.free()
    q = p.copy()
    q[0] += 1
    assert big.match_prefix(q) == 0  # differs at token 0
    assert big.match_prefix(p[:1]) == 0 and big.match_prefix([]) == 0
    assert len(big.create_sequence(capacity=4, prefix=p[:1])) == 0
    # token-granular from token 0: below one block too
    assert [big.match_prefix(p[:k]) for k in (17, 16, 9, 5, 2)] == [16, 15, 8, 4, 1]
    with pytest.raises(shmkv.InvalidArgumentError, match="token ids"):
        big.match_prefix([[1, 2]])
    with pytest.raises(shmkv.InvalidArgumentError, match=">= 0"):
        big.create_sequence(capacity=4, prefix=[1, -1, 2])


def test_sequences_without_ids_or_moved_tokens_are_never_donors(big):
    rng = np.random.default_rng(3)
    p = prompt(rng, 48)
    k, v = kv_for(p, 3, 2, 4)
    anon = big.create_sequence(capacity=64)
    anon.extend(k, v)  # no token ids: -1, never matches
    assert big.match_prefix(p) == 0
    s, _ = serve(big, p)
    assert big.match_prefix(p) == 47
    s.remove(10, 12)  # the later tokens' context changed: only tokens before 10 may be given
    assert big.match_prefix(p) == 10  # below one block: found through its leads
    b, n = serve(big, p)
    assert n == 10
    check(b, p, big.layout)  # the 10 reused tokens are the faithful ones
    b.free()
    s.truncate(5)
    s.extend(k[:, 5:], v[:, 5:], tokens=p[5:])  # recomputed: a donor again
    assert big.match_prefix(p) == 47
    s.shift_left(1)
    assert big.match_prefix(p) == 0
    s.truncate(0)
    s.extend(k, v, tokens=p)
    s.truncate(20)
    assert big.match_prefix(p) == 20  # truncated donors give what they still hold


def test_eviction_is_lru_and_spares_the_donor(make_store):
    # room for exactly ten requests of 64 cells
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=640, max_seqs=16)
    rng = np.random.default_rng(4)
    prompts = [prompt(rng, 60) for _ in range(10)]
    ids = finished_requests(store, prompts, capacity=64)
    # use request 0 as a donor (a use): request 1 is now the least recently used
    d, n = serve(store, np.concatenate([prompts[0][:40], prompt(rng, 10)]), capacity=40)
    assert n == 40
    # the store was full: making room for d evicted exactly the least recently used (1), not the donor
    assert store.stats().evictions == 1
    with pytest.raises(shmkv.SequenceNotFound):
        store.sequence(ids[1])
    d.finish()
    # an eleventh request whose donor is now the LRU one (2): the next one (3) goes instead
    e, n = serve(store, np.concatenate([prompts[2][:33], prompt(rng, 20)]), capacity=64)
    assert n == 33
    live = {i.id for i in store.sequences()}
    assert ids[2] in live and ids[3] not in live and ids[4] in live
    assert store.stats().evictions == 2
    e.release()  # released, not finished: never evictable
    # fill with leased sequences only: then CacheFullError, and nothing is evicted
    leased = [e]
    while True:
        before = store.stats()
        try:
            leased.append(store.create_sequence(capacity=64))
        except shmkv.CacheFullError:
            break
    assert store.stats().evictions == before.evictions
    assert all(not i.finished for i in store.sequences())
    with pytest.raises(shmkv.CacheFullError):
        store.create_sequence(capacity=64, prefix=prompts[5])
    assert store.stats().evictions == before.evictions


def test_eviction_order_exact(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=320, max_seqs=16)
    rng = np.random.default_rng(5)
    ids = finished_requests(store, [prompt(rng, 30) for _ in range(10)], capacity=32)
    order = [5, 2, 8, 0]  # take some back and finish them again: they become the most recent
    for i in order:
        store.sequence(ids[i], write=True).finish()
    evicted, held = [], []
    for _ in range(10):
        live = {i.id for i in store.sequences()}
        held.append(store.create_sequence(capacity=32))  # the store is full: each create evicts
        gone = live - {i.id for i in store.sequences()}
        assert len(gone) == 1  # only as many as needed
        evicted.append(ids.index(gone.pop()))
    assert evicted == [1, 3, 4, 6, 7, 9, 5, 2, 8, 0]
    assert store.stats().evictions == 10


def test_a_finished_sequence_taken_back_continues_and_is_not_evicted(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=256, max_seqs=8)
    rng = np.random.default_rng(6)
    turn1 = prompt(rng, 40)
    s, _ = serve(store, turn1, capacity=128)
    s.finish()
    assert store.sequences()[0].finished
    s = store.sequence(s.id, write=True)  # the chat's next turn
    assert not store.sequences()[0].finished
    turn2 = np.concatenate([turn1, prompt(rng, 30)])
    k, v = kv_for(turn2, 2, 2, 4)
    s.extend(k[:, 40:], v[:, 40:], tokens=turn2[40:])
    check(s, turn2, store.layout)
    with pytest.raises(shmkv.CacheFullError):  # it is not evicted to make room
        store.create_sequence(capacity=200)
    assert store.sequence(s.id).length == 70
    s.finish()
    assert store.match_prefix(np.concatenate([turn2, [1]])) == 70


@pytest.mark.parametrize("start_method", ["spawn"])
def test_across_processes_both_ways(big, start_method):
    rng = np.random.default_rng(7)
    system = prompt(rng, 200)
    p1 = np.concatenate([system, prompt(rng, 20)])
    _, reused = run_in_process(serve_and_finish, big.name, p1.tolist(), start_method=start_method, timeout=120)
    assert reused == 0
    p2 = np.concatenate([system, prompt(rng, 30)])
    assert run_in_process(match_readonly, big.name, p2.tolist(), start_method=start_method, timeout=120) == 200
    s, n = serve(big, p2)  # this process reuses what the child computed
    assert n == 200
    check(s, p2, big.layout)
    s.finish()
    p3 = np.concatenate([p2, prompt(rng, 5)])
    _, reused = run_in_process(serve_and_finish, big.name, p3.tolist(), start_method=start_method, timeout=120)
    assert reused == len(p2)  # ... and the child reuses what this process computed
    assert big.stats().prefix_hits == 2


def test_sliding_layers_cut_the_match_back_to_a_resumable_point(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=512, max_seqs=8,
                       layer_types=["full", "sliding"], window=8, memory=16)
    rng = np.random.default_rng(8)
    p = prompt(rng, 100)
    k, v = kv_for(p, 2, 2, 4)
    s = store.create_sequence(capacity=128)
    for i in range(0, 100, 10):  # the window buffer compacts: it holds only the last tokens
        s.extend(k[:, i : i + 10], v[:, i : i + 10], tokens=p[i : i + 10])
    s.finish()
    held_from = int(s.held_positions(1)[0])
    assert held_from > 0
    q = np.concatenate([p[:50], [1, 2, 3]])  # 50 tokens match, but the window no longer holds 43..49
    assert store.match_prefix(q) == 0
    assert store.match_prefix(p) == 99  # the whole history still resumes at the end
    t = store.create_sequence(capacity=128, prefix=p)
    assert len(t) == 99 and t.can_resume(99)


@pytest.mark.slow
def test_many_processes_create_finish_and_match(make_store):
    """Several processes serve overlapping prompts at once; every reuse is checked against a recompute."""
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=6000, max_seqs=48)
    rng = np.random.default_rng(9)
    prompts = [prompt(rng, int(n)).tolist() for n in rng.integers(20, 200, 6)]
    seconds = float(os.environ.get("SHMKV_STRESS_SECONDS", "30"))
    kids = [start_in_process(stress_worker, store.name, seed, seconds, prompts, start_method=m, timeout=seconds + 120)
            for seed, m in enumerate(["fork", "spawn", "forkserver"])]
    results = [k.result() for k in kids]
    assert sum(r["requests"] for r in results) > 30
    assert sum(r["hits"] for r in results) > 0
    st = store.stats()
    assert st.prefix_hits == sum(r["hits"] for r in results)
    assert st.prefix_tokens_reused == sum(r["reused"] for r in results)
    from shmkv import cli

    assert cli.verify(store) == []


def test_a_snapshot_keeps_the_prefix_cache_warm(make_store, tmp_path):
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=320, max_seqs=16)
    rng = np.random.default_rng(10)
    prompts = [prompt(rng, 30) for _ in range(10)]
    ids = finished_requests(store, prompts, capacity=32)
    store.sequence(ids[0], write=True).finish()  # 0 is now the most recent
    live, _ = serve(store, prompt(rng, 20), capacity=1)  # a leased, unfinished one (not evictable); evicts 1
    live.release()
    path = tmp_path / "warm.shmkv"
    store.save(path)
    other = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=320, max_seqs=16)
    other.restore(path)
    assert [(i.id, i.finished) for i in other.sequences()] == [(i.id, i.finished) for i in store.sequences()]
    for p in prompts[2:] + prompts[:1]:
        assert other.match_prefix(p) == 29  # warm: every cached request is found again
    # the eviction order survived the round trip: 2 is the least recently used now, then 3, 4
    for expected in ids[2:5]:
        live_ids = {i.id for i in other.sequences()}
        s = other.create_sequence(capacity=30)  # the store is full: each create evicts one
        assert live_ids - {i.id for i in other.sequences()} == {expected}
    q = np.concatenate([prompts[6][:25], [5]])
    s, n = serve(other, q, capacity=30)
    assert n == 25
    check(s, q, other.layout)
    loaded = shmkv.load(path, name=f"{store.name[:20]}w")
    try:
        assert loaded.match_prefix(prompts[0]) == 29
    finally:
        loaded.close()
        shmkv.remove(loaded.name) if loaded.name in shmkv.list_stores() else None


@pytest.mark.slow
def test_info_shows_the_prefix_cache(big):
    import json
    import subprocess
    import sys

    rng = np.random.default_rng(11)
    p = prompt(rng, 40)
    a, _ = serve(big, p)
    a.meta = {"request": "r-1"}
    a.finish()
    b, n = serve(big, np.concatenate([p[:35], [9]]))
    assert n == 35
    shmkv_bin = os.path.join(os.path.dirname(sys.executable), "shmkv")
    r = subprocess.run([shmkv_bin, "info", big.name, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["stats"]["prefix_hits"] == 1 and d["stats"]["prefix_tokens_reused"] == 35
    assert [(s["id"], s["finished"], s["meta"]) for s in d["sequences"]] == [(a.id, True, {"request": "r-1"}),
                                                                              (b.id, False, {})]
    r = subprocess.run([shmkv_bin, "info", big.name], capture_output=True, text=True, timeout=60)
    assert "prefix cache: 1 hits, 1 misses, 35 tokens reused; 1 finished" in r.stdout
    assert 'finished' in r.stdout.splitlines()[-2] and '"request": "r-1"' in r.stdout


@pytest.mark.parametrize("lru", ["dst", "src"])
def test_copy_prefix_never_evicts_its_own_source_or_destination(make_store, lru):
    """copy_prefix into a finished, unleased destination that is the least recently used (or from
    such a source) never evicts it to make room for itself: when copy_prefix returns, dst is there."""
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=320, max_seqs=16)
    rng = np.random.default_rng(6)
    prompts = [prompt(rng, 30) for _ in range(10)]
    ids = finished_requests(store, prompts, capacity=32)  # the store is full of finished requests
    src, dst = (ids[9], ids[0]) if lru == "dst" else (ids[0], ids[1])
    store.copy_prefix(src, dst, 20)  # dst holds tokens: the copy needs a fresh range, so an eviction
    live = {i.id for i in store.sequences()}
    assert src in live and dst in live
    gone = set(ids) - live
    assert gone == ({ids[1]} if lru == "dst" else {ids[2]})  # the least recently used of the others
    d = store.sequence(dst)
    assert d.tokens.tolist() == prompts[ids.index(src)][:20].tolist()
    assert store.stats().evictions == 1
