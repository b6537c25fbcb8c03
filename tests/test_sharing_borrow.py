"""A reuse of a cached prefix borrows the donor's pages (docs/design.md §11): the borrower's first
cells are remapped, in every process, onto the donor's, instead of copied.

What a borrower holds is bit for bit what a copy holds, in every dtype, layout and page unit
(and what a model generates over it is what it generates over a DynamicCache); the shared
bytes are held once (stats and ``shmkv info`` count them once); shared cells are never written:
a borrower that changes its span copies on write, a donor that writes into what it lent moves
first, and a donor gone leaves its lent cells to its borrowers. fork() and copy_prefix() into an
empty sequence borrow too, and chains of borrows resolve to the cells of the first donor. A store
in which no span ever existed takes a fast path that gives exactly what the span path gives.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _sharing_scenes import D, H, L, data_mappings, kv_and_tokens, seeded_donor, start_of

import shmkv
from shmkv._engine.memory.intervals import covers
from shmkv._engine.spans import mappings as share
from shmkv._engine.table import header as _header
from shmkv._sequence.room import chunk
from shmkv.store._store import engine_of


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


# -- a borrower equals a copy --------------------------------------------------------------------


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


@pytest.mark.parametrize("case", [
    (3, 3, 40, "float16", 3001, 700),  # page unit 256, arrays not a whole number of pages
    (2, 3, 40, "int8", 9001, 2100),  # page unit 1,024 (scales of 12 bytes a cell)
    (5, 1, 8, "float32", 2999, 1100),
    (2, 2, 8, "bfloat16", 4097, 1500),
    (1, 5, 24, "float64", 1000, 300),
])
def test_odd_layouts_share_and_equal_copies(make_store, case):
    """Layouts whose arrays are no whole number of pages and large page units: a borrower truncated
    into its span (copy-on-write) and extended equals the same done with copies, bit for bit."""
    layers, heads, dim, dtype, max_tokens, n = case
    out = []
    for sharing in (True, False):
        share.ENABLED = sharing
        try:
            store = make_store(layers=layers, kv_heads=heads, head_dim=dim, dtype=dtype, max_tokens=max_tokens,
                               max_seqs=8)
            r = np.random.default_rng(0)
            k, v = r.standard_normal((2, layers, n, heads, dim))
            p = np.arange(n)
            d = store.create_sequence(capacity=n, prefix=p)
            d.extend(k, v, tokens=p)
            d.finish()
            f = store.create_sequence(capacity=n + 5, prefix=np.r_[p, [1]])
            assert len(f) == n
            assert (store.stats().shared_tokens > 0) == sharing
            f.truncate(n - 3)
            f.extend(k[:, :7], v[:, :7])
            out.append([(f.keys(i).tobytes(), f.values(i).tobytes(), d.keys(i).tobytes()) for i in range(layers)])
        finally:
            share.ENABLED = True
    assert _same(out[0], out[1])


def test_hf_generate_over_a_borrowed_system_prompt_equals_dynamic_cache(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shmkv.transformers import ShmkvCache, cache_kwargs

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.float32).eval()
    gen = {"do_sample": False, "max_new_tokens": 8, "return_dict_in_generate": True}

    def generate(ids, cache=None):
        args = dict(gen)
        if cache is not None:
            args.update(cache_kwargs(model, cache))
        with torch.no_grad():
            return model.generate(ids, **args).sequences

    from shmkv.testing import unique_name

    owner = ShmkvCache.from_config(cfg, unique_name("hfa"), dtype="float32")
    try:
        store = owner.store
        g = torch.Generator().manual_seed(1)
        system = torch.randint(3, 96, (1, 100), generator=g)  # 100 tokens: 3 page units of 32 cells
        first = ShmkvCache.for_prompt(store, system)
        first.finish(generate(system, first))
        prompts = [torch.cat([system, torch.randint(3, 96, (1, 7), generator=g)], 1) for _ in range(3)]
        assert len({p[0, 100].item() for p in prompts}) == 3  # (each request's own tokens from 100 on)
        caches = [ShmkvCache.for_prompt(store, p) for p in prompts]
        assert all(c.get_seq_length() == 100 for c in caches)
        assert store.stats().shared_tokens >= 3 * 96  # every request borrows the system prompt's pages
        for p, c in zip(prompts, caches, strict=True):
            assert torch.equal(generate(p, c), generate(p, transformers.DynamicCache()))
        for c in caches:
            c.free()
    finally:
        owner.close()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_transparent_huge_pages_on_dev_shm():
    """/dev/shm mounted with huge=always (2 MiB pages; spans remapped and punched at 4 KiB): a
    private tmpfs in a private mount namespace, nothing else's /dev/shm touched."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from procs.share_reads import "
            "borrow_truncate_compare; sys.exit(0 if borrow_truncate_compare() else 1)")
    script = (f"mount -t tmpfs -o size=512m,huge=always tmpfs /dev/shm && "
              f"exec {sys.executable} -c '{code}' {os.path.dirname(os.path.abspath(__file__))}")
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=120)
    if "mount:" in out.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr[-2000:]


