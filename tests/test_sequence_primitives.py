"""Primitives that adapters (shmkv.transformers among them) build on:
``seq.discard()``, ``seq.pending_on(layer)``, ``seq.set_tokens(tokens, begin)``,
``seq.extend(..., in_steps=True)``, ``store.lease(seq_ids)`` and
``store.regather(seqs, rows)``. Results are checked against the numpy arrays
written (float32 storage: stored == written); their torch side
(``seq.torch_kv(layer, pending=True)``) is in tests/test_transformers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv._sequence.writer import SeqWriter, UnboundWriter

H, D = 2, 4  # the plugin's default layout: layers=2, kv_heads=2, head_dim=4, float32


def kv(rng: np.random.Generator, layers: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((layers, n, H, D)).astype(np.float32),
            rng.standard_normal((layers, n, H, D)).astype(np.float32))


def assert_holds(seq: shmkv.Sequence, k_ref: np.ndarray, v_ref: np.ndarray) -> None:
    """``seq``'s committed K/V of every layer equal the reference ``[layers, length, H, D]``
    (on sliding/chunked layers: the reference rows of the tokens the layer holds)."""
    assert len(seq) == k_ref.shape[1]
    for layer in range(k_ref.shape[0]):
        held = np.searchsorted(seq.positions, seq.held_positions(layer))  # token indexes
        k, v = seq.kv(layer)
        np.testing.assert_array_equal(k, k_ref[layer, held])
        np.testing.assert_array_equal(v, v_ref[layer, held])


# -- seq.discard() and seq.pending_on(layer) ------------------------------------------------------


def test_discard_drops_pending_of_every_layer_and_keeps_committed(store):
    rng = np.random.default_rng(0)
    k, v = kv(rng, 2, 7)
    seq = store.create_sequence(capacity=16)
    seq.extend(k[:, :5], v[:, :5], tokens=range(5))
    seq.append(0, k[0, 5:7], v[0, 5:7])  # a forward that died after layer 0 (2 tokens), 1 on layer 1
    seq.append(1, k[1, 5], v[1, 5])
    assert (seq.pending_on(0), seq.pending_on(1), seq.pending) == (2, 1, 1)
    assert seq.discard() == 2
    assert (seq.pending_on(0), seq.pending_on(1), seq.pending) == (0, 0, 0)
    assert seq.discard() == 0  # idempotent
    assert_holds(seq, k[:, :5], v[:, :5])
    assert seq.tokens.tolist() == [0, 1, 2, 3, 4]
    # the next tokens follow the committed ones, not the discarded ones
    k2, v2 = kv(rng, 2, 3)
    for layer in range(2):
        keys, _ = seq.append(layer, k2[layer], v2[layer])
        np.testing.assert_array_equal(keys, np.concatenate([k[layer, :5], k2[layer]]))
    assert seq.commit() == 8
    assert_holds(seq, np.concatenate([k[:, :5], k2], 1), np.concatenate([v[:, :5], v2], 1))


def test_discard_and_pending_on_read_and_released_handles(store):
    rng = np.random.default_rng(1)
    k, v = kv(rng, 2, 3)
    seq = store.create_sequence(capacity=8)
    reader = store.sequence(seq.id)
    seq.append(0, k[0], v[0])
    assert reader.pending_on(0) == 0 and reader.discard() == 0  # a read handle has nothing pending
    seq.release()  # release drops the pending tokens
    assert seq.pending_on(0) == 0 and seq.discard() == 0
    assert len(seq) == 0
    with pytest.raises(shmkv.InvalidArgumentError, match=r"layer=2 .*layers=0\.\.1"):
        reader.pending_on(2)
    with pytest.raises(shmkv.InvalidArgumentError, match="layer="):
        reader.pending_on("0")


def test_discard_after_a_window_compaction(make_store):
    """On a sliding layer an append may compact the window buffer; discarding its tokens
    afterwards leaves what the window needs, and decoding continues exactly."""
    store = make_store(layer_types=["full", "sliding"], window=4, memory=4)
    rng = np.random.default_rng(2)
    k, v = kv(rng, 2, 12)
    seq = store.create_sequence(capacity=32)
    for a in range(0, 8, 4):
        seq.extend(k[:, a : a + 4], v[:, a : a + 4])
    for layer in range(2):
        seq.append(layer, k[layer, 8:12] + 100, v[layer, 8:12] + 100)  # compacts layer 1's buffer
    assert seq.discard() == 4
    assert_holds(seq, k[:, :8], v[:, :8])
    seq.extend(k[:, 8:12], v[:, 8:12])
    assert_holds(seq, k, v)
    assert seq.can_resume(12)


# -- seq.set_tokens(tokens, begin=0) ---------------------------------------------------------------


def test_set_tokens_records_ids_and_indexes_the_prefix(make_store):
    store = make_store(max_tokens=512)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, 40)
    k, v = kv(rng, 2, 40)
    seq = store.create_sequence(capacity=64)
    seq.extend(k, v)  # committed without ids (a model forward sees states, not ids)
    assert (seq.tokens == -1).all()
    assert store.match_prefix([*ids, 5]) == 0
    seq.set_tokens(ids[:25])
    seq.set_tokens(ids[25:], begin=25)
    assert seq.tokens.tolist() == ids.tolist()
    seq.set_tokens(ids[10:20], begin=10)  # the same ids again: nothing changes
    # the prefix cache finds it now, from any attachment
    other = shmkv.attach(store.name)
    try:
        assert other.match_prefix([*ids, 5]) == 40
        assert other.sequence(seq.id).tokens.tolist() == ids.tolist()
    finally:
        other.close()
    reuse = store.create_sequence(capacity=64, prefix=[*ids[:30], 5000])
    assert len(reuse) == 30
    assert_holds(reuse, k[:, :30], v[:, :30])


def test_set_tokens_keeps_pending_tokens(store):
    rng = np.random.default_rng(4)
    k, v = kv(rng, 2, 6)
    seq = store.create_sequence(capacity=16)
    seq.extend(k[:, :4], v[:, :4])
    for layer in range(2):
        seq.append(layer, k[layer, 4:], v[layer, 4:])
    seq.set_tokens([10, 11, 12, 13])
    assert seq.pending == 2
    assert seq.commit(tokens=[14, 15]) == 6
    assert seq.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert_holds(seq, k, v)


def test_set_tokens_refuses_and_writes_nothing(store):
    rng = np.random.default_rng(5)
    k, v = kv(rng, 2, 6)
    seq = store.create_sequence(capacity=16)
    seq.extend(k[:, :3], v[:, :3], tokens=[7, 8, 9])
    seq.extend(k[:, 3:], v[:, 3:])  # ids -1
    before = seq.tokens.tolist()
    with pytest.raises(shmkv.InvalidArgumentError, match=r"index 2 .*holds token 9"):
        seq.set_tokens([7, 8, 10, 11, 12, 13])  # ids are fixed once set
    with pytest.raises(shmkv.InvalidArgumentError, match=r"length 6"):
        seq.set_tokens([1, 2, 3], begin=4)  # past the committed tokens
    with pytest.raises(shmkv.InvalidArgumentError, match=r"-3"):
        seq.set_tokens([1, -3])
    with pytest.raises(shmkv.InvalidArgumentError, match="begin"):
        seq.set_tokens([1], begin=-1)
    assert seq.tokens.tolist() == before
    with pytest.raises(shmkv.ReadOnlyError, match=rf"store.sequence\({seq.id}, write=True\)"):
        store.sequence(seq.id).set_tokens([7])
    seq.release()
    with pytest.raises(shmkv.ReadOnlyError):
        seq.set_tokens([7])
    assert seq.tokens.tolist() == before


# -- seq.extend(..., in_steps=True) ------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 12, 30])
def test_extend_in_steps_takes_any_length_on_sliding_layers(make_store, n):
    store = make_store(layers=3, layer_types=["full", "sliding", "chunked"], window=4, chunk=4, memory=4,
                       max_tokens=512)
    rng = np.random.default_rng(6)
    k, v = kv(rng, 3, n + 3)
    seq = store.create_sequence(capacity=8)
    if n > store.layout.window_cells:
        with pytest.raises(shmkv.CacheFullError, match="memory="):
            seq.extend(k[:, :n], v[:, :n])  # one commit: more than a window buffer takes
        assert len(seq) == 0 and seq.pending == 0
    assert seq.extend(k[:, :n], v[:, :n], tokens=range(n), positions=range(n), in_steps=True) == n
    assert_holds(seq, k[:, :n], v[:, :n])
    assert seq.tokens.tolist() == list(range(n))
    assert seq.positions.tolist() == list(range(n))
    # decoding continues from there: the window layers hold what the next tokens need
    assert seq.can_resume(n)
    seq.extend(k[:, n:], v[:, n:])
    assert_holds(seq, k, v)
    assert seq.can_resume(n + 3) and seq.positions[-1] == n + 2


def test_extend_in_steps_all_or_nothing_when_the_store_is_full(make_store):
    store = make_store(layer_types=["full", "sliding"], window=4, memory=4, max_tokens=32)
    rng = np.random.default_rng(7)
    k, v = kv(rng, 2, 40)
    seq = store.create_sequence(capacity=8)
    seq.extend(k[:, :3], v[:, :3])
    with pytest.raises(shmkv.CacheFullError, match="max_tokens=32"):
        seq.extend(k[:, 3:], v[:, 3:], in_steps=True)
    assert_holds(seq, k[:, :3], v[:, :3])  # nothing of it was committed
    with pytest.raises(shmkv.InvalidArgumentError, match="in_steps"):
        seq.extend(k[:, 3:5], v[:, 3:5], in_steps="yes")


def test_extend_in_steps_without_bounded_layers_is_one_commit(store):
    rng = np.random.default_rng(8)
    k, v = kv(rng, 2, 20)
    seq = store.create_sequence(capacity=8)
    assert seq.extend(k, v, in_steps=True) == 20
    assert_holds(seq, k, v)


# -- store.lease(seq_ids) --------------------------------------------------------------------------


def test_lease_takes_every_lease_or_none(store):
    seqs = [store.create_sequence(capacity=8) for _ in range(3)]
    ids = [s.id for s in seqs]
    for s in seqs:
        s.release()
    held = store.sequence(ids[2], write=True)  # another writer holds the last one
    with pytest.raises(shmkv.LeaseError):
        store.lease(ids)
    assert [i.lease_pid for i in store.sequences()] == [0, 0, held.lease_pid]  # nothing kept
    with pytest.raises(shmkv.SequenceNotFound):
        store.lease([ids[0], 12345])
    got = store.lease(ids[1::-1])
    assert [s.id for s in got] == [ids[1], ids[0]] and all(s.writable for s in got)
    held.release()
    with pytest.raises(shmkv.InvalidArgumentError, match=rf"seq_ids=\[{ids[2]}, {ids[2]}\]"):
        store.lease([ids[2], ids[2]])
    with pytest.raises(shmkv.InvalidArgumentError, match="seq_ids="):
        store.lease([1.5])
    assert store.lease([]) == []


def test_lease_on_a_readonly_attachment(store):
    seq = store.create_sequence(capacity=8)
    seq.release()
    ro = shmkv.attach(store.name, readonly=True)
    try:
        with pytest.raises(shmkv.ReadOnlyError):
            ro.lease([seq.id])
    finally:
        ro.close()


# -- store.regather(seqs, rows) ----------------------------------------------------------------------


def filled(store: shmkv.Store, rng: np.random.Generator, rows: int, n: int, layers: int = 2):
    """``rows`` sequences of n tokens each; their reference K, V and ids."""
    seqs, refs = [], []
    for r in range(rows):
        k, v = kv(rng, layers, n)
        ids = rng.integers(0, 1000, n)
        s = store.create_sequence(capacity=32)
        s.extend(k, v, tokens=ids)
        s.meta = {"row": r}
        seqs.append(s)
        refs.append((k, v, ids))
    return seqs, refs


@pytest.mark.parametrize("rows", [[2, 0, 0], [1, 2, 0], [2, 0], [0, 0, 0, 1, 1, 1], [1], [0, 1, 2]])
def test_regather(make_store, rows):
    store = make_store(max_tokens=1024, max_seqs=16)
    rng = np.random.default_rng(9)
    seqs, refs = filled(store, rng, 3, 10)
    old = {s.id for s in seqs}
    out = store.regather(seqs, rows)
    assert len(out) == len(rows)
    for s, r in zip(out, rows, strict=True):
        k, v, ids = refs[r]
        assert s.writable
        assert_holds(s, k, v)
        assert s.tokens.tolist() == ids.tolist()
    firsts = {r: i for i, r in reversed(list(enumerate(rows)))}
    for r, i in firsts.items():
        assert out[i] is seqs[r]  # a row's first use keeps its sequence (and its meta)
        assert out[i].meta == {"row": r}
    assert all(s.meta == {} for i, s in enumerate(out) if i not in firsts.values())  # repeats: as a fork
    live = sorted(i.id for i in store.sequences())
    assert live == sorted(s.id for s in out)  # the rest were freed
    # sequences no row keeps are reused for the repeats before any new one is made
    assert len({s.id for s in out} - old) == max(0, len(rows) - 3)


def test_regather_sliding_layers(make_store):
    store = make_store(layer_types=["full", "sliding"], window=4, memory=4, max_tokens=1024)
    rng = np.random.default_rng(10)
    seqs, refs = [], []
    for _ in range(2):
        k, v = kv(rng, 2, 14)
        s = store.create_sequence(capacity=16)
        s.extend(k, v, in_steps=True)
        seqs.append(s)
        refs.append((k, v))
    out = store.regather(seqs, [1, 1, 0])
    for s, r in zip(out, [1, 1, 0], strict=True):
        assert_holds(s, *refs[r])
        assert s.can_resume(14)


def test_regather_carries_the_encoder(store):
    rng = np.random.default_rng(11)
    seqs, refs = filled(store, rng, 2, 4)
    ek, ev = kv(rng, 2, 3)
    seqs[0].set_encoder(ek, ev)
    out = store.regather(seqs, [0, 0])
    for s in out:
        assert_holds(s, *refs[0][:2])
        for layer in range(2):
            k, v = s.encoder_kv(layer)
            np.testing.assert_array_equal(k, ek[layer])
            np.testing.assert_array_equal(v, ev[layer])
    assert sorted(i.id for i in store.sequences()) == sorted(s.id for s in out)


def test_regather_refuses_and_changes_nothing(make_store):
    store = make_store(max_tokens=64, max_seqs=8)
    rng = np.random.default_rng(12)
    seqs, refs = filled(store, rng, 2, 20)

    def unchanged():
        assert sorted(i.id for i in store.sequences()) == sorted(s.id for s in seqs)
        for s, (k, v, ids) in zip(seqs, refs, strict=True):
            assert_holds(s, k, v)
            assert s.tokens.tolist() == ids.tolist()

    with pytest.raises(shmkv.InvalidArgumentError, match=r"rows=\[0, 2\].*2 sequences"):
        store.regather(seqs, [0, 2])
    with pytest.raises(shmkv.InvalidArgumentError, match="rows="):
        store.regather(seqs, [0, -1])
    with pytest.raises(shmkv.InvalidArgumentError, match="twice"):
        store.regather([seqs[0], seqs[0]], [0])
    seqs[1].append(0, refs[1][0][0, :1], refs[1][1][0, :1])
    with pytest.raises(shmkv.InvalidArgumentError, match=r"uncommitted.*discard\(\)"):
        store.regather(seqs, [1, 0])
    seqs[1].discard()
    reader = store.sequence(seqs[0].id)
    with pytest.raises(shmkv.ReadOnlyError, match=rf"store.sequence\({seqs[0].id}, write=True\)"):
        store.regather([reader, seqs[1]], [0])
    other = shmkv.attach(store.name)
    try:
        with pytest.raises(shmkv.InvalidArgumentError, match="another"):
            other.regather(seqs, [0])
    finally:
        other.close()
    # 64 cells hold the two rows (32 each at capacity) and no copy: the fork fails, nothing changes
    with pytest.raises(shmkv.CacheFullError):
        store.regather(seqs, [0, 0, 0])
    unchanged()


def test_commit_stores_the_ids_and_positions_given_for_one_token_or_many(make_store):
    """commit(tokens=, positions=) of one token (the decode step: two word stores) and of many:
    the ids and positions read back are the ones given, or -1 and the next positions."""
    store = make_store()
    seq = store.create_sequence(capacity=32)
    rng = np.random.default_rng(5)
    ids: list[int] = []
    pos: list[int] = []
    k_ref, v_ref = np.zeros((2, 0, H, D), np.float32), np.zeros((2, 0, H, D), np.float32)
    for n, tok, p in [(1, None, None), (1, [7], None), (1, [8], [10]), (1, None, None),
                      (3, [1, 2, 3], None), (2, None, [20, 25]), (1, None, [30]), (2, None, None)]:
        k, v = kv(rng, 2, n)
        for layer in range(2):
            seq.append(layer, k[layer], v[layer])
        assert seq.commit(tokens=tok, positions=p) == len(ids) + n
        last = pos[-1] if pos else -1
        ids += tok if tok is not None else [-1] * n
        pos += p if p is not None else list(range(last + 1, last + 1 + n))
        k_ref, v_ref = np.concatenate([k_ref, k], axis=1), np.concatenate([v_ref, v], axis=1)
    assert seq.tokens.tolist() == ids
    assert seq.positions.tolist() == pos
    assert_holds(seq, k_ref, v_ref)


# -- a read handle -------------------------------------------------------------------------------

WRITES = {
    "append": lambda s, k: s.append(0, k[0, 0], k[0, 0]),
    "commit": lambda s, k: s.commit(),
    "extend": lambda s, k: s.extend(k[:, :2], k[:, :2]),
    "truncate": lambda s, k: s.truncate(1),
    "set_tokens": lambda s, k: s.set_tokens([7]),
    "finish": lambda s, k: s.finish(),
    "meta": lambda s, k: setattr(s, "meta", {"a": 1}),
}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("used", [False, True])
def test_a_read_handle_refuses_every_write_first_or_later_and_says_closed_after_close(make_store, write, used):
    """A read handle (``store.sequence(id)``) refuses each write with ReadOnlyError naming the way
    to the lease, whether the write is the first use of its writing part (set up then) or comes
    after reads and a refused append (set up already), changes nothing, and after its store
    closes says StoreClosedError."""
    store = make_store(layers=2, kv_heads=2, head_dim=4)
    rng = np.random.default_rng(3)
    k, v = kv(rng, 2, 4)
    w = store.create_sequence(capacity=8)
    w.extend(k, v, tokens=[1, 2, 3, 4])
    seq = store.sequence(w.id)
    if used:
        assert seq.length == 4 and seq.pending_on(1) == 0
        assert np.array_equal(seq.keys(1), k[1])
        with pytest.raises(shmkv.ReadOnlyError):
            seq.append(1, k[1, 0], v[1, 0])
        assert type(seq._w) is SeqWriter  # (the refused append set up its writing part)
    else:
        assert type(seq._w) is UnboundWriter  # (reads leave it unset: the write below is its first use)
    with pytest.raises(shmkv.ReadOnlyError, match=rf"store.sequence\({w.id}, write=True\)"):
        WRITES[write](seq, k)
    assert seq.length == 4 and seq.tokens.tolist() == [1, 2, 3, 4] and seq.meta == {}
    assert_holds(seq, k, v)
    w.append(0, k[0, 0], v[0, 0])  # the lease holder goes on
    w.append(1, k[1, 0], v[1, 0])
    assert w.commit() == 5 and seq.length == 5
    store.close()
    with pytest.raises(shmkv.StoreClosedError):
        WRITES[write](seq, k)
