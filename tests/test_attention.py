"""Layer kinds, masks, can_resume and bounded sliding/chunked layers.

Every check compares attention computed from what shmkv returns (keys, values,
mask) with a plain numpy reference over the sequence's whole history under the
same visibility rule.
"""

from __future__ import annotations

import numpy as np
import pytest

import shmkv

H, D = 2, 4
KINDS = ["full", "sliding", "chunked"]


def visible(kind: str, p: int, kp: np.ndarray, window: int, chunk: int) -> np.ndarray:
    ok = kp <= p
    if kind == "sliding":
        ok &= kp > p - window
    if kind == "chunked":
        ok &= kp >= p - p % chunk
    return ok


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, add_mask: np.ndarray) -> np.ndarray:
    """q [n, H, D], k/v [t, H, D], mask [n, t] -> [n, H, D] (float64)."""
    s = np.einsum("nhd,thd->nht", q, k.astype(np.float64)) / np.sqrt(D) + add_mask[:, None, :]
    s = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nht,thd->nhd", s / s.sum(-1, keepdims=True), v.astype(np.float64))


def reference(q: np.ndarray, qpos: np.ndarray, hist_k: np.ndarray, hist_v: np.ndarray, hist_pos: np.ndarray,  # noqa: PLR0917
              kind: str, window: int, chunk: int) -> np.ndarray:
    out = np.zeros(q.shape)
    for i, p in enumerate(qpos):
        ok = visible(kind, int(p), hist_pos, window, chunk)
        out[i] = attend(q[i : i + 1], hist_k[ok], hist_v[ok], np.zeros((1, int(ok.sum()))))[0]
    return out


class History:
    """Everything a sequence ever held, per layer: the reference's view."""

    def __init__(self, layers: int) -> None:
        self.k = [np.zeros((0, H, D)) for _ in range(layers)]
        self.v = [np.zeros((0, H, D)) for _ in range(layers)]
        self.pos = np.zeros(0, np.int64)


def step(seq: shmkv.Sequence, hist: History, rng: np.random.Generator, n: int, kinds: list[str],  # noqa: PLR0917
         window: int, chunk: int) -> None:
    """Append n tokens to every layer, check attention against the reference, commit."""
    start = int(hist.pos[-1]) + 1 if hist.pos.size else 0
    qpos = np.arange(start, start + n)
    for layer, kind in enumerate(kinds):
        k, v, q = (rng.standard_normal((n, H, D)) for _ in range(3))
        keys, values = seq.append(layer, k, v)
        mask = seq.mask(layer, qpos)
        assert mask.dtype == np.float32 and mask.shape == (n, keys.shape[0])
        got = attend(q, keys, values, mask)
        hk, hv = np.concatenate([hist.k[layer], k]), np.concatenate([hist.v[layer], v])
        want = reference(q, qpos, hk, hv, np.concatenate([hist.pos, qpos]), kind, window, chunk)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=f"layer {layer} ({kind})")
        hist.k[layer], hist.v[layer] = hk, hv
    seq.commit(positions=qpos)
    hist.pos = np.concatenate([hist.pos, qpos])


@pytest.mark.parametrize("window,chunk", [(1, 2), (2, 3), (4, 2), (4, 3)])
def test_attention_matches_reference(make_store, window, chunk):
    rng = np.random.default_rng(window * 10 + chunk)
    store = make_store(layers=3, kv_heads=H, head_dim=D, dtype="float64", layer_types=KINDS, window=window,
                       chunk=chunk, memory=5, max_tokens=512)
    seq = store.create_sequence(capacity=8)
    hist = History(3)
    for _ in range(40):
        step(seq, hist, rng, int(rng.integers(1, 6)), KINDS, window, chunk)
    assert seq.length == hist.pos.size
    # sliding and chunked layers hold only recent tokens; the full layer everything
    assert seq.keys(0).shape[0] == seq.length
    assert seq.keys(1).shape[0] <= store.layout.window_cells
    np.testing.assert_array_equal(seq.keys(1), hist.k[1][-seq.keys(1).shape[0] :])
    np.testing.assert_array_equal(seq.held_positions(2), hist.pos[-seq.keys(2).shape[0] :])


