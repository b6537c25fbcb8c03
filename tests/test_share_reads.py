"""Reads of shared prefix pages (a borrower's first cells remapped in place in every process):
each read is compared bit for bit with a reference built without
sharing (a store of the same layout, or a copy), across processes, after the cells a process
mapped as a span were freed and reused by another process, and after structural operations
on donors and borrowers."""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from procs.share_reads import digest, free_and_reuse, kv, kv_of

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv.cli import verify
from shmkv._engine.table.header import START
from shmkv.store._store import engine_of
from shmkv.testing import run_in_process

L, H, D = 3, 4, 64  # float16: 512 bytes a cell, a page unit of 8 cells
PROMPT = 300


def _store(make_store, dtype="float16", **kw):
    args = dict(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=32)
    return make_store(**{**args, **kw})


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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
@pytest.mark.parametrize("readonly", [True, False])
def test_a_reader_in_another_pid_namespace_reads_the_borrower(make_store, readonly):
    store = _store(make_store)
    d, f = _with_borrower(store)
    f.release()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from procs.share_reads import digest; "
            "print(*digest(sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1'))")
    out = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", code,
                          os.path.dirname(__file__), store.name, str(f.id), "1" if readonly else "0"],
                         capture_output=True, text=True, timeout=60, check=True)
    h, n = out.stdout.split()
    assert (h, int(n)) == digest(store.name, d.id, True)


# -- one process, three readers (rw attachment, ro attachment, the writer's own store object) while
# a writer borrows, copies on write, frees, reuses cells, removes and forks ------------------------


def _kv_of(tokens) -> tuple[np.ndarray, np.ndarray]:
    """K/V that are a function of each token id (exact in float16): any cell read can be checked."""
    return kv_of(tokens, L, H, D)


def _verify(seq) -> bool | None:
    """Whether a seqlocked copy of every layer holds the K/V of the sequence's token ids (None:
    the length changed between the two reads)."""
    toks = np.array(seq.tokens)
    ek, ev = _kv_of(toks)
    for layer in range(L):
        k, v = seq.read(layer)
        if len(k) != len(toks):
            return None
        if not (np.array_equal(k, ek[layer].astype(np.float16)) and np.array_equal(v, ev[layer].astype(np.float16))):
            return False
    return True


def _writer(store, ops: int, rng) -> int:
    prompt = np.arange(1000, 1300)
    spans = 0
    for _ in range(ops):
        live = [s.id for s in store.sequences() if s.id != 1]
        op = 1 if len(live) > 16 else int(rng.integers(0, 5))
        if op == 0 or len(live) < 2:  # a borrower (shares when the match covers a page unit)
            toks = np.r_[prompt[: rng.integers(20, 300)], 9000 + rng.integers(0, 1000, 5)]
            f = store.create_sequence(capacity=512, prefix=toks)
            k, v = _kv_of(toks[len(f):])
            f.extend(k, v, tokens=toks[len(f):])
            f.release()
        elif op == 1:  # free one, and a new sequence likely on its cells
            store.sequence(int(rng.choice(live)), write=True).free()
            toks = 5000 + rng.integers(0, 3000, rng.integers(10, 400))
            g = store.create_sequence(capacity=512)
            k, v = _kv_of(toks)
            g.extend(k, v, tokens=toks)
            g.release()
        elif op == 2:  # truncate (copy-on-write inside a span) and extend
            s = store.sequence(int(rng.choice(live)), write=True)
            s.truncate(int(rng.integers(0, len(s) + 1)))
            toks = 7000 + rng.integers(0, 1000, rng.integers(1, 50))
            k, v = _kv_of(toks)
            s.extend(k, v, tokens=toks)
            s.release()
        elif op == 3:
            s = store.sequence(int(rng.choice(live)), write=True)
            if len(s) > 10:
                s.remove(int(rng.integers(0, 5)), int(rng.integers(5, 10)))
            s.release()
        else:
            s = store.sequence(int(rng.choice(live)))
            if len(s):
                s.fork().release()
        spans += store.stats().shared_tokens > 0
    return spans


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_threads_reading_while_spans_come_and_go(make_store, seed):
    import threading

    store = _store(make_store, max_tokens=32768)
    prompt = np.arange(1000, 1300)
    d = store.create_sequence(capacity=512, prefix=prompt)
    k, v = _kv_of(prompt)
    d.extend(k, v, tokens=prompt)
    d.finish()
    done = threading.Event()
    results: list[dict[str, int]] = []

    def reader(mode: str) -> None:
        s = store if mode == "same" else shmkv.attach(store.name, readonly=mode == "ro")
        got = {"ok": 0, "bad": 0}
        try:
            while not done.is_set() or not got["ok"]:
                for info in s.sequences():
                    try:
                        r = _verify(s.sequence(info.id))
                    except shmkv.SequenceNotFound:
                        continue
                    if r is not None:
                        got["ok" if r else "bad"] += 1
        finally:
            if s is not store:
                s.close()
            results.append(got)

    threads = [threading.Thread(target=reader, args=(m,), daemon=True) for m in ("rw", "ro", "same")]
    for t in threads:
        t.start()
    try:
        spans = _writer(store, 300, np.random.default_rng(seed))
    finally:
        done.set()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert spans > 10  # the attack ran over shared pages
    assert len(results) == 3 and all(r["ok"] for r in results)
    assert sum(r["bad"] for r in results) == 0, results