# -- the shared bytes are held once ----------------------------------------------------------------


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


def test_stats_and_info_count_a_span_once_when_its_donor_is_gone(make_store, capsys):
    """int8 4x64 (page unit 256): 4 borrowers of a 300-token donor read a 256-cell span and hold
    44 cells each; the donor freed, the span's one copy is still held (by them): 432 cells."""
    from shmkv.cli import main

    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=16384, max_seqs=32)
    assert engine_of(st).page_unit == 256
    d, p = seeded_donor(st, n=300)
    for i in range(4):
        st.create_sequence(capacity=1024, prefix=np.r_[p, [i]])
    s = st.stats()
    assert (s.shared_tokens, s.span_cells) == (4 * 256, 256)
    kv = s.bytes_per_token - 16
    assert s.bytes_held == (300 + 4 * 44) * kv + 1500 * 16  # the donor holds the span
    d.free()
    s = st.stats()
    assert (s.tokens, s.shared_tokens, s.span_cells) == (1200, 4 * 256, 256)
    assert s.bytes_held == (256 + 4 * 44) * kv + 1200 * 16
    assert main(["info", st.name]) == 0
    out = capsys.readouterr().out
    assert f"sharing ratio {s.bytes_used / s.bytes_held:.2f}" in out
    from shmkv.cli._words import size

    assert f"({size(256 * kv)} held once)" in out  # (in the unit that reads best: KiB here)


def test_a_range_punched_by_another_attachment_is_reserved_again(make_store):
    """Attachment C reserved cells R (a sequence written and freed there); attachment B's
    borrower at R punches R's pages out and is freed (the holes stay). C's next sequence at R
    allocates them again (fallocate, a chunk ahead of its first append: _sequence/room.py)
    before anything writes: on a full /dev/shm that is a CacheFullError, never a SIGBUS at
    the first append. (C's record of what it reserved is stale: the borrow moved the span epoch.)"""
    st = _store(make_store)
    _, p = seeded_donor(st, n=300, capacity=1024)
    c = shmkv.attach(st.name)
    try:
        fd = engine_of(st)._dseg.fileno()
        x = c.create_sequence(capacity=1024)
        full = np.ones((L, 1024, H, D))
        x.extend(full, full)  # C allocates all of R
        r = start_of(c, x.id)
        x.free()
        before = os.fstat(fd).st_blocks
        f = st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])
        m = st.stats().shared_tokens
        assert start_of(st, f.id) == r and m > 0
        f.free()
        holes = os.fstat(fd).st_blocks
        assert holes < before  # the borrower's punched pages: holes
        y = c.create_sequence(capacity=1024)
        assert start_of(c, y.id) == r
        one = np.ones((H, D), np.float16)
        for layer in range(L):
            y.append(layer, one, one)
        e = engine_of(st)
        cells = chunk(1024, e.page_unit, e.kv_bytes(L))
        assert cells <= m  # (the chunk lies inside the old holes)
        # allocated before the write: the whole chunk's K/V pages, not only the token's own page
        assert (os.fstat(fd).st_blocks - holes) * 512 >= cells * 2 * L * H * D * 2
        y.commit()
        k = np.ones((L, 10, H, D))
        y.extend(k, k)
        assert np.array_equal(np.asarray(y.keys(0)), np.ones((11, H, D), np.float16))
    finally:
        c.close()


