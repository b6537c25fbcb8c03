"""Shared prefix pages (docs/design.md §11, issue 23): a reuse of a cached prefix borrows the donor's
pages (remapped in place in every process) instead of copying them, and shared cells are never
written: copy-on-write for the borrower, a move for the donor."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from procs.share import read_inherited, read_sequence

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv.testing import run_in_process

PROMPT = 300
KINDS = {
    "full": None,
    "sliding": ["full", "sliding", "full"],
    "chunked": ["chunked", "full", "full"],
}


def _store(make_store, dtype="float16", kind="full", **kw):
    types = KINDS[kind]
    extra = {} if types is None else {"layer_types": types, "window": 48, "memory": 1024} if kind == "sliding" else \
        {"layer_types": types, "chunk": 64, "memory": 1024}
    args = dict(layers=3, kv_heads=4, head_dim=64, dtype=dtype, max_tokens=16384, max_seqs=32)
    args.update(extra)
    args.update(kw)
    return make_store(**args)


def _kv(rng, store, n):
    lay = store.layout
    shape = (lay.layers, n, lay.kv_heads, lay.head_dim)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def _donor(store, rng, n=PROMPT, capacity=1024, prompt=None):
    prompt = np.arange(1000, 1000 + n) if prompt is None else prompt
    d = store.create_sequence(capacity=capacity, prefix=prompt)
    k, v = _kv(rng, store, n - len(d))
    d.extend(k, v, tokens=prompt[len(d):])
    d.finish()
    return d, prompt


def _content(seq, layers):
    return [(np.asarray(seq.keys(i)).tobytes(), np.asarray(seq.values(i)).tobytes()) for i in range(layers)] + [
        (seq.tokens.tobytes(), seq.positions.tobytes())]


def _same(a: list, b: list) -> bool:
    """Equal contents (a bool: pytest's diff of megabytes of bytes would take minutes)."""
    return a == b


def _reference(store, src_id, n, prompt=None):
    """A copied sequence holding src's first n tokens, with sharing off (what a reuse held
    before sharing): copy_prefix, or, given the prompt, create_sequence(prefix=)."""
    share.ENABLED = False
    try:
        if prompt is not None:
            return store.create_sequence(capacity=1024, prefix=prompt)
        ref = store.create_sequence(capacity=1024)
        store.copy_prefix(src_id, ref.id, n)
        return ref
    finally:
        share.ENABLED = True


def _spans(store):
    return store.stats().shared_tokens


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_borrower_equals_a_copy_bit_for_bit(make_store, dtype, kind):
    if dtype in ("int8", "bfloat16") and kind != "full":
        pytest.skip("sliding and chunked layers need a float dtype")
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    store = _store(make_store, dtype, kind)
    rng = np.random.default_rng(1)
    d, prompt = _donor(store, rng)
    before = _content(d, 3)
    b = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [7, 8]]))
    assert len(b) == PROMPT
    unit = store._engine._off.page_unit
    assert _spans(store) == PROMPT // unit * unit > 0  # borrowed, not copied
    ref = _reference(store, d.id, PROMPT, np.concatenate([prompt, [7, 8]]))
    assert len(ref) == PROMPT and _spans(store) == PROMPT // unit * unit
    assert _same(_content(b, 3), _content(ref, 3))
    # both go on the same way: what they write lands past the span, in their own cells
    k, v = _kv(rng, store, 40)
    b.extend(k, v, tokens=np.arange(40))
    ref.extend(k, v, tokens=np.arange(40))
    assert _same(_content(b, 3), _content(ref, 3))
    assert _same(_content(d, 3), before)