def test_remove_copy_prefix_truncate_then_continue(make_store):
    window, chunk = 4, 3
    rng = np.random.default_rng(3)
    store = make_store(layers=3, kv_heads=H, head_dim=D, dtype="float64", layer_types=KINDS, window=window,
                       chunk=chunk, memory=6, max_tokens=512)
    seq = store.create_sequence(capacity=8)
    hist = History(3)
    for _ in range(8):
        step(seq, hist, rng, 3, KINDS, window, chunk)
    length = seq.length

    def shift(layer, keys, delta):  # a stand-in re-rotation: any change the reference can mirror
        return keys * 0.5 + delta

    # remove two tokens near the end: later tokens move down and take new positions
    b, e = length - 4, length - 2
    with pytest.raises(shmkv.NotSupportedError, match="shift="):
        seq.remove(b, e)
    seq.remove(b, e, shift=shift)
    delta = -2
    for layer in range(3):
        tail_k = hist.k[layer][e:] * 0.5 + delta
        hist.k[layer] = np.concatenate([hist.k[layer][:b], tail_k])
        hist.v[layer] = np.concatenate([hist.v[layer][:b], hist.v[layer][e:]])
    hist.pos = np.concatenate([hist.pos[:b], hist.pos[e:] + delta])
    assert seq.positions.tolist() == hist.pos.tolist() == list(range(length - 2))
    for _ in range(3):
        step(seq, hist, rng, 2, KINDS, window, chunk)
    # copy_prefix into another sequence, then both go on
    other = store.create_sequence(capacity=4)
    n = seq.length - 1
    store.copy_prefix(seq.id, other.id, n)
    ohist = History(3)
    ohist.k = [a[:n] for a in hist.k]
    ohist.v = [a[:n] for a in hist.v]
    ohist.pos = hist.pos[:n]
    for _ in range(3):
        step(other, ohist, rng, 2, KINDS, window, chunk)
        step(seq, hist, rng, 1, KINDS, window, chunk)
    # speculative rollback: truncate within what the windows hold, then continue
    n = seq.length - 2
    seq.truncate(n)
    hist.k = [a[:n] for a in hist.k]
    hist.v = [a[:n] for a in hist.v]
    hist.pos = hist.pos[:n]
    for _ in range(3):
        step(seq, hist, rng, 2, KINDS, window, chunk)
    # a truncate the windows cannot honour is refused, not silently wrong
    with pytest.raises(shmkv.NotSupportedError, match="clear"):
        seq.truncate(3)
    seq.clear()
    hist = History(3)
    step(seq, hist, rng, 3, KINDS, window, chunk)


def test_can_resume(make_store):
    store = make_store(layers=2, kv_heads=H, head_dim=D, layer_types=["full", "sliding"], window=4, memory=4)
    full_only = make_store(layers=2, kv_heads=H, head_dim=D)
    for s in (store, full_only):
        seq = s.create_sequence(capacity=64)
        assert seq.can_resume(0) and not seq.can_resume(1)
        seq.extend(np.ones((2, 3, H, D)), np.ones((2, 3, H, D)))
        assert seq.can_resume(3) and seq.can_resume(1) and not seq.can_resume(4)
        for _ in range(40):
            seq.extend(np.ones((2, 1, H, D)), np.ones((2, 1, H, D)))
        assert seq.can_resume(43)
        assert seq.can_resume(41)  # needs 38..40 on the sliding layer: still held
        if s is store:
            assert not seq.can_resume(20)  # the window has moved on: 17..19 are gone
        else:
            assert seq.can_resume(20)  # full layers hold everything
        seq.shift_left(5)  # the full layer drops positions 0..4: a new token would miss them
        assert not seq.can_resume(43) and not seq.can_resume(20)


def test_sliding_memory_stays_bounded(make_store):
    store = make_store(layers=2, kv_heads=H, head_dim=D, layer_types=["sliding", "chunked"], window=8, chunk=16,
                       memory=16, max_tokens=8192)
    seq = store.create_sequence(capacity=16)
    k = np.ones((2, 1, H, D))
    used = []
    for i in range(3000):
        seq.extend(k, k)
        if i % 500 == 499:
            used.append(store.stats())
    cap = store.layout.window_cells
    assert all(st.window_tokens <= cap for st in used)
    # only token ids and positions grow with the history (16 bytes a token, no K/V)
    assert store.bytes_per_token == 16
    grown = used[-1].window_tokens - used[0].window_tokens
    assert used[-1].bytes_used - used[0].bytes_used == 2500 * 16 + grown * 2 * 2 * H * D * 4
    assert seq.keys(0).shape[0] <= cap and seq.keys(1).shape[0] <= cap
    # the capacity still bounds the token ids and positions: the sequence grew for them
    assert seq.capacity >= 3000 and seq.remaining_capacity >= 0 and seq.positions.tolist() == list(range(3000))
    from shmkv.cli import verify

    assert verify(store) == []


def test_bad_layouts_and_steps(make_store):
    with pytest.raises(shmkv.InvalidArgumentError, match="window"):
        make_store(layer_types=["full", "sliding"])
    with pytest.raises(shmkv.InvalidArgumentError, match="chunk=3"):
        make_store(chunk=3)
    with pytest.raises(shmkv.NotSupportedError, match="int8"):
        make_store(layer_types=["full", "sliding"], window=2, dtype="int8")
    store = make_store(layer_types=["full", "sliding"], window=2, memory=4)
    seq = store.create_sequence(capacity=16)
    with pytest.raises(shmkv.CacheFullError, match="memory="):
        seq.extend(np.ones((2, 6, 2, 4)), np.ones((2, 6, 2, 4)))
    assert seq.length == 0 and seq.pending == 0
    seq.extend(np.ones((2, 4, 2, 4)), np.ones((2, 4, 2, 4)))
    assert seq.length == 4