# -- shared cells are never written: copy-on-write, a moving donor --------------------------------


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
def test_a_borrower_changing_its_span_copies_on_write(make_store, op):
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


def test_a_lender_that_grows_never_slides_over_what_it_lent(make_store):
    """Growth may slide a sequence down into free cells before it, over its own old range: not a
    lender's (its old cells are its borrowers'); it moves instead."""
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


# -- fork, copy_prefix, chains, batches ------------------------------------------------------------


def test_fork_and_copy_prefix_borrow(make_store):
    """fork() and store.copy_prefix() into an empty sequence on a page unit borrow the source's
    whole units (a live source: all but its last unit) and read exactly the source's tokens;
    writes after them stay each sequence's own."""
    st = _store(make_store)
    u = engine_of(st).page_unit
    d, _ = seeded_donor(st, n=300, capacity=1024, finish=False)
    want = kv_and_tokens(d)
    child = d.fork()
    assert st.stats().shared_tokens == (300 - u) // u * u
    assert kv_and_tokens(child) == want
    dst = st.create_sequence(capacity=1024, prefix=[5, 6, 7])  # a miss, on a page unit
    st.copy_prefix(d.id, dst.id, 200)
    assert st.stats().shared_tokens == (300 - u) // u * u + 200 // u * u
    assert kv_and_tokens(dst) == [(k[: 200 * len(k) // 300], v[: 200 * len(v) // 300]) for k, v in want[:L]] + [
        want[L][: 200 * 8]]
    rng = np.random.default_rng(3)
    k = rng.standard_normal((L, 50, H, D))
    child.truncate(100)  # into its span: copy-on-write
    child.extend(k, k)
    dst.extend(k, k)
    d.extend(-k, -k)
    assert kv_and_tokens(d)[0][0][: len(want[0][0])] == want[0][0]
    assert np.array_equal(np.asarray(child.keys(0))[100:], k[0].astype(np.float16))
    assert np.array_equal(np.asarray(dst.keys(0))[200:], k[0].astype(np.float16))
    assert np.array_equal(np.asarray(d.keys(0))[300:], -k[0].astype(np.float16))
    assert np.asarray(child.keys(0))[:100].tobytes() == want[0][0][: 100 * H * D * 2]


@pytest.mark.parametrize("sharing", [True, False])
def test_no_aligned_range_copies_instead_of_evicting(make_store, monkeypatch, sharing):
    """int8 3x40: a page unit of 1,024 cells. A 2,100-token donor and a request of capacity
    2,105 in a 5,003-cell store: only an unaligned range (at cell 2,100) fits; the request takes
    it and copies the prefix, evicting nothing (the copy a store without shared pages makes;
    sharing off: no alignment at all)."""
    monkeypatch.setattr(share, "ENABLED", sharing)
    n = 2100
    st = make_store(layers=2, kv_heads=3, head_dim=40, dtype="int8", max_tokens=5003, max_seqs=8)
    assert engine_of(st).page_unit == 1024
    d, p = seeded_donor(st, n=n, capacity=n, first=0)
    want = kv_and_tokens(d, 2)
    f = st.create_sequence(capacity=n + 5, prefix=np.r_[p, [1]])
    assert len(f) == n and st.stats().evictions == 0
    assert d.id in [i.id for i in st.sequences()]
    assert kv_and_tokens(f, 2) == want and kv_and_tokens(d, 2) == want


def test_a_chain_of_three_reads_the_first_donors_cells(make_store):
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


def test_mapping_count_returns_to_its_start(make_store):
    store = _store(make_store)
    rng = np.random.default_rng(12)
    _, prompt = _donor(store, rng)
    gc.collect()
    start = data_mappings(store.name)
    bs = [store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [i]])) for i in range(5)]
    assert data_mappings(store.name) > start
    for b in bs:
        b.keys(0)
        b.free()
    del bs
    gc.collect()
    assert data_mappings(store.name) == start