def test_bytes_are_held_once(make_store):
    store = _store(make_store)
    rng = np.random.default_rng(2)
    _, prompt = _donor(store, rng, n=800, capacity=1024)
    path = "/dev/shm/" + next(f for f in os.listdir("/dev/shm") if f.startswith("skv_" + store.name + ".d"))
    held = os.stat(path).st_blocks
    bs = [store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [i]])) for i in range(6)]
    grown = (os.stat(path).st_blocks - held) * 512
    per_token = store.layout.layers * 2 * store._engine._off.cell_bytes
    assert grown < 6 * 300 * per_token  # each holds its own tail (capacity - span), never the 800 shared
    st = store.stats()
    assert st.shared_tokens == 6 * (800 // store._engine._off.page_unit * store._engine._off.page_unit)
    assert st.bytes_shared == st.shared_tokens * per_token
    for b in bs:
        b.free()
    assert store.stats().shared_tokens == 0


def test_writes_past_the_span_reach_no_one_else(make_store):
    store = _store(make_store)
    rng = np.random.default_rng(3)
    d, prompt = _donor(store, rng)
    base = _content(d, 3)
    b1 = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [1]]))
    b2 = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [2]]))
    d = store.sequence(d.id, write=True)
    news = {}
    for s in (b1, b2, d):
        k, v = _kv(rng, store, 25)
        s.extend(k, v, tokens=np.arange(25))
        news[s.id] = (k, v)
    for s in (b1, b2, d):
        k, v = news[s.id]
        for layer in range(3):
            assert np.array_equal(s.keys(layer)[:PROMPT], np.frombuffer(base[layer][0], np.float16).reshape(
                PROMPT, 4, 64))
            assert np.array_equal(s.keys(layer)[PROMPT:], k[layer].astype(np.float16))
            assert np.array_equal(s.values(layer)[PROMPT:], v[layer].astype(np.float16))


@pytest.mark.parametrize("op", ["truncate", "truncate_unit", "clear", "remove", "shift_left", "grow"])
def test_copy_on_write(make_store, op):
    store = _store(make_store)
    rng = np.random.default_rng(4)
    d, prompt = _donor(store, rng)
    donor_before = _content(d, 3)
    b = store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [1]]))
    ref = _reference(store, d.id, PROMPT)
    unit = store._engine._off.page_unit
    for s in (b, ref):
        if op == "truncate":
            s.truncate(101)
        elif op == "truncate_unit":
            s.truncate(10 * unit)
        elif op == "clear":
            s.clear()
        elif op == "remove":
            s.remove(20, 50)
        elif op == "shift_left":
            s.shift_left(33)
        else:  # past its capacity: it moves
            k, v = _kv(np.random.default_rng(9), store, 600)
            s.extend(k, v)
    assert _same(_content(b, 3), _content(ref, 3))
    k, v = _kv(rng, store, 70)  # writes after it: into b's own cells, never the donor's
    b.extend(k, v)
    ref.extend(k, v)
    assert _same(_content(b, 3), _content(ref, 3))
    assert _same(_content(d, 3), donor_before)
    kept = {"truncate": 101 // unit * unit, "truncate_unit": 10 * unit}  # whole page units it keeps: shared
    assert _spans(store) == kept.get(op, 0)


def test_donor_truncating_into_lent_cells_moves(make_store):
    store = _store(make_store)
    rng = np.random.default_rng(5)
    d, prompt = _donor(store, rng)
    b = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [1]]))
    b_before = _content(b, 3)
    start = next(s.start for s in store.sequences() if s.id == d.id)
    d = store.sequence(d.id, write=True)
    d.truncate(50)
    assert next(s.start for s in store.sequences() if s.id == d.id) != start  # moved away
    k, v = _kv(rng, store, 400)
    d.extend(k, v)
    assert _same(_content(b, 3), b_before)
    assert np.array_equal(d.keys(0)[50:], k[0].astype(np.float16))


@pytest.mark.parametrize("how", ["free", "evict"])
def test_donor_gone_keeps_its_borrowers(make_store, how):
    store = _store(make_store, max_tokens=4096)
    rng = np.random.default_rng(6)
    d, prompt = _donor(store, rng, capacity=1024)
    b = store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [1]]))
    before = _content(b, 3)
    if how == "free":
        store.sequence(d.id, write=True).free()
    else:  # fill the store: the finished donor is evicted for room, its lent cells are not reused
        fillers = []
        while store.stats().evictions == 0:
            s = store.create_sequence(capacity=512)
            k, v = _kv(rng, store, 512)
            s.extend(k, v)
            fillers.append(s)
    assert d.id not in [s.id for s in store.sequences()]
    with pytest.raises(shmkv.CacheFullError):  # the span's cells stay taken
        while True:
            s = store.create_sequence(capacity=256)
            k, v = _kv(rng, store, 256)
            s.extend(k, v)
    assert _same(_content(b, 3), before)
    free0 = store.stats().free_tokens
    b.free()  # the last borrower: the span's cells are free again
    unit = store._engine._off.page_unit
    assert free0 + 512 + PROMPT // unit * unit == store.stats().free_tokens