# -- the Hugging Face adapter over borrowed rows -------------------------------------------------------


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


# -- SIGKILL inside every share.* unit, with other processes' mappings of the spans -------------------


@pytest.mark.slow
@pytest.mark.parametrize(("point", "op"), [("share.borrowed", "borrow"), ("share.unshared", "unshare"),
                                           ("share.released", "release"), ("share.moved", "move")])
def test_a_kill_inside_a_share_unit_leaves_every_read_right(make_store, point, op):
    """A child is SIGKILLed inside a share.* unit. A read-only attachment (which mapped the spans
    before) reads every sequence right both before anyone recovers (the dead unit read as rolled
    back) and after; this process then recovers, writes, borrows again, and reads right too."""
    store = _store(make_store)
    prompt = np.arange(1000, 1300)
    d = store.create_sequence(capacity=512, prefix=prompt)
    k, v = _kv_of(prompt)
    d.extend(k, v, tokens=prompt)
    d.finish()
    f = store.create_sequence(capacity=512, prefix=np.r_[prompt[:250], [77]])
    k, v = _kv_of([77])
    f.extend(k, v, tokens=[77])
    f.release()
    assert store.stats().shared_tokens >= 240
    ro = shmkv.attach(store.name, readonly=True)
    try:
        def all_right(s) -> int:
            n = 0
            for info in s.sequences():
                assert _verify(s.sequence(info.id)) is True, info
                n += 1
            return n

        assert all_right(ro) == 2
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from procs.share_reads import crash_op; "
                "crash_op(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))")
        env = {**os.environ, "SHMKV_CRASH_AT": point}
        proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), store.name, op, str(d.id),
                               str(f.id)], env=env, capture_output=True, timeout=60)
        assert proc.returncode == -9, proc.stderr.decode()[-2000:]
        assert all_right(ro) == 2  # before recovery: the dead unit's rows as a rollback leaves them
        toks = np.r_[prompt[:200], [88, 89]]
        g = store.create_sequence(capacity=512, prefix=toks)  # recovers, borrows
        k, v = _kv_of(toks[len(g):])
        g.extend(k, v, tokens=toks[len(g):])
        fw = store.sequence(f.id, write=True)
        fw.truncate(99)  # copy-on-write after the recovery
        k, v = _kv_of(np.arange(3000, 3040))
        fw.extend(k, v, tokens=np.arange(3000, 3040))
        assert all_right(store) == 3 and all_right(ro) == 3
        assert verify(store) == []
    finally:
        ro.close()


# -- allocation and eviction under pressure: spans never overlap what others write ---------------------