# -- the no-span fast path gives what the span path gives --------------------------------------------


def _seeded_kv(seed, n):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, n, H, D)), rng.standard_normal((L, n, H, D))


def _script(st):
    """The same operations on any store: a prompt donor, a reuse of it (a borrow when sharing
    is on), a plain sequence; speculative truncates, copy_prefix into an empty and into a full
    sequence, appends after each. Returns every sequence's content after each step."""
    prompt = np.arange(1000, 1300)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    k, v = _seeded_kv(1, 300)
    d.extend(k, v, tokens=prompt)
    d.finish()
    b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [7]])  # reuses 300 tokens
    plain = st.create_sequence(capacity=1024)
    k2, v2 = _seeded_kv(2, 200)
    plain.extend(k2, v2)
    seqs = [d, b, plain]
    out = [[kv_and_tokens(s) for s in seqs]]
    kk, vv = _seeded_kv(3, 1)
    for step in range(6):  # speculative decoding: append a draft token, roll it back, keep one
        for s in (b, plain):
            for layer in range(L):
                s.append(layer, kk[layer, 0], vv[layer, 0])
            s.commit()
            s.truncate(s.length - 1)
            for layer in range(L):
                s.append(layer, kk[layer, 0] + step, vv[layer, 0] - step)
            s.commit()
        out.append([kv_and_tokens(s) for s in seqs])
    b.truncate(100)  # into its span (with sharing: copy-on-write)
    plain.truncate(150)
    out.append([kv_and_tokens(s) for s in seqs])
    empty = st.create_sequence(capacity=1024)
    empty.release()
    st.copy_prefix(d.id, empty.id, 280)  # into an empty sequence (with sharing on a page unit: a borrow)
    st.copy_prefix(b.id, plain.id, 100)  # into a sequence that holds tokens
    seqs.append(st.sequence(empty.id, write=True))
    out.append([kv_and_tokens(s) for s in seqs])
    k3, v3 = _seeded_kv(4, 40)
    for s in seqs[1:]:
        s.extend(k3, v3)
    out.append([kv_and_tokens(s) for s in seqs])
    return out


def test_no_span_fast_path_and_span_path_give_the_same_results(make_store, monkeypatch):
    shared = _store(make_store)
    with_spans = _script(shared)
    assert shared.stats().shared_tokens > 0 and engine_of(shared).hdr[_header.W_SPANS] > 0
    monkeypatch.setattr(share, "ENABLED", False)
    plain = _store(make_store)
    without = _script(plain)
    assert plain.stats().shared_tokens == 0
    assert engine_of(plain).hdr[_header.W_SPANS] == 0  # no span ever: every change took the fast path
    assert with_spans == without


