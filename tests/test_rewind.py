"""Store primitives the Hugging Face adapter needs on sliding/chunked models:

* ``seq.rewind(n, k_window, v_window)``: a truncate back past what the sliding/chunked
  layers still hold, given those layers' states (the adapter's crop after a forward that
  was committed in steps);
* ``store.copy_prefix`` (so ``fork`` and ``store.regather``) gives dst every token src's
  sliding/chunked layers hold below n, so copies of a row hold exactly what it holds.

float32 storage: stored == written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import shmkv

H, D = 2, 4
LAYOUT = dict(layers=3, kv_heads=H, head_dim=D, dtype="float32", layer_types=["full", "sliding", "chunked"],
              window=4, chunk=5, memory=6, max_tokens=4096, max_seqs=16)  # keep 4, step 6: 10 cells


def kv(rng, n, layers=3):
    return (rng.standard_normal((layers, n, H, D)).astype(np.float32),
            rng.standard_normal((layers, n, H, D)).astype(np.float32))


def held(seq, layer):
    """Token indexes ``layer`` holds."""
    return np.searchsorted(seq.positions, seq.held_positions(layer)).tolist()


def assert_holds(seq, k_ref, v_ref):
    assert len(seq) == k_ref.shape[1]
    for layer in range(k_ref.shape[0]):
        idx = held(seq, layer)
        k, v = seq.kv(layer)
        np.testing.assert_array_equal(k, k_ref[layer, idx])
        np.testing.assert_array_equal(v, v_ref[layer, idx])


def windows(k, v, n, m, bounded=(1, 2)):
    return k[list(bounded), n - m : n], v[list(bounded), n - m : n]


def test_rewind_past_what_the_window_holds(make_store):
    store = make_store(**LAYOUT)
    lay = store.layout
    assert (lay.keep, lay.step, lay.window_cells) == (4, 6, 10)
    rng = np.random.default_rng(0)
    k, v = kv(rng, 40)
    seq = store.create_sequence(capacity=64)
    seq.extend(k[:, :10], v[:, :10])
    seq.extend(k[:, 10:30], v[:, 10:30], in_steps=True)  # 20 > step: committed in steps, compacted
    first = held(seq, 1)[0]
    assert first > 10 - lay.keep  # the tokens before the forward's start are gone
    with pytest.raises(shmkv.NotSupportedError, match="truncate"):
        seq.truncate(12)  # a plain truncate cannot go there
    seq.rewind(12, *windows(k, v, 12, 4))
    assert_holds(seq, k[:, :12], v[:, :12])
    assert held(seq, 1) == [8, 9, 10, 11]
    # it decodes on from there like a sequence that never went further
    for layer in range(3):
        keys, _ = seq.append(layer, k[layer, 12:14], v[layer, 12:14])
        if layer:
            np.testing.assert_array_equal(keys, k[layer, 8:14])
    seq.commit()
    assert_holds(seq, k[:, :14], v[:, :14])
    seq.extend(k[:, 14:40], v[:, 14:40], in_steps=True)
    assert_holds(seq, k[:, :40], v[:, :40])


def test_rewind_within_the_window_is_a_truncate_and_takes_more_than_keep(make_store):
    store = make_store(**LAYOUT)
    rng = np.random.default_rng(1)
    k, v = kv(rng, 20)
    seq = store.create_sequence(capacity=32)
    seq.extend(k[:, :20], v[:, :20], in_steps=True)
    h = held(seq, 1)
    seq.rewind(19, *windows(k, v, 19, 4))  # the layers hold 15..18 already: nothing rewritten
    assert held(seq, 1) == [i for i in h if i < 19]
    seq.rewind(9, *windows(k, v, 9, 9))  # m may exceed keep (up to window_cells)
    assert held(seq, 1) == list(range(9))
    assert_holds(seq, k[:, :9], v[:, :9])
    seq.rewind(0, *windows(k, v, 0, 0))
    assert len(seq) == 0 and seq.kv(1)[0].shape == (0, H, D)


@pytest.mark.parametrize("n, m, match", [
    (21, 4, "exceeds the length"),
    (12, 3, "m >= 4"),
    (12, 11, "m <= 10"),
    (3, 4, "m <= n"),
])
def test_rewind_refuses_bad_arguments_and_changes_nothing(make_store, n, m, match):
    store = make_store(**LAYOUT)
    rng = np.random.default_rng(2)
    k, v = kv(rng, 20)
    seq = store.create_sequence(capacity=32)
    seq.extend(k[:, :20], v[:, :20], in_steps=True)
    before = held(seq, 1)
    kw, vw = k[[1, 2], max(n - m, 0) : max(n - m, 0) + m], v[[1, 2], max(n - m, 0) : max(n - m, 0) + m]
    if n > 20:
        kw, vw = np.zeros((2, m, H, D), np.float32), np.zeros((2, m, H, D), np.float32)
    with pytest.raises(shmkv.InvalidArgumentError, match=match):
        seq.rewind(n, kw, vw)
    assert len(seq) == 20 and held(seq, 1) == before
    with pytest.raises(shmkv.InvalidArgumentError, match="bounded layers=2"):
        seq.rewind(12, k[:, 8:12], v[:, 8:12])  # all three layers given
    ro = store.sequence(seq.id)
    with pytest.raises(shmkv.ReadOnlyError):
        ro.rewind(12, *windows(k, v, 12, 4))


def test_rewind_on_a_store_without_bounded_layers_is_truncate(make_store):
    store = make_store(layers=2, kv_heads=H, head_dim=D, dtype="float32")
    rng = np.random.default_rng(3)
    k, v = kv(rng, 8, layers=2)
    seq = store.create_sequence(capacity=16)
    seq.extend(k, v)
    seq.rewind(5, np.zeros((0, 0, H, D), np.float32), np.zeros((0, 0, H, D), np.float32))
    assert_holds(seq, k[:, :5], v[:, :5])


@pytest.mark.parametrize("how", ["fork", "copy_prefix", "regather"])
def test_copies_hold_exactly_what_their_source_holds(make_store, how):
    """A copy holds every token its source's sliding/chunked layers hold (after a commit, more
    than the last keep tokens), so store.batch_kv over a row and its copy works."""
    store = make_store(**LAYOUT)
    rng = np.random.default_rng(4)
    k, v = kv(rng, 30)
    src = store.create_sequence(capacity=64)
    src.extend(k[:, :11], v[:, :11], in_steps=True)
    src.extend(k[:, 11:16], v[:, 11:16])  # 5 more: the buffer holds more than keep now
    assert len(held(src, 1)) > store.layout.keep
    if how == "fork":
        rows = [src, src.fork()]
    elif how == "copy_prefix":
        dst = store.create_sequence(capacity=8)
        store.copy_prefix(src.id, dst.id, 16)
        rows = [src, dst]
    else:
        other = store.create_sequence(capacity=64)
        other.extend(k[:, :16], v[:, :16], in_steps=True)
        rows = store.regather([src, other], [0, 0])
    for s in rows:
        assert held(s, 1) == held(src, 1) and held(s, 2) == held(src, 2)
        assert_holds(s, k[:, :16], v[:, :16])
    for layer in range(3):
        kb, vb = store.batch_kv(rows, layer)
        assert kb.shape[:2] == vb.shape[:2] == (2, len(held(src, layer)))
    for s in rows:  # both go on
        s.extend(k[:, 16:30], v[:, 16:30], in_steps=True)
        assert_holds(s, k[:, :30], v[:, :30])


def test_a_reused_prefix_still_copies_only_what_a_next_token_needs(make_store):
    store = make_store(**LAYOUT)
    rng = np.random.default_rng(5)
    k, v = kv(rng, 40)
    donor = store.create_sequence(capacity=64)
    donor.extend(k[:, :16], v[:, :16], tokens=range(100, 116), in_steps=True)
    donor.finish()
    seq = store.create_sequence(capacity=64, prefix=[*range(100, 116), 7])
    assert len(seq) == 16
    assert held(seq, 1) == list(range(12, 16))  # keep = 4
    assert_holds(seq, k[:, :16], v[:, :16])


def test_a_writer_killed_inside_rewind_leaves_the_sequence_as_it_was(make_store):
    """rewind writes the new window into the slot's other buffer and switches the row in one
    journaled change: a writer SIGKILLed between the two (crash point rewind.copied) leaves the
    sequence as it was once the next lock holder has recovered; done, it is the rewound one."""
    from procs.crash import BOUNDED, kv as token_kv, state

    store = make_store(**BOUNDED)  # full + sliding (window 4: keep 3), memory 8
    t = np.arange(200, 230)
    s = store.create_sequence(capacity=64)
    k, v = token_kv(t)
    s.extend(k, v, tokens=t, in_steps=True)
    s.release()
    before = state(store)
    code = (
        "import sys, numpy as np, shmkv\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "from procs.crash import kv\n"
        "store = shmkv.attach(sys.argv[1])\n"
        "seq = store.sequence(int(sys.argv[2]), write=True)\n"
        "k, v = kv(np.arange(217, 220))\n"
        "seq.rewind(20, k[1:], v[1:])\n"
        "store.close()\n"
    )
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", code, store.name, str(s.id), here], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "SHMKV_CRASH_AT": "rewind.copied"})
    assert r.returncode == -signal.SIGKILL, f"rewind.copied was not reached: exit {r.returncode}\n{r.stderr[-3000:]}"
    with store.transaction():  # the next lock holder recovers
        pass
    assert state(store) == before
    seq = store.sequence(s.id, write=True)  # the dead writer's lease is taken over
    k, v = token_kv(np.arange(217, 220))
    seq.rewind(20, k[1:], v[1:])
    after = state(store)
    assert [a[1] for a in after] == [tuple(range(200, 220))]  # state() checked every held cell's K/V
    assert held(seq, 1) == [17, 18, 19]