def test_chains_of_three(make_store):
    store = _store(make_store)
    rng = np.random.default_rng(7)
    d, p1 = _donor(store, rng)
    p2 = np.concatenate([p1, np.arange(5000, 5200)])
    b = store.create_sequence(capacity=1024, prefix=p2)
    k, v = _kv(rng, store, 200)
    b.extend(k, v, tokens=p2[PROMPT:])
    b.finish()
    p3 = np.concatenate([p2, [9]])
    c = store.create_sequence(capacity=1024, prefix=p3)
    assert len(c) == 500
    ref = _reference(store, b.id, 500)
    assert _same(_content(c, 3), _content(ref, 3))
    rows = {s.id: s for s in store.sequences()}
    unit = store._engine._off.page_unit
    assert store.stats().shared_tokens == 2 * (PROMPT // unit * unit)  # c borrows d's cells: chains resolve
    store.sequence(d.id, write=True).free()
    store.sequence(b.id, write=True).free()
    assert _same(_content(c, 3), _content(ref, 3))
    assert rows  # (the table was readable throughout)


@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_borrower_read_in_another_process(make_store, method, readonly):
    store = _store(make_store)
    rng = np.random.default_rng(8)
    _, prompt = _donor(store, rng)
    b = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [1]]))
    want = [(b.keys(i).tobytes(), b.values(i).tobytes()) for i in range(3)]
    assert run_in_process(read_sequence, store.name, b.id, readonly, start_method=method, timeout=60) == want
    if method == "fork":
        assert run_in_process(read_inherited, b, 3, start_method="fork", timeout=60) == want


def test_a_borrower_made_after_the_reader_attached(make_store):
    store = _store(make_store)
    reader = shmkv.attach(store.name, readonly=True)
    try:
        rng = np.random.default_rng(10)
        _, prompt = _donor(store, rng)
        b = store.create_sequence(capacity=1024, prefix=np.concatenate([prompt, [1]]))
        seen = reader.sequence(b.id)
        assert [seen.keys(i).tobytes() for i in range(3)] == [b.keys(i).tobytes() for i in range(3)]
        b.truncate(3)  # un-shared here; the reader re-maps at its next read
        k, v = _kv(rng, store, 10)
        b.extend(k, v)
        assert [seen.keys(i).tobytes() for i in range(3)] == [b.keys(i).tobytes() for i in range(3)]
    finally:
        reader.close()


def test_batch_kv_over_borrowers_is_a_view(make_store):
    store = _store(make_store)
    rng = np.random.default_rng(11)
    _, prompt = _donor(store, rng)
    unit = store._engine._off.page_unit
    seqs = store.create_sequences(4, capacity=64 * unit, prefix=[np.concatenate([prompt, [i]]) for i in range(4)])
    assert store.stats().shared_tokens == 4 * (PROMPT // unit * unit)
    K, V = store.batch_kv(seqs, 1)
    assert np.shares_memory(K, store._engine.K) and np.shares_memory(V, store._engine.V)
    for i, s in enumerate(seqs):
        assert np.array_equal(K[i], s.keys(1)) and np.array_equal(V[i], s.values(1))


def _data_mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("skv_" + name + ".d"))


def test_mapping_count_returns_to_its_start(make_store):
    store = _store(make_store)
    rng = np.random.default_rng(12)
    _, prompt = _donor(store, rng)
    gc.collect()
    start = _data_mappings(store.name)
    bs = [store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [i]])) for i in range(5)]
    assert _data_mappings(store.name) > start
    for b in bs:
        b.keys(0)
        b.free()
    del bs
    gc.collect()
    assert _data_mappings(store.name) == start