def test_the_first_borrow_of_a_store_still_settles(make_store):
    """The fast path is decided on the span epoch at each bracket: a row that starts borrowing
    or lending in the store's first span change is still settled afterwards (a donor truncated
    into the cells it lent moves, its borrower keeps the old bytes)."""
    st = _store(make_store)
    e = engine_of(st)
    assert e.hdr[_header.W_SPANS] == 0
    src = st.create_sequence(capacity=1024)
    k, v = _seeded_kv(5, 300)
    src.extend(k, v)
    src.finish()
    dst = st.create_sequence(capacity=1024)
    dst.release()
    before = kv_and_tokens(src)
    st.copy_prefix(src.id, dst.id, 300)  # the store's first span
    assert e.hdr[_header.W_SPANS] > 0 and st.stats().shared_tokens > 0
    start = start_of(st, src.id)
    src = st.sequence(src.id, write=True)
    src.truncate(10)  # into what it lent: it moves, the borrower keeps its cells
    assert start_of(st, src.id) != start
    k2, v2 = _seeded_kv(6, 290)
    src.extend(k2, v2)
    assert kv_and_tokens(dst) == before
    assert np.asarray(src.keys(0))[10:].tobytes() == k2[0].astype(np.float16).tobytes()


def test_own_span_changes_keep_the_reservation_record(make_store):
    """A process's own borrow punches only the borrower's pages, and takes exactly those out of
    its reservation record (Shares.punch): the rest of the record stays (no fallocate again of
    every range it reserved, e.g. a copy_prefix's fresh range after a borrow). A span change by
    another attachment drops the record (its punches are not known here:
    test_a_range_punched_by_another_attachment_is_reserved_again)."""
    st = _store(make_store)
    e = engine_of(st)
    prompt = np.arange(500, 800)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    k, v = _seeded_kv(7, 300)
    d.extend(k, v, tokens=prompt)
    d.finish()
    ds = start_of(st, d.id)
    assert covers(e.pages.record()[False], ds, ds + 300)  # (its pages: what it wrote, tests/test_lazy_pages.py)
    b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
    assert st.stats().shared_tokens > 0
    bs, u = start_of(st, b.id), e.page_unit
    rec = e.pages.record()[False]
    assert covers(rec, ds, ds + 300)  # kept across this process's own span change
    assert not covers(rec, bs, bs + u)  # ... but for the borrower's punched pages
    b.free()  # its span released (the holes stay): still this process's own change
    assert covers(e.pages.record()[False], ds, ds + 300)
    c = shmkv.attach(st.name)
    try:
        c.create_sequence(capacity=1024, prefix=np.r_[prompt, [2]])  # a borrow by another attachment
        assert c.stats().shared_tokens > 0
        assert e.pages.record() == ([], [])  # dropped: re-reserved on next use
    finally:
        c.close()


@pytest.mark.parametrize("sharing", [True, False])
def test_length_reads_no_cells_and_follows_the_row(make_store, monkeypatch, sharing):
    """seq.length, capacity and remaining_capacity skip the shared-page mapping check (they read
    no cells) and still see another attachment's changes at once."""
    monkeypatch.setattr(share, "ENABLED", sharing)
    st = _store(make_store)
    prompt = np.arange(100, 400)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    k, v = _seeded_kv(8, 300)
    d.extend(k, v, tokens=prompt)
    d.finish()
    b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [3]])
    b.release()
    c = shmkv.attach(st.name)
    try:
        seen = c.sequence(b.id)
        assert (seen.length, seen.capacity) == (300, 1024)
        w = st.sequence(b.id, write=True)
        w.truncate(37)
        assert seen.length == 37 and seen.remaining_capacity == 1024 - 37
        assert np.asarray(seen.keys(0)).tobytes() == np.asarray(w.keys(0)).tobytes()
        assert (st.stats().shared_tokens > 0) == sharing
    finally:
        c.close()