def _invariants(store) -> str | None:
    """No two live ranges overlap; a span's cells, and those a truncated borrower keeps taken
    (``SPAN_TAKEN``), are in no live range but their owner's (the row at the span's first cell,
    borrowing nothing, at least that long: it never writes them)."""
    from shmkv._engine.table.header import CAPACITY, ID, LENGTH, LIVE, SPAN_CELLS, SPAN_PHYS, SPAN_TAKEN, STATE

    t = engine_of(store).table_np
    live = t[t[:, STATE] == LIVE]
    ranges = sorted((int(r[START]), int(r[START] + r[CAPACITY]), int(r[ID])) for r in live)
    for (_, a1, i), (b0, _, j) in itertools.pairwise(ranges):
        if a1 > b0:
            return f"the ranges of sequences {i} and {j} overlap"
    for r in live[live[:, SPAN_TAKEN] > 0]:
        p, m = int(r[SPAN_PHYS]), int(r[SPAN_TAKEN])
        if r[SPAN_CELLS] > m:
            return f"sequence {r[ID]} maps {r[SPAN_CELLS]} span cells and keeps only {m} taken"
        for x in live:
            xs, xe = int(x[START]), int(x[START] + x[CAPACITY])
            if x[ID] == r[ID] or xe <= p or xs >= p + m:
                continue
            if not (xs == p and not x[SPAN_CELLS] and x[LENGTH] >= m):
                return f"span [{p}, {p + m}) of {r[ID]} overlaps sequence {x[ID]} [{xs}, {xe}) of length {x[LENGTH]}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 4])
def test_a_full_store_evicting_donors_and_borrowers_keeps_every_cell(make_store, seed):
    """A store of 3,072 cells: borrowers of two prompts created, truncated (copy-on-write), freed,
    removed from, shifted, finished and evicted at random; after every operation the table's
    invariants hold and every cell of every sequence holds its token's K/V."""
    rng = np.random.default_rng(seed)
    store = _store(make_store, max_tokens=3072, max_seqs=24)
    prompts = [np.arange(1000, 1400), np.arange(2000, 2300)]
    spans = 0
    for it in range(300):
        live = [s.id for s in store.sequences()]
        op = int(rng.integers(0, 7))
        s = None
        try:
            if op <= 2 or not live:
                p = prompts[int(rng.integers(0, 2))]
                toks = np.r_[p[: rng.integers(1, len(p))], 9000 + rng.integers(0, 1000, rng.integers(1, 40))]
                s = store.create_sequence(capacity=int(rng.integers(len(toks), len(toks) + 64)), prefix=toks)
                k, v = _kv_of(toks[len(s):])
                s.extend(k, v, tokens=toks[len(s):])
                s.finish() if rng.random() < 0.7 else s.release()
            elif op == 3:
                s = store.sequence(int(rng.choice(live)), write=True)
                s.truncate(int(rng.integers(0, len(s) + 1)))
                toks = 7000 + rng.integers(0, 999, rng.integers(1, 60))
                k, v = _kv_of(toks)
                s.extend(k, v, tokens=toks)
                s.finish() if rng.random() < 0.5 else s.release()
            elif op == 4:
                store.sequence(int(rng.choice(live)), write=True).free()
            elif op == 5:
                s = store.sequence(int(rng.choice(live)), write=True)
                if len(s) > 10:
                    s.remove(int(rng.integers(0, 5)), int(rng.integers(5, 10)))
                s.finish()
            else:
                s = store.sequence(int(rng.choice(live)), write=True)
                if len(s) > 5:
                    s.shift_left(int(rng.integers(1, 5)))
                s.release()
        except shmkv.CacheFullError:
            if s is not None:
                s.release()
        spans += store.stats().shared_tokens > 0
        assert _invariants(store) is None, (it, _invariants(store))
        for info in store.sequences():
            assert _verify(store.sequence(info.id)) is True, (it, info)
    assert spans > 100 and store.stats().evictions > 50


# -- the remote tier pushes the logical content of a borrower, and of cells reused after one ---------


