"""Edge cases of the prefix cache, each pinning a behaviour a hostile or unlucky caller meets.

An old holder of a shared prefix whose index entries were replaced by four newer holders stays
findable once those are all freed: the entries are re-homed on free.
"""

from __future__ import annotations

import zlib

import msgpack
import numpy as np
import pytest
from procs.prefix import kv_for, serve

import shmkv
from shmkv._engine.prefixes.hashes import block_hashes


def P(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.int64)


def plain(store: shmkv.Store, p: np.ndarray, capacity: int | None = None, **kw) -> shmkv.Sequence:
    """A request computed without prefix reuse."""
    lay = store.layout
    s = store.create_sequence(capacity=capacity or len(p) + 8)
    k, v = kv_for(p, lay.layers, lay.kv_heads, lay.head_dim)
    s.extend(k, v, tokens=p, **kw)
    return s


def craft(src, dst, fn) -> None:
    """Rewrite a snapshot's header (fn on the first sequence's map) with a valid meta_crc."""
    with open(src, "rb") as f:
        raw = f.read()
    u = msgpack.Unpacker()
    u.feed(raw)
    hdr = next(u)
    off = u.tell()
    fn(hdr["sequences"][0])
    keys = ["format", "version", "layout", "sequences", "chunk"]
    hdr["meta_crc"] = zlib.crc32(msgpack.packb({x: hdr[x] for x in keys}))
    with open(dst, "wb") as f:
        f.write(msgpack.packb(hdr) + raw[off:])


# -- eviction rule violations (docs/design.md §8) ---------------------------------------------------------



def test_cache_full_evicts_nothing(make_store):
    st = make_store(max_tokens=100, max_seqs=2)
    x = plain(st, P(1, 5), capacity=10)
    x.finish()
    st.create_sequence(capacity=80)  # leased
    with pytest.raises(shmkv.CacheFullError):
        st.create_sequence(capacity=50)  # 10 free + x's 10 < 50: evicting cannot help
    assert st.stats().evictions == 0
    assert [i.id for i in st.sequences()] == [1, 2]



def test_donor_protection_does_not_evict_extra(make_store):
    st = make_store(max_tokens=100, max_seqs=2)
    pd = P(1, 40)
    d = plain(st, pd, capacity=80)
    d.finish()
    x = plain(st, P(2, 5), capacity=10)
    x.finish()  # more recent than d
    s = st.create_sequence(capacity=50, prefix=np.concatenate([pd, [3]]))
    assert len(s) == 0  # only d's eviction makes room: a miss, which may evict d ...
    assert st.stats().evictions == 1  # ... and nothing else (plain LRU would evict d alone)
    assert x.id in [i.id for i in st.sequences()]



def test_restore_does_not_make_a_leased_sequence_evictable(make_store, tmp_path):
    st = make_store(max_tokens=200, max_seqs=4)
    a = plain(st, P(1, 40), capacity=100)
    a.finish()
    st.save(tmp_path / "s.shmkv")
    a = st.sequence(a.id, write=True)  # taken back: leased, not evictable
    st.restore(tmp_path / "s.shmkv")  # allowed: this process holds the lease
    with pytest.raises(shmkv.CacheFullError):  # only evicting the leased sequence would make room
        st.create_sequence(capacity=150)
    assert a.id in [i.id for i in st.sequences()] and st.stats().evictions == 0
    a.extend(*kv_for(P(1, 41), 2, 2, 4), tokens=P(1, 41))  # the writer goes on



def test_fork_of_a_finished_sequence_does_not_evict_it(make_store):
    st = make_store(max_tokens=100, max_seqs=4)
    a = plain(st, P(1, 40), capacity=60)
    a.finish()
    st.create_sequence(capacity=20)  # leased
    with pytest.raises(shmkv.CacheFullError):  # only evicting the parent would make room
        st.sequence(a.id).fork(capacity=40)
    assert a.id in [i.id for i in st.sequences()] and st.stats().evictions == 0
    assert len(st.sequence(a.id).fork(n=10, capacity=10)) == 10



def test_copy_prefix_does_not_evict_its_source(make_store):
    st = make_store(max_tokens=100, max_seqs=4)
    a = plain(st, P(1, 40), capacity=60)
    a.finish()
    d = st.create_sequence(capacity=10)
    st.create_sequence(capacity=30)
    with pytest.raises(shmkv.CacheFullError):  # only evicting the source would make room for dst
        st.copy_prefix(a.id, d.id, 40)
    assert a.id in [i.id for i in st.sequences()] and st.stats().evictions == 0