@pytest.mark.parametrize("source", ["file", "stream"])
def test_a_restored_prompt_lends_its_pages_again(make_store, tmp_path, source):
    """restore places a sequence as create_sequence(prefix=) places a prompt, on a page unit, so a
    reuse of a restored prompt borrows its pages instead of copying them (int8 4x64: a 256-cell
    unit; the first sequence restored takes 300 cells, so first fit alone puts the next off a unit)."""
    import io

    kw = dict(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=16384, max_seqs=32)
    st = make_store(**kw)
    u = engine_of(st).page_unit
    assert u == 256
    other = st.create_sequence(capacity=300)
    rng = np.random.default_rng(9)
    other.extend(rng.standard_normal((L, 10, H, D)), rng.standard_normal((L, 10, H, D)), tokens=np.arange(10))
    d, p = seeded_donor(st, n=600)
    path = tmp_path / "s.shmkv"
    st.save(str(path))
    want = kv_and_tokens(d)
    dst = make_store(**kw)
    dst.restore(str(path) if source == "file" else io.BytesIO(path.read_bytes()))
    assert start_of(dst, other.id) == 0 and start_of(dst, d.id) % u == 0
    b = dst.create_sequence(capacity=1024, prefix=np.r_[p, [7]])
    assert len(b) == 600 and dst.stats().shared_tokens == 600 // u * u
    assert kv_and_tokens(b) == want == kv_and_tokens(dst.sequence(d.id))


def test_a_restore_with_no_range_on_a_page_unit_takes_another(make_store, tmp_path, monkeypatch):
    """Where no range on a page unit is free, restore takes one off it (and the sequence copies
    at its reuses) rather than fail: as a new prompt does."""
    kw = dict(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=16384, max_seqs=32)
    st = make_store(**kw)
    st.create_sequence(capacity=300).extend(np.ones((L, 3, H, D)), np.ones((L, 3, H, D)), tokens=[1, 2, 3])
    d, p = seeded_donor(st, n=600)
    path = tmp_path / "s.shmkv"
    st.save(str(path))
    dst = make_store(**kw)
    e = engine_of(dst)
    real = e.alloc
    asked = []

    def alloc(capacity, *a, align=1, **k):
        asked.append(align)
        if align > 1:
            raise shmkv.CacheFullError("no range on a page unit (a test's)")
        return real(capacity, *a, align=align, **k)

    monkeypatch.setattr(e, "alloc", alloc)
    dst.restore(str(path))
    monkeypatch.undo()
    assert asked == [256, 1, 256, 1] and start_of(dst, d.id) == 300
    assert kv_and_tokens(dst.sequence(d.id)) == kv_and_tokens(d)
    b = dst.create_sequence(capacity=1024, prefix=np.r_[p, [7]])
    assert len(b) == 600 and dst.stats().shared_tokens == 0


@pytest.mark.parametrize("room", ["move", "slide"])
def test_a_prompt_that_grows_keeps_to_a_page_unit_and_lends_again(make_store, room):
    """A prompt's range starts on a page unit (it may lend); when it outgrows its capacity and
    leaves its range, it goes to a start on a unit where one is free (moved past its neighbour,
    or slid down into the cells a freed sequence left), so a later reuse of it (the next turn
    of a conversation) still borrows its pages (int8 4x64: a 256-cell unit)."""
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=16384, max_seqs=32)
    u = engine_of(st).page_unit
    ones = np.ones((L, 5, H, D))
    first = st.create_sequence(capacity=1000 if room == "slide" else 300)
    first.extend(ones, ones, tokens=np.arange(5))
    p = np.arange(1000, 1300)
    d = st.create_sequence(capacity=300, prefix=p)
    rng = np.random.default_rng(4)
    d.extend(rng.standard_normal((L, 300, H, D)), rng.standard_normal((L, 300, H, D)), tokens=p)
    after = st.create_sequence(capacity=300)  # right after d: d cannot grow in place
    after.extend(ones, ones, tokens=np.arange(5))
    assert start_of(st, d.id) % u == 0 and start_of(st, after.id) == start_of(st, d.id) + 300
    if room == "slide":
        first.free()  # 1024 free cells before d: an unaligned slide would start at 724
    was = start_of(st, d.id)
    answer = np.arange(5000, 5100)
    d.extend(rng.standard_normal((L, 100, H, D)), rng.standard_normal((L, 100, H, D)), tokens=answer)
    d.finish()
    assert start_of(st, d.id) != was and start_of(st, d.id) % u == 0
    b = st.create_sequence(capacity=1024, prefix=np.r_[p, answer, [7]])
    assert len(b) == 400 and st.stats().shared_tokens == 400 // u * u
    assert kv_and_tokens(b) == kv_and_tokens(d)