def test_a_lender_that_grows_never_slides_over_what_it_lent(make_store):
    """Growth may slide a sequence down into free cells before it, over its own old range: not a
    lender's (its old cells are its borrowers'); it moves instead (the random kills found it)."""
    store = _store(make_store, max_tokens=2048)
    rng = np.random.default_rng(13)
    x = store.create_sequence(capacity=200)
    prompt = np.arange(1000, 1040)
    d = store.create_sequence(capacity=64, prefix=prompt)  # a miss, on a page unit: cells 200..264
    k, v = _kv(rng, store, 40)
    d.extend(k, v, tokens=prompt)
    store.create_sequence(capacity=16)  # right after it: no growth in place
    b = store.create_sequence(capacity=128, prefix=np.concatenate([prompt, [1]]))
    assert _spans(store) == 32  # a live donor lends all but its last page unit (8 cells here)
    before = _content(b, 3)
    x.free()  # 200 free cells before d
    k2, v2 = _kv(rng, store, 70)
    d.extend(k2, v2)  # 110 > 64: it grows
    assert _same(_content(b, 3), before)
    assert np.array_equal(d.keys(0)[:40], k[0].astype(np.float16))
    assert np.array_equal(d.keys(0)[40:], k2[0].astype(np.float16))


@pytest.mark.slow
def test_chaos_with_sharing(make_store, tmp_path):
    """Two writers doing mixed operations on shared prompts (procs.crash.stress: reuses
    borrow; truncates, removes, shift_lefts, forks, frees un-share or release), SIGKILLed at random
    and restarted, beside a verifying read-only reader and a snapshotter: zero wrong reads, and
    after it all the store and the last snapshot hold every token's own K/V."""
    import signal
    import time

    from procs.crash import layout_for, state, stress
    from procs.share import snapshotter, verifier

    from shmkv import cli
    from shmkv.testing import start_in_process, unique_name

    seconds = float(os.environ.get("SHMKV_CHAOS_SECONDS", "6"))
    store = make_store(**dict(layout_for("share"), max_tokens=1024, max_seqs=24))
    path = str(tmp_path / "chaos.shmkv")
    rng = np.random.default_rng(int(os.environ.get("SHMKV_CHAOS_SEED", "21")))
    reader = start_in_process(verifier, store.name, seconds, start_method="fork", timeout=seconds + 60)
    snap = start_in_process(snapshotter, store.name, path, seconds, start_method="fork", timeout=seconds + 60)
    seed = 1000
    writers = [start_in_process(stress, store.name, seed + i, start_method="fork", timeout=seconds + 60)
               for i in range(2)]
    shared = kills = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(float(rng.uniform(0.005, 0.08)))
            i = int(rng.integers(0, 2))
            writers[i].kill(signal.SIGKILL)
            kills += 1
            seed += 1
            writers[i] = start_in_process(stress, store.name, seed + 2, start_method="fork", timeout=seconds + 60)
            shared = max(shared, store.stats().shared_tokens)
    finally:
        for w in writers:
            w.kill(signal.SIGKILL)
    got = reader.result()
    saves = snap.result()
    print(f"{kills} kills, reads {got}, {saves} saves, at most {shared} tokens shared")
    assert got["reads"] > 0 and saves > 0 and shared > 0
    with store.transaction():  # the next lock holder recovers
        pass
    assert cli.verify(store) == []
    state(store)
    loaded = shmkv.load(path, name=unique_name("chaos"))
    try:
        state(loaded)
    finally:
        loaded.unlink()


def test_a_reader_thread_beside_borrows_and_unshares(make_store):
    """Threads of one process share its mappings: a thread reading borrowers while another makes,
    un-shares and frees them reads every committed token's own K/V."""
    import threading

    store = _store(make_store)
    rng = np.random.default_rng(14)
    d, prompt = _donor(store, rng)
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


def test_an_odd_span_epoch_with_an_empty_log_ends_at_the_next_lock(make_store):
    """A holder killed after its frees inside a larger transaction left the log (journal invariant
    6) leaves the span epoch odd with nothing to roll back: the next lock entry ends it, so every
    process re-maps and none waits for it forever."""
    from shmkv._engine.table import header as _header

    store = _store(make_store)
    rng = np.random.default_rng(15)
    d, prompt = _donor(store, rng)
    b = store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [1]]))
    hdr = store._engine.hdr
    hdr[_header.W_SPANS] += 1  # as the dead holder left it
    assert hdr[_header.W_SPANS] & 1 and not hdr[_header.W_UNDO_COUNT]
    with store.transaction():
        pass
    assert not hdr[_header.W_SPANS] & 1
    b.truncate(5)  # the spans follow the table again
    assert _spans(store) == 0 and np.array_equal(b.keys(0), d.keys(0)[:5])