def test_a_full_index_never_fails_a_commit_after_it_published(make_store):
    """A commit never raises after LENGTH is published (no RuntimeError("prefix index full")), even
    when the index has no empty entry (its occupancy count drifted, or it was scribbled on)."""
    st = make_store(max_tokens=256, max_seqs=4)
    t = np.frombuffer(st._engine.index._t, np.int64).reshape(-1, 4)
    t[:] = [1, 999, 0, 0]  # every entry taken, none valid (no live sequence 999), count says 0
    p = P(2, 40)
    a = plain(st, p)  # commits 40 tokens: two whole blocks go into the index
    assert len(a) == 40 and a.tokens.tolist() == p.tolist()
    assert st.match_prefix(np.concatenate([p, [1]])) == 40  # indexed in the invalid entries' place
    t[:] = t[np.flatnonzero(t[:, 1] == a.id)[0]]  # every entry a valid copy of a's first block's
    q = P(3, 20)
    b = plain(st, q)  # no entry to take: the block stays unindexed, the commit stands
    assert len(b) == 20 and b.tokens.tolist() == q.tolist()
    assert st.match_prefix(np.concatenate([q, [1]])) == 0


# -- wrong reuse ----------------------------------------------------------------------------------



def test_snapshot_without_clean_field_is_not_a_donor_after_remove(make_store, tmp_path):
    st = make_store(max_tokens=256)
    p = P(1, 64)
    s = plain(st, p)
    s.remove(10, 12)  # tokens 12.. move down; their K/V saw tokens 10, 11
    st.save(tmp_path / "a.shmkv")
    # a file without the prefix cache's fields (as an older shmkv writes it): no finished/recency/clean/meta
    craft(tmp_path / "a.shmkv", tmp_path / "b.shmkv",
          lambda q: [q.pop(k) for k in ("finished", "recency", "clean", "meta")])
    st2 = shmkv.load(tmp_path / "b.shmkv", name=st.name[:20] + "L")
    try:
        q = np.concatenate([st2.sequence(s.id).tokens, [1]])
        new = st2.create_sequence(capacity=100, prefix=q)
        n = len(new)
        k, _ = kv_for(q, 2, 2, 4)
        assert np.array_equal(new.keys(0), k[0, :n]), f"reused {n} tokens of moved K/V"
    finally:
        st2.close()



def test_sequence_with_encoder_is_not_a_donor_for_another_input(make_store):
    st = make_store(max_tokens=256)
    p = P(1, 40)
    a = st.create_sequence(capacity=64)
    a.set_encoder(np.ones((2, 5, 2, 4), np.float32), np.ones((2, 5, 2, 4), np.float32))
    a.extend(*kv_for(p, 2, 2, 4), tokens=p)
    a.finish()
    b = st.create_sequence(capacity=64, prefix=np.concatenate([p, [7]]))  # a request for another input
    assert len(b) == 0  # its decoder K/V were computed against a's encoder output



def test_snapshot_clean_out_of_range_is_a_snapshot_error(make_store, tmp_path):
    st = make_store(max_tokens=256)
    plain(st, P(1, 40)).finish()
    st.save(tmp_path / "a.shmkv")
    craft(tmp_path / "a.shmkv", tmp_path / "b.shmkv", lambda q: q.__setitem__("clean", 2**63))
    with pytest.raises(shmkv.SnapshotError):
        st.restore(tmp_path / "b.shmkv")



def test_snapshot_id_out_of_range_is_a_snapshot_error(make_store, tmp_path):
    from shmkv import cli

    st = make_store(max_tokens=256)
    plain(st, P(1, 40)).finish()
    st.save(tmp_path / "a.shmkv")
    craft(tmp_path / "a.shmkv", tmp_path / "b.shmkv", lambda q: q.__setitem__("id", 2**63 - 1))
    with pytest.raises(shmkv.SnapshotError):
        st.restore(tmp_path / "b.shmkv")
    assert cli.verify(st) == []


# -- missed reuse (match_prefix/create below what the store holds) -------------------------------


@pytest.mark.parametrize("order", ["oldest first", "newest first", "interleaved"])
@pytest.mark.parametrize("newer", [4, 9])
def test_old_holder_of_a_shared_prefix_stays_findable(make_store, order, newer):
    """The DUP=4 limit replaces an old holder's entries for the shared blocks; once every
    newer holder is freed (in any order), the old one must be found again, and so must the newer
    ones still live on the way."""
    st = make_store(max_tokens=2048, max_seqs=16)
    S = P(0, 32)
    A = np.concatenate([S, P(100, 20)])
    plain(st, A).finish()
    others = []
    for i in range(newer):
        p = np.concatenate([S, P(101 + i, 20)])
        s = plain(st, p)
        s.finish()
        others.append((s.id, p))
    if order == "newest first":
        others.reverse()
    elif order == "interleaved":
        others = others[1::2] + others[::2]
    for j, (sid, _) in enumerate(others):  # freed here; evicted by LRU in the same way
        st.sequence(sid, write=True).free()
        assert st.match_prefix(np.concatenate([A, [1]])) == len(A), f"after {j + 1} frees"
        for _, p in others[j + 1 :]:
            assert st.match_prefix(np.concatenate([p, [1]])) == len(p)