def test_a_prompt_with_no_range_on_a_page_unit_grows_anyway(make_store, monkeypatch):
    """Where the free range first fit picks holds no range on a page unit, a growing prompt moves
    as any sequence does (it copies at its reuses), rather than evict or fail."""
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=16384, max_seqs=32)
    u = engine_of(st).page_unit
    ones = np.ones((L, 5, H, D))
    st.create_sequence(capacity=300).extend(ones, ones, tokens=np.arange(5))
    p = np.arange(1000, 1300)
    d = st.create_sequence(capacity=300, prefix=p)
    d.extend(np.ones((L, 300, H, D)), np.ones((L, 300, H, D)), tokens=p)
    st.create_sequence(capacity=300).extend(ones, ones, tokens=np.arange(5))
    from shmkv._engine.placement import arena

    asked = []

    def on_unit(gaps, fit, capacity, unit):
        asked.append(unit)
        return fit  # (the free range first fit picks holds it on no unit)

    monkeypatch.setattr(arena, "_on_unit", on_unit)
    d.extend(np.ones((L, 100, H, D)), np.ones((L, 100, H, D)), tokens=np.arange(5000, 5100))
    monkeypatch.undo()
    assert asked == [u]  # the move was asked to keep to a unit
    assert start_of(st, d.id) % u != 0 and len(d) == 400
    assert np.array_equal(d.tokens, np.r_[p, np.arange(5000, 5100)])