def test_remote_push_of_borrowers_and_of_cells_reused_after_one(make_store):
    if shutil.which("redis-server") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is needed: CI must run this", pytrace=False)
        pytest.skip("needs redis-server")
    pytest.importorskip("redis")
    from shmkv.remote import RemoteTier
    from shmkv.testing._redis import RedisServer

    server = RedisServer()
    tier = RemoteTier(server.url, namespace="atk", chunk_tokens=64)
    try:
        store = _store(make_store)
        _, f = _with_borrower(store)
        f.release()
        assert tier.push(store, f.id) == PROMPT // 64  # the borrower's chunks: its logical content
        # another process frees the borrower and writes a new prompt on its cells; pushed from here
        gid, _ = run_in_process(free_and_reuse, store.name, f.id, 1024, 7, 200, timeout=60)
        assert tier.push(store, gid) == 200 // 64
        other = _store(make_store)
        for toks, seed, n in ((np.arange(1000, 1000 + PROMPT), 1, PROMPT), (np.arange(5000, 5200), 7, 200)):
            got = other.create_sequence(capacity=1024, prefix=np.r_[toks, [1]], tier=tier)
            whole = n // 64 * 64
            assert len(got) == whole
            ref = _reference(make_store, "float16", seed, n)
            for layer in range(L):
                assert got.keys(layer).tobytes() == ref.keys(layer)[:whole].tobytes()
                assert got.values(layer).tobytes() == ref.values(layer)[:whole].tobytes()
            got.free()
    finally:
        tier.close()
        server.stop()


@pytest.mark.parametrize(("point", "op"), [("share.borrowed", "borrow"), ("share.unshared", "unshare"),
                                           ("share.released", "release"), ("share.moved", "move")])
def test_ctrl_c_inside_a_share_unit_rolls_it_back(make_store, point, op):
    """KeyboardInterrupt raised inside a share.* unit (as a Ctrl-C there would be): the unit is
    rolled back, every cell reads right here and in a read-only attachment, and the same
    operation then succeeds."""
    from shmkv._engine.locking import crash

    store = _store(make_store)
    prompt = np.arange(1000, 1300)
    d = store.create_sequence(capacity=512, prefix=prompt)
    k, v = _kv_of(prompt)
    d.extend(k, v, tokens=prompt)
    d.finish()
    f = store.create_sequence(capacity=512, prefix=np.r_[prompt[:250], [77]])
    k, v = _kv_of([77])
    f.extend(k, v, tokens=[77])
    ro = shmkv.attach(store.name, readonly=True)
    dw = store.sequence(d.id, write=True)

    def run() -> None:
        if op == "borrow":
            toks = np.r_[prompt[:200], [4242]]
            g = store.create_sequence(capacity=512, prefix=toks)
            k, v = _kv_of(toks[len(g):])
            g.extend(k, v, tokens=toks[len(g):])
        elif op == "unshare":
            f.truncate(101)
        elif op == "release":
            f.free()
        else:
            dw.truncate(20)

    try:
        for s in (store, ro):
            for info in s.sequences():
                assert _verify(s.sequence(info.id)) is True
        before = sorted(i.id for i in store.sequences())
        crash.arm(point, KeyboardInterrupt())
        try:
            with pytest.raises(KeyboardInterrupt):
                run()
        finally:
            crash.disarm()
        assert sorted(i.id for i in store.sequences()) == before  # rolled back
        for s in (store, ro):
            for info in s.sequences():
                assert _verify(s.sequence(info.id)) is True
        assert verify(store) == []
        run()  # and now it goes through
        for s in (store, ro):
            for info in s.sequences():
                assert _verify(s.sequence(info.id)) is True
    finally:
        ro.close()


def test_at_the_mapping_cap_reuses_copy_and_read_right(make_store, monkeypatch):
    """With a budget of 3 borrowers (share.MAP_BUDGET lowered: 2 mappings x 6 arrays each), the
    4th and 5th reuses copy; every reuse reads right; a freed borrower makes room for a sharing one."""
    monkeypatch.setattr(share, "MAP_BUDGET", 3 * 2 * 2 * L)
    store = _store(make_store)
    prompt = np.arange(1000, 1300)
    d = store.create_sequence(capacity=512, prefix=prompt)
    k, v = _kv_of(prompt)
    d.extend(k, v, tokens=prompt)
    d.finish()
    fs, shared = [], []
    for i in range(5):
        fs.append(store.create_sequence(capacity=512, prefix=np.r_[prompt, [i]]))
        shared.append(store.stats().shared_tokens)
    assert shared == [296, 592, 888, 888, 888]
    for f in fs:
        assert _verify(f) is True
    fs[0].free()
    store.create_sequence(capacity=512, prefix=np.r_[prompt, [9]])
    assert store.stats().shared_tokens == 888
    for info in store.sequences():
        assert _verify(store.sequence(info.id)) is True