def test_snapshot_keeps_windows_and_decoding_continues(make_store, tmp_path):
    window, chunk = 3, 4
    rng = np.random.default_rng(11)
    kw = dict(layers=3, kv_heads=H, head_dim=D, dtype="float64", layer_types=KINDS, window=window, chunk=chunk,
              memory=4, max_tokens=256)
    store = make_store(**kw)
    seq = store.create_sequence(capacity=8)
    hist = History(3)
    for _ in range(12):
        step(seq, hist, rng, 2, KINDS, window, chunk)
    path = tmp_path / "w.shmkv"
    store.save(path)
    other = make_store(**kw)
    other.create_sequence(capacity=2)  # the restored sequence lands in another slot
    other.restore(path)
    again = other.sequence(seq.id, write=True)
    for layer in range(3):
        np.testing.assert_array_equal(again.keys(layer), seq.keys(layer))
        np.testing.assert_array_equal(again.held_positions(layer), seq.held_positions(layer))
    for _ in range(4):  # decoding goes on in the restored copy exactly as in the reference
        step(again, hist, rng, 2, KINDS, window, chunk)


@pytest.mark.parametrize("window,chunk", [(2, 3), (4, 2)])
def test_batch_forward_matches_reference_per_sequence(make_store, window, chunk):
    rng = np.random.default_rng(window + 7 * chunk)
    store = make_store(layers=3, kv_heads=H, head_dim=D, dtype="float64", layer_types=KINDS, window=window,
                       chunk=chunk, memory=6, max_tokens=1024, max_seqs=8)
    seqs = [store.create_sequence(capacity=4) for _ in range(3)]
    hists = {s.id: History(3) for s in seqs}
    for s in seqs[:2]:  # two with history, one empty
        for _ in range(int(rng.integers(2, 5))):
            step(s, hists[s.id], rng, 3, KINDS, window, chunk)
    for s in seqs:
        s.release()  # the batch takes the leases
    for _ in range(6):
        counts = {s.id: int(rng.integers(0, 4)) for s in seqs}
        # rows of different sequences interleaved; each sequence's own rows in order
        labels = rng.permutation([sid for sid, c in counts.items() for _ in range(c)])
        nxt = {sid: (int(h.pos[-1]) + 1 if h.pos.size else 0) for sid, h in hists.items()}
        ids, pos = [], []
        for sid in labels.tolist():
            ids.append(sid)
            pos.append(nxt[sid])
            nxt[sid] += 1
        ids, pos = np.array(ids, np.int64), np.array(pos, np.int64)
        with store.forward(ids, pos) as batch:
            news = {}
            for layer, kind in enumerate(KINDS):
                k, v, q = (rng.standard_normal((len(ids), H, D)) for _ in range(3))
                K, V, mask = batch.put(layer, k, v)
                assert mask.shape == (len(ids), K.shape[0]) and K.shape == V.shape
                held = sum(store.sequence(s.id).keys(layer).shape[0] for s in seqs if counts[s.id])
                assert K.shape[0] == held + len(ids)  # only what the batch's sequences hold
                got = attend(q, K, V, mask)
                for sid in counts:
                    rows = np.flatnonzero(ids == sid)
                    if not rows.size:
                        continue
                    h = hists[sid]
                    hk = np.concatenate([h.k[layer], k[rows]])
                    hv = np.concatenate([h.v[layer], v[rows]])
                    hp = np.concatenate([h.pos, pos[rows]])
                    want = reference(q[rows], pos[rows], hk, hv, hp, kind, window, chunk)
                    np.testing.assert_allclose(got[rows], want, rtol=1e-9, atol=1e-12)
                    news.setdefault(sid, []).append((layer, hk, hv, hp))
            batch.commit()
        for sid, per_layer in news.items():
            for layer, hk, hv, hp in per_layer:
                hists[sid].k[layer], hists[sid].v[layer] = hk, hv
                hists[sid].pos = hp
    for s in seqs:
        assert store.sequence(s.id).positions.tolist() == hists[s.id].pos.tolist()
        assert store.sequence(s.id).lease_pid == 0  # the batch gave its leases back