@pytest.mark.parametrize("op", ["lender_truncates", "copy_prefix_into", "remove"])
def test_every_move_of_a_range_on_a_page_unit_keeps_to_one(make_store, op):
    """A lender that truncates below what it lent, a copy_prefix into a sequence that holds
    tokens, and a remove each write the sequence into a fresh range; one that started on a page
    unit (a prompt: it may lend) gets another on one where one is free, as growth does (int8 4x64:
    a 256-cell unit; a 300-cell sequence after it makes the first free cell fall off a unit)."""
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="int8", max_tokens=16384, max_seqs=32)
    u = engine_of(st).page_unit
    d, p = seeded_donor(st, n=600, capacity=1024, finish=op != "lender_truncates")
    want = kv_and_tokens(d)
    b = st.create_sequence(capacity=1024, prefix=np.r_[p, [7]])  # borrows d's first 512 (live: 256) cells
    st.create_sequence(capacity=300).extend(np.ones((L, 5, H, D)), np.ones((L, 5, H, D)), tokens=np.arange(5))
    assert start_of(st, d.id) % u == 0 and st.stats().shared_tokens == (256 if op == "lender_truncates" else 512)
    was = start_of(st, d.id)
    if op == "lender_truncates":  # d, live, lent all but its last unit: below 256 it moves
        d.truncate(100)
        assert kv_and_tokens(d) == [(k[: len(k) // 6], v[: len(v) // 6]) for k, v in want[:L]] + [want[L][:800]]
    elif op == "copy_prefix_into":  # into b, which holds 600 tokens: b's fresh range
        was = start_of(st, b.id)
        st.copy_prefix(d.id, b.id, 400)
        assert kv_and_tokens(b) == [(k[: len(k) * 2 // 3], v[: len(v) * 2 // 3]) for k, v in want[:L]] + \
            [want[L][:3200]]
        d = b
    else:
        d = st.sequence(d.id, write=True)
        d.remove(100, 200)
        assert d.tokens.tolist() == np.r_[p[:100], p[200:]].tolist()
    assert start_of(st, d.id) != was and start_of(st, d.id) % u == 0


def test_keeping_to_a_page_unit_costs_no_cells(make_store):
    """Keeping to a page unit never takes more of max_tokens than growth took before it did:
    sequences shorter than a unit are not lined up on units (a 300-cell create still fits, with
    nothing evicted), and a prompt that can only slide takes the size a slide takes (the cells it
    needs, not twice its capacity) on a unit. float16 1x8: a 256-cell unit."""
    one = np.ones((1, 1, 1, 8))
    st = make_store(layers=1, kv_heads=1, head_dim=8, dtype="float16", max_tokens=1024, max_seqs=16)
    assert engine_of(st).page_unit == 256
    made = [st.create_sequence(capacity=1), st.create_sequence(capacity=1)]  # cells 0 and 1
    for i in range(7):  # each time one at cell 0 (a unit's start) grows to 2 cells and moves
        a = made[0] if i == 0 else st.create_sequence(capacity=1)
        made.append(a)
        a.extend(one, one, tokens=[1])
        a.extend(one, one, tokens=[2])
    s = st.stats()
    assert s.largest_free_range == s.free_tokens == 1009
    made[2].finish()
    st.create_sequence(capacity=300)
    assert st.stats().evictions == 0

    st = make_store(layers=1, kv_heads=1, head_dim=8, dtype="float16", max_tokens=1024, max_seqs=8)
    z = st.create_sequence(capacity=256)  # [0, 256)
    p = st.create_sequence(capacity=300, prefix=np.arange(10))  # a prompt: [256, 556)
    p.extend(np.ones((1, 10, 1, 8)), np.ones((1, 10, 1, 8)), tokens=np.arange(10))
    st.create_sequence(capacity=100)  # [556, 656): p cannot grow in place
    z.free()
    p.extend(np.full((1, 400, 1, 8), 2.0), np.full((1, 400, 1, 8), 3.0), tokens=np.arange(10, 410))
    assert (start_of(st, p.id) % 256, p.capacity, st.stats().free_tokens) == (0, 410, 514)  # (a slide: 146)
    assert np.array_equal(p.keys(0)[:, 0, 0], np.r_[np.ones(10), np.full(400, 2.0)])
    st.create_sequence(capacity=400)


@pytest.mark.parametrize("op", ["remove", "shift_left", "copy_prefix"])
def test_a_move_keeps_to_a_unit_only_inside_the_free_range_first_fit_picks(make_store, op):
    """A moved prompt's new range starts on a unit only inside the free range first fit picks:
    a later, larger free range is never split for it (a 2600-cell create still fits, with
    nothing evicted). float16 1x8: a 256-cell unit; free: [301, 700), [701, 3500), [3501, ...)."""
    st = make_store(layers=1, kv_heads=1, head_dim=8, dtype="float16", max_tokens=4096, max_seqs=6)
    kv = np.arange(80, dtype=np.float64).reshape(1, 10, 1, 8)
    s = st.create_sequence(capacity=300, prefix=np.arange(10))  # [0, 300): on a unit
    s.extend(kv, kv, tokens=np.arange(10))
    one = st.create_sequence(capacity=1)  # 300
    one.extend(np.full((1, 1, 1, 8), 7.0), np.full((1, 1, 1, 8), 7.0), tokens=[99])
    f = st.create_sequence(capacity=399)  # [301, 700)
    st.create_sequence(capacity=1)  # 700
    g = st.create_sequence(capacity=2799)  # [701, 3500)
    st.create_sequence(capacity=1)  # 3500
    f.free()
    g.free()
    if op == "remove":
        s.remove(0, 5)
    elif op == "shift_left":
        s.shift_left(5)
    else:
        st.copy_prefix(one.id, s.id, 1)
    assert 301 <= start_of(st, s.id) < 700  # (no unit in [301, 700) holds 300 cells)
    s.finish()
    st.create_sequence(capacity=2600)
    assert st.stats().evictions == 0