def test_a_removed_store_leaves_borrower_views_readable(make_store):
    store = _store(make_store, persistent=True)
    d, f = _with_borrower(store)
    want = _content(d)
    ro = shmkv.attach(store.name, readonly=True)
    views = [(ro.sequence(f.id).keys(i), ro.sequence(f.id).values(i)) for i in range(L)]
    ro.close()
    shmkv.remove(store.name)
    assert [(k.tobytes(), v.tobytes()) for k, v in views] == want
    with pytest.raises(shmkv.StoreNotFound):
        shmkv.attach(store.name)


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


def test_a_fork_child_with_inherited_spans_reads_cells_its_parent_reused(make_store):
    """The parent maps a borrower's span, forks (the child inherits the mappings and the epoch),
    then frees the borrower and writes a new sequence on its cells: the child reads the new bytes."""
    import multiprocessing as mp

    from procs.share_reads import read_inherited_after

    from shmkv.testing import start_in_process

    store = _store(make_store)
    d, f = _with_borrower(store)
    assert _same(_content(f), _content(d))
    eng = engine_of(store)
    f_start = int(eng.row(eng.slot_of(f.id))[START])
    recv, send = mp.get_context("fork").Pipe(duplex=False)
    child = start_in_process(read_inherited_after, store, recv, start_method="fork", timeout=60)
    try:
        f.free()
        g = store.create_sequence(capacity=1024)
        assert int(eng.row(eng.slot_of(g.id))[START]) == f_start
        k, v = kv(7, L, 200, H, D)
        g.extend(k, v)
        send.send(g.id)
        got = child.result()
    finally:
        send.close()
        recv.close()
    want = _content(_reference(make_store, "float16", 7, 200))
    assert got == tuple(a + b for a, b in want) and _same(_content(g), want)


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


def test_a_process_with_sharing_off_reads_and_copies_on_write_borrowers(make_store):
    """SHMKV_SHARE=0 in one process: it still follows the spans others made (reads them, copies on
    write when it truncates one), and its own reuses copy."""
    store = _store(make_store)
    prompt = np.arange(1000, 1300)
    d = store.create_sequence(capacity=1024, prefix=prompt)
    k, v = _kv_of(prompt)
    d.extend(k, v, tokens=prompt)
    d.finish()
    f = store.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
    f.release()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from procs.share_reads import cow_and_reuse; "
            "print(cow_and_reuse(sys.argv[2], int(sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), store.name, str(f.id)],
                         env={**os.environ, "SHMKV_SHARE": "0"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) == 96 == store.stats().shared_tokens  # f keeps 96 cells shared; the reuse copied
    assert len(store.sequences()) == 3
    for info in store.sequences():
        assert _verify(store.sequence(info.id)) is True


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_the_span_sync_reads_a_table_that_another_process_writes_meanwhile(make_store, method):
    """A lock-free span sync (``Shares.wanted``) reads the live table while other processes write
    it: it works on a copy of the span column (numpy's nonzero over the live column raised
    "number of non-zero array elements changed" when a count changed between its passes)."""
    import multiprocessing as mp

    from procs.share_reads import flip_free_rows_span_words

    store = make_store(layers=1, kv_heads=1, head_dim=8, max_tokens=8192, max_seqs=4096)
    ctx = mp.get_context(method)
    started, stop, flips = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    child = ctx.Process(target=flip_free_rows_span_words, args=(store.name, started, stop, flips))
    child.start()
    try:
        assert started.wait(60)
        shares = engine_of(store).shares
        for _ in range(3000):
            assert shares.wanted() == {}  # (free rows: none wanted, whatever their span word says)
    finally:
        stop.set()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0 and flips.value > 0