def test_batch_bad_input_commits_nothing(make_store):
    store = make_store(layers=2, kv_heads=H, head_dim=D, layer_types=["full", "sliding"], window=2)
    a = store.create_sequence(capacity=8)
    a.extend(np.ones((2, 3, H, D)), np.ones((2, 3, H, D)))
    b = store.create_sequence(capacity=8)
    kv = np.ones((3, H, D))
    with pytest.raises(shmkv.InvalidArgumentError, match="backwards or skipping"):
        store.forward([a.id, a.id, b.id], [3, 5, 0])  # skips 4
    with pytest.raises(shmkv.InvalidArgumentError, match="backwards or skipping"):
        store.forward([a.id, b.id], [2, 0])  # goes back
    with pytest.raises(shmkv.SequenceNotFound, match="999"):
        store.forward([a.id, 999], [3, 0])
    with pytest.raises(shmkv.InvalidArgumentError, match="equally long"):
        store.forward([a.id, b.id], [3])
    batch = store.forward([a.id, a.id, b.id], [3, 4, 0])
    with pytest.raises(shmkv.InvalidArgumentError, match="batch_tokens=3"):
        batch.put(0, np.ones((2, H, D)), np.ones((2, H, D)))
    batch.put(0, kv, kv)
    with pytest.raises(shmkv.InvalidArgumentError, match="put already"):
        batch.put(0, kv, kv)
    with pytest.raises(shmkv.InvalidArgumentError, match=r"layers \[1\] were not put"):
        batch.commit()
    batch.close()
    assert a.length == 3 and b.length == 0 and a.pending == 0 and b.pending == 0
    # a clean batch after the failed ones works
    with store.forward([b.id, a.id], [0, 3]) as batch:
        for layer in range(2):
            batch.put(layer, np.ones((2, H, D)), np.ones((2, H, D)))
        batch.commit()
    assert a.length == 4 and b.length == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "int8"])
def test_encoder_cache(make_store, tmp_path, dtype):
    rng = np.random.default_rng(21)
    store = make_store(layers=2, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=256, max_seqs=8)
    seq = store.create_sequence(capacity=8)
    assert seq.encoder_length == 0 and seq.encoder_kv(0)[0].shape == (0, H, D)
    ek, ev = rng.standard_normal((2, 5, H, D)), rng.standard_normal((2, 5, H, D))
    seq.set_encoder(ek, ev)
    seq.extend(rng.standard_normal((2, 3, H, D)), rng.standard_normal((2, 3, H, D)))
    tol = dict(atol=np.abs(ek).max() / 127) if dtype == "int8" else dict(atol=0)
    for layer in range(2):
        k, v = seq.encoder_kv(layer)
        np.testing.assert_allclose(k, ek[layer], **tol)
        np.testing.assert_allclose(v, ev[layer], **tol)
        # cross-attention: every decoder query sees every encoder token, no mask
        q = rng.standard_normal((3, H, D))
        got = attend(q, k, v, np.zeros((3, 5)))
        want = attend(q, ek[layer], ev[layer], np.zeros((3, 5)))
        np.testing.assert_allclose(got, want, atol=0.05 if dtype == "int8" else 1e-12)
    assert store.stats().encoder_tokens == 5 and len(store.sequences()) == 1
    child = seq.fork()
    np.testing.assert_array_equal(child.encoder_kv(1)[0], seq.encoder_kv(1)[0])
    # a reader in another handle, a snapshot round trip, and freeing
    path = tmp_path / "enc.shmkv"
    store.save(path)
    other = make_store(layers=2, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=256, max_seqs=8)
    other.restore(path)
    np.testing.assert_array_equal(other.sequence(seq.id).encoder_kv(0)[1], seq.encoder_kv(0)[1])
    assert other.stats().encoder_tokens == 10
    seq.set_encoder(ek[:, :2], ev[:, :2])  # replaced, the old cells go back
    assert store.sequence(seq.id).encoder_length == 2
    child.free()
    seq.free()
    st = store.stats()
    assert st.encoder_tokens == 0 and st.free_tokens == st.max_tokens
    with pytest.raises(shmkv.InvalidArgumentError, match="layers=2"):
        store.create_sequence().set_encoder(ek[:1], ev[:1])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sliding_layer_read_by_another_process_while_compacting(make_store, method):
    from shmkv.testing import start_in_process

    from procs.store_ops import sliding_reader, sliding_writer

    # big cells and windows: copies long enough that reads and compactions do overlap
    store = make_store(layers=2, kv_heads=8, head_dim=128, dtype="float32", layer_types=["full", "sliding"],
                       window=64, memory=32, max_tokens=4096)
    seq = store.create_sequence(capacity=8)
    seq.release()
    n = 3000
    reader = start_in_process(sliding_reader, store.name, seq.id, n, 120.0, start_method=method, timeout=150)
    writer = start_in_process(sliding_writer, store.name, seq.id, n, start_method=method, timeout=150)
    assert writer.result() == n
    assert reader.result() > 0
    full = store.sequence(seq.id).keys(0)[:, 0, 0]
    np.testing.assert_array_equal(full, np.arange(n))
