"""Token-granular prefix reuse from token 0 (docs/design.md §8): prefixes shorter than one
16-token block are found through the index's leads (a sequence's first 1, 2, 4, 8 tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from procs.prefix import check, kv_for, match_readonly, serve

from shmkv.testing import run_in_process


def P(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.int64)


@pytest.fixture
def st(make_store):
    return make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=1024, max_seqs=16)


@pytest.mark.parametrize("shared", [1, 2, 3, 7, 8, 10, 15])
def test_a_prefix_shorter_than_a_block_is_reused_and_equals_a_recompute(st, shared):
    p = P(1, 40)
    a, _ = serve(st, p)
    a.finish()
    q = np.concatenate([p[:shared], P(2, 12) + 30_000])  # differs right after token shared - 1
    assert st.match_prefix(q) == shared
    b, n = serve(st, q)
    assert n == shared
    check(b, q, st.layout)
    assert st.stats().prefix_tokens_reused == shared


def test_short_donors_and_short_prompts(st):
    p = P(3, 5)
    a, _ = serve(st, p)  # a donor of 5 tokens, below every block
    a.finish()
    assert st.match_prefix(p) == 4  # len - 1 of the identical prompt
    assert st.match_prefix(np.concatenate([p, [1, 2]])) == 5
    assert st.match_prefix(p[:1]) == 0  # one token: nothing may be reused (one is always run)
    assert st.match_prefix([p[0] + 1, *p[1:]]) == 0


def test_decode_from_empty_indexes_the_leads_as_they_fill(st):
    p = P(4, 12)
    k, v = kv_for(p, 2, 2, 4)
    a = st.create_sequence(capacity=16)
    q = np.concatenate([p, [5]])
    seen = []
    for i in range(12):  # one token a commit, as a decode loop does
        for layer in range(2):
            a.append(layer, k[layer, i : i + 1], v[layer, i : i + 1])
        a.commit(tokens=p[i : i + 1])
        seen.append(st.match_prefix(q))
    assert seen == list(range(1, 13))


def test_truncate_and_recommit_replace_the_leads(st):
    p, r = P(5, 12), P(6, 12)
    a, _ = serve(st, p)
    a.truncate(2)
    t = np.concatenate([p[:2], r[2:]])
    k, v = kv_for(t, 2, 2, 4)
    a.extend(k[:, 2:], v[:, 2:], tokens=t[2:])
    assert st.match_prefix(np.concatenate([p, [1]])) == 2  # the old leads 4 and 8 are gone
    assert st.match_prefix(np.concatenate([t, [1]])) == 12  # the new ones are in
    b, n = serve(st, np.concatenate([t[:9], [3]]))
    assert n == 9
    check(b, np.concatenate([t[:9], [3]]), st.layout)


def test_tokens_without_ids_or_moved_positions_are_no_lead(st):
    p = P(7, 12)
    k, v = kv_for(p, 2, 2, 4)
    a = st.create_sequence(capacity=16)
    a.extend(k[:, :3], v[:, :3], tokens=p[:3])
    a.extend(k[:, 3:], v[:, 3:])  # no ids from token 3 on
    assert st.match_prefix(np.concatenate([p, [1]])) == 3  # lead 2 found, verified up to 3
    b = st.create_sequence(capacity=16)
    b.extend(k, v, tokens=p, positions=np.arange(1, 13))  # positions not 0..: never a donor
    a.free()
    assert st.match_prefix(np.concatenate([p, [1]])) == 0


def test_copy_prefix_and_fork_carry_the_leads(st):
    p = P(8, 12)
    a, _ = serve(st, p)
    c = st.create_sequence(capacity=16)
    st.copy_prefix(a.id, c.id, 6)
    f = a.fork()
    a.free()
    q = np.concatenate([p[:7], [2]])
    assert st.match_prefix(q) == 7  # the fork holds all 12
    f.free()
    assert st.match_prefix(q) == 6  # the copy holds 6: its lead 4 was adopted
    b, n = serve(st, q)
    assert n == 6
    check(b, q, st.layout)


def test_leads_survive_an_index_rebuild_and_a_snapshot(st, make_store, tmp_path):
    prompts = [P(10 + i, 6 + i) for i in range(6)]
    for p in prompts:
        serve(st, p)[0].finish()
    with st._engine.locked():  # what a create does when the index fills: only valid entries are kept
        kept = st._engine.index.rebuild()
    assert kept == 3 + 3 + 4 + 4 + 4 + 4  # leads 1, 2, 4 of 6 and 7 tokens; 1, 2, 4, 8 of 8..11
    for p in prompts:
        assert st.match_prefix(np.concatenate([p, [1]])) == len(p)
    path = tmp_path / "leads.shmkv"
    st.save(path)
    other = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=1024, max_seqs=16)
    other.restore(path)
    for p in prompts:
        assert other.match_prefix(np.concatenate([p, [1]])) == len(p)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_found_by_another_process_read_only(st, start_method):
    p = P(20, 9)
    serve(st, p)[0].finish()
    q = np.concatenate([p[:6], [1, 2]]).tolist()
    assert run_in_process(match_readonly, st.name, q, start_method=start_method, timeout=60) == 6


@pytest.mark.parametrize("order", ["oldest first", "newest first"])
def test_an_old_holder_of_a_shared_lead_stays_findable(make_store, order):
    """Leads are displaced like blocks (DUP=4 holders a hash: a shared first token, a BOS, has
    many): once every newer holder is freed, the old one is found again through its lead."""
    st = make_store(max_tokens=1024, max_seqs=16)
    s = P(30, 6)
    a = np.concatenate([s, P(31, 4)])  # 10 tokens: no block, leads 1, 2, 4, 8
    serve(st, a)[0].finish()
    others = []
    for i in range(6):
        p = np.concatenate([s, P(40 + i, 4) + 30_000])
        b, _ = serve(st, p)
        b.finish()
        others.append((b.id, p))
    if order == "newest first":
        others.reverse()
    q = np.concatenate([a[:7], [5]])  # its longest lead is 4: the one shared with the newer six
    for k, (sid, _) in enumerate(others):
        st.sequence(sid, write=True).free()
        assert st.match_prefix(q) >= 6, f"after {k + 1} frees"
        for _, p in others[k + 1 :]:
            assert st.match_prefix(np.concatenate([p, [1]])) == len(p)
    assert st.match_prefix(q) == 7  # the old holder got its lead entries back