def test_holder_with_other_positions_does_not_hide_a_donor(make_store):
    st = make_store(max_tokens=256)
    p = P(1, 64)
    k, v = kv_for(p, 2, 2, 4)
    d = st.create_sequence(capacity=64)
    d.extend(k[:, :20], v[:, :20], tokens=p[:20])
    d.finish()
    assert st.match_prefix(p) == 20
    plain(st, p, positions=np.arange(100, 164)).finish()
    assert st.match_prefix(p) == 20



def test_position_gap_inside_a_block(make_store):
    st = make_store(max_tokens=256)
    p = P(1, 48)
    k, v = kv_for(p, 2, 2, 4)
    a = st.create_sequence(capacity=100)
    a.extend(k[:, :20], v[:, :20], tokens=p[:20])
    a.extend(k[:, 20:40], v[:, 20:40], tokens=p[20:40], positions=np.arange(25, 45))
    assert st.match_prefix(np.concatenate([p, [1]])) == 20


def test_sliding_long_holder_does_not_hide_a_short_donor(make_store):
    st = make_store(layers=2, max_tokens=1024, max_seqs=8, layer_types=["full", "sliding"], window=8, memory=64)
    p = P(1, 200)
    k, v = kv_for(p, 2, 2, 4)
    d = st.create_sequence(capacity=64)
    d.extend(k[:, :40], v[:, :40], tokens=p[:40])
    d.finish()
    a = st.create_sequence(capacity=256)
    for i in range(0, 200, 10):
        a.extend(k[:, i : i + 10], v[:, i : i + 10], tokens=p[i : i + 10])
    a.finish()
    assert st.match_prefix(np.concatenate([p[:50], [1, 2, 3]])) == 40


def test_chunked_donor_that_can_resume_is_used(make_store):
    st = make_store(layers=2, max_tokens=1024, max_seqs=8, layer_types=["full", "chunked"], chunk=32, memory=40)
    p = P(1, 200)
    k, v = kv_for(p, 2, 2, 4)
    a = st.create_sequence(capacity=256)
    for i in range(0, 200, 10):
        a.extend(k[:, i : i + 10], v[:, i : i + 10], tokens=p[i : i + 10])
    a.finish()
    assert a.can_resume(166)
    assert st.match_prefix(np.concatenate([p[:166], [1]])) == 166


# -- hostile sequences of operations ---------------------------------------------------------------


def test_truncate_recommit_and_anonymous_blocks(make_store):
    st = make_store(max_tokens=256)
    p, r = P(1, 48), P(2, 48)
    a = plain(st, p)
    a.truncate(20)
    t = np.concatenate([p[:20], r[20:]])
    k, v = kv_for(t, 2, 2, 4)
    a.extend(k[:, 20:], v[:, 20:], tokens=t[20:])
    assert st.match_prefix(np.concatenate([p, [1]])) == 20
    a.free()
    k, v = kv_for(p, 2, 2, 4)
    a = st.create_sequence(capacity=100)
    a.extend(k[:, :16], v[:, :16], tokens=p[:16])
    a.extend(k[:, 16:32], v[:, 16:32])  # no ids
    a.extend(k[:, 32:], v[:, 32:], tokens=p[32:])
    assert st.match_prefix(np.concatenate([p, [1]])) == 16
    a.truncate(16)
    a.extend(k[:, 16:], v[:, 16:], tokens=p[16:])
    _, n = serve(st, np.concatenate([p, [1]]))
    assert n == 48


def test_probe_chain_wraps_around_the_table(make_store):
    st = make_store(max_tokens=512, max_seqs=8)
    mask = st._engine.index._slots - 1
    rng = np.random.default_rng(5)
    found = []
    while len(found) < 6:
        b = rng.integers(0, 30_000, 16)
        if block_hashes(b)[0] & mask == mask:
            found.append(b)
    for b in found:
        plain(st, np.concatenate([b, [3, 4]])).finish()
    assert [st.match_prefix(np.concatenate([b, [3, 4, 5]])) for b in found] == [18] * 6


def test_copy_prefix_of_no_tokens_from_a_sliding_sequence(make_store):
    """copy_prefix(src, dst, 0) copies nothing and needs nothing: taken on a store with sliding layers
    too, where src's window no longer holds its first tokens (it was refused: "a prefix of n=0
    needs tokens from 0 on")."""
    st = make_store(layers=2, kv_heads=1, head_dim=2, layer_types=["full", "sliding"], window=4, memory=4,
                    max_tokens=128)
    a = st.create_sequence(capacity=64)
    a.extend(np.ones((2, 40, 1, 2)), np.ones((2, 40, 1, 2)), in_steps=True)
    b = st.create_sequence(capacity=4)
    b.extend(np.ones((2, 2, 1, 2)), np.ones((2, 2, 1, 2)))
    st.copy_prefix(a.id, b.id, 0)
    assert len(b) == 0 and len(a) == 40
