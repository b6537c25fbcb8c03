"""The benchmark scenarios of ``shmkv bench`` (shmkv.cli.bench.driver): each times shmkv and its
baseline in this run. Decode, the speculative step, hand-off, copy_prefix, snapshot and prefill
are here; the workers, int8, table, wait, prefix, remote and transformers ones in cases_more.py;
their baselines in one sentence each and the registry in scenarios.py.

Every scenario returns a dict of figures. Baselines are timed alternately with
shmkv (:func:`alternated`), so that drift on a shared machine hits both; each
scenario states its baseline in one sentence (``BASELINES``). Processes that take
part in a hand-off or a throughput figure are started before the clock starts and
wait for a message; times taken in two processes are compared on ``time.perf_counter``
(CLOCK_MONOTONIC, the same clock in every process on Linux).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import shmkv
from shmkv.testing import unique_name

from .timing import Figures, as_bytes, kill, reap, result_of, shm_scratch, alternated, touch


# -- decode and the speculative-decoding step ---------------------------------------------------


def bench_decode(quick: bool) -> Figures:
    L, H, D, n = 32, 8, 128, (128 if quick else 512)
    rng = np.random.default_rng(0)
    ks = rng.standard_normal((n, H, D)).astype(np.float16)
    vs = rng.standard_normal((n, H, D)).astype(np.float16)
    store = shmkv.create(unique_name("bd"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                          max_tokens=n + 8, max_seqs=2)
    try:
        seq = store.create_sequence(capacity=n)  # cells reserved once (pages: the first pass)

        def run_shmkv() -> float:
            seq.clear()  # a structural op, outside the timing
            append, commit = seq.append, seq.commit
            t0 = time.perf_counter()
            for t in range(n):
                k, v = ks[t], vs[t]
                for layer in range(L):
                    append(layer, k, v)  # returns the views attention reads
                commit()
            return time.perf_counter() - t0

        K = np.zeros((L, n, H, D), np.float16)
        V = np.zeros((L, n, H, D), np.float16)

        def run_numpy() -> None:
            for t in range(n):
                k, v = ks[t], vs[t]
                for layer in range(L):
                    K[layer, t] = k
                    V[layer, t] = v
                    K[layer, : t + 1], V[layer, : t + 1]  # the views attention reads

        def run_concat() -> None:
            kc = [np.zeros((0, H, D), np.float16) for _ in range(L)]
            vc = [np.zeros((0, H, D), np.float16) for _ in range(L)]
            for t in range(min(n, 128)):
                for layer in range(L):
                    kc[layer] = np.concatenate([kc[layer], ks[t : t + 1]])
                    vc[layer] = np.concatenate([vc[layer], vs[t : t + 1]])

        # a first pass of each, untimed: the store allocates a range's pages as its appends need
        # them (a chunk at a time) and numpy's zeros take theirs at first touch; the figures
        # are the steady state of the per-token path
        run_shmkv()
        run_numpy()
        t = alternated({"shmkv": run_shmkv, "numpy": run_numpy}, 3 if quick else 7)
        t_c = alternated({"concat": run_concat}, 1 if quick else 3)["concat"] / min(n, 128)
    finally:
        store.close()
    return {"decode_us_per_token": t["shmkv"] / n * 1e6, "numpy_us_per_token": t["numpy"] / n * 1e6,
            "concat_us_per_token": t_c * 1e6, "decode_ratio": t["shmkv"] / t["numpy"]}


def bench_truncate(quick: bool) -> Figures:
    """A speculative-decoding step: truncate by one token, append one token to every layer, commit.

    The rollback rewrites a cell that is hot in the CPU cache, while plain decoding writes
    new cells (128 KiB a token here): compared naively, the step with a truncate came out
    ~30 us *cheaper*. So both run in blocks of ``B`` steps over the same few cells, rewound
    (untimed) between blocks, a block of each in turn; the figure is the median of the
    paired differences (robust to a neighbour's burst): the truncate's own cost.
    """
    L, H, D, base, B = 32, 8, 128, 64, 4
    pairs = 300 if quick else 1500
    store = shmkv.create(unique_name("bt"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                          max_tokens=base + B + 8, max_seqs=2)
    try:
        seq = store.create_sequence(capacity=base + B + 8)
        seq.extend(np.ones((L, base, H, D), np.float16), np.ones((L, base, H, D), np.float16))
        k = np.ones((H, D), np.float16)
        append, commit, truncate = seq.append, seq.commit, seq.truncate

        def block(spec: bool) -> float:
            truncate(base)  # untimed rewind: every block writes the same few cells
            t0 = time.perf_counter()
            for _ in range(B):
                if spec:
                    truncate(seq.length - 1)  # the rejected draft token
                for layer in range(L):
                    append(layer, k, k)
                commit()
            return time.perf_counter() - t0

        ts, tp = [], []
        for i in range(pairs):
            if i % 2:
                ts.append(block(True))
                tp.append(block(False))
            else:
                tp.append(block(False))
                ts.append(block(True))
    finally:
        store.close()
    diff = statistics.median(a - b for a, b in zip(ts, tp, strict=True))
    return {"spec_step_us": statistics.median(ts) / B * 1e6, "append_commit_us": statistics.median(tp) / B * 1e6,
            "truncate_step_us": diff / B * 1e6}


# -- hand-off to another process ------------------------------------------------------------------


def _receiver(kind: str, inp: Any, out: Any) -> None:
    """Started before the clock; waits on ``inp``, reports (t_in_hand, t_read, check) per round."""
    out.put(("ready", kind))
    while True:
        if kind == "queue":
            arrays = inp.get()  # unpickling copies: every byte is touched on arrival
            if arrays is None:
                break
            t1 = time.perf_counter()
            out.put((kind, t1, t1, float(arrays[1][-1, -1, -1, -1])))
            del arrays
            continue
        if kind == "pipe":
            kb = inp.recv_bytes()
            if not kb:
                break
            vb = inp.recv_bytes()
            k = np.frombuffer(kb, np.float16)
            v = np.frombuffer(vb, np.float16)
            t1 = time.perf_counter()
            out.put((kind, t1, t1, float(v[-1])))
            del k, v, kb, vb
            continue
        msg = inp.recv()
        if msg is None:
            break
        if kind == "shmkv":
            name, seq_id = msg
            store = shmkv.attach(name, readonly=True)
            seq = store.sequence(seq_id)
            views = [seq.kv(layer) for layer in range(store.layout.layers)]
            t1 = time.perf_counter()
            check = 0
            for kv in views:
                check ^= touch(kv[0]) ^ touch(kv[1])
            t2 = time.perf_counter()
            out.put((kind, t1, t2, float(views[-1][1][-1, -1, -1])))
            del views, seq
            store.close()
        else:  # "shmfile": the same bytes in a plain /dev/shm file
            fd = os.open(msg, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            a = np.frombuffer(mm, np.float16)
            t1 = time.perf_counter()
            touch(a)
            t2 = time.perf_counter()
            out.put((kind, t1, t2, float(a[-1])))
            del a
            mm.close()


def bench_handoff(quick: bool) -> Figures:
    L, H, D, n = 16, 8, 128, 2048  # 2 x 16 x 2048 x 8 x 128 x 2 bytes = 128 MiB
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(1)
    k = rng.standard_normal((L, n, H, D)).astype(np.float16)
    v = rng.standard_normal((L, n, H, D)).astype(np.float16)
    name = unique_name("bh")
    store = shmkv.create(name, layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=n, max_seqs=2)
    path = shm_scratch("handoff")
    res: Figures = {"handoff_mib": 2 * k.nbytes / 2**20}
    procs: list[Any] = []
    inputs: dict[str, Any] = {}
    try:
        seq = store.create_sequence(capacity=n)
        seq.extend(k, v)
        with open(path, "wb") as f:
            f.write(as_bytes(k))
            f.write(as_bytes(v))
        out = ctx.Queue()
        for kind in ("shmkv", "shmfile", "queue", "pipe"):
            if kind == "queue":
                inputs[kind] = ctx.Queue()
                # not joined at exit: after a Ctrl-C its feeder thread may be blocked sending to
                # a killed receiver (in the normal run the receiver reads everything before it ends)
                inputs[kind].cancel_join_thread()
                theirs = inputs[kind]
            else:
                theirs, inputs[kind] = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_receiver, args=(kind, theirs, out), name=f"receiver-{kind}")
            p.start()
            procs.append(p)
        for _ in procs:
            result_of(out, *procs)  # every receiver is up and waiting
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in inputs}
        sends: dict[str, Callable[[], Any]] = {
            "shmkv": lambda: inputs["shmkv"].send((name, seq.id)),
            "shmfile": lambda: inputs["shmfile"].send(path),
            "queue": lambda: inputs["queue"].put([k, v]),
            # the best a pipe can do: the arrays' own buffers, no tobytes() copy
            "pipe": lambda: (inputs["pipe"].send_bytes(as_bytes(k)),
                             inputs["pipe"].send_bytes(as_bytes(v))),
        }
        # the shared-memory reads take tens of ms, Queue and pipe most of a second: more rounds of the former
        fast, slow = (5, 1) if quick else (11, 3)
        for r in range(fast):
            kinds = ["shmkv", "shmfile"] if r % 2 == 0 else ["shmfile", "shmkv"]
            if r < slow:
                kinds += ["queue", "pipe"] if r % 2 == 0 else ["pipe", "queue"]
            for kind in kinds:
                t0 = time.perf_counter()
                sends[kind]()
                got, t1, t2, check = result_of(out, *procs)
                assert got == kind and check == float(v[-1, -1, -1, -1]), (got, check)
                times[kind].append((t1 - t0, t2 - t0))
        med = {kind: (statistics.median(a for a, _ in ts), statistics.median(b for _, b in ts))
               for kind, ts in times.items()}
        res["handoff_ms"] = med["shmkv"][0] * 1e3  # attach + views
        res["handoff_read_ms"] = med["shmkv"][1] * 1e3  # ... + every byte read
        res["shm_file_read_ms"] = med["shmfile"][1] * 1e3
        res["queue_handoff_ms"] = med["queue"][1] * 1e3
        res["pipe_handoff_ms"] = med["pipe"][1] * 1e3
        res["handoff_read_ratio"] = res["handoff_read_ms"] / res["shm_file_read_ms"]
        res["handoff_speedup_vs_queue"] = res["queue_handoff_ms"] / res["handoff_read_ms"]
        inputs["queue"].put(None)
        inputs["pipe"].send_bytes(b"")
        inputs["shmkv"].send(None)
        inputs["shmfile"].send(None)
        reap(procs)
    finally:
        kill(procs)
        store.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return res


# -- copy_prefix ---------------------------------------------------------------------------------


def bench_copy_prefix(quick: bool) -> Figures:
    L, H, D, n = 16, 8, 128, (1024 if quick else 2048)
    # 3 n cells: copy_prefix into a sequence that holds tokens writes a fresh range, then switches
    # (crash safety: never over committed cells), so it needs n free cells while it runs
    store = shmkv.create(unique_name("bc"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                          max_tokens=3 * n, max_seqs=2)
    try:
        rng = np.random.default_rng(2)
        src = store.create_sequence(capacity=n)
        kv = rng.standard_normal((2, L, n, H, D)).astype(np.float16)
        src.extend(kv[0], kv[1])
        dst = store.create_sequence(capacity=n)
        dst.release()
        # warm until steady: each copy into dst (which holds tokens) writes a fresh range and frees
        # the old one, so dst alternates between two ranges; a range's first copy writes it
        # through the descriptor, its second pays the first touch of its pages in this mapping.
        # The first call, into the empty dst, borrows src's whole page units when sharing is on
        # (DESIGN §11: no copy), so the copying starts one call later there: 5 warm calls reach
        # the steady state with and without sharing (one warm call measured the first touches)
        for _ in range(5):
            store.copy_prefix(src.id, dst.id, n)
        a = np.empty((2, L, n, H, D), np.float16)
        b = np.empty_like(a)
        a.fill(1)
        b.fill(0)
        t = alternated({"shmkv": lambda: store.copy_prefix(src.id, dst.id, n),
                        "copyto": lambda: np.copyto(b, a)}, 5 if quick else 9)
        nbytes = a.nbytes
    finally:
        store.close()
    return {"copy_prefix_gbps": nbytes / t["shmkv"] / 1e9, "copyto_gbps": nbytes / t["copyto"] / 1e9,
            "copy_prefix_ratio": t["copyto"] / t["shmkv"]}


# -- snapshots -----------------------------------------------------------------------------------


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sendfile_into_fresh_shm(src: str) -> float:
    """Seconds to fill a fresh /dev/shm file from ``src`` with os.sendfile (creating and removing it untimed)."""
    dst = shm_scratch("load")
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = os.fstat(fin).st_size
        t0 = time.perf_counter()
        off = 0
        while off < size:
            sent = os.sendfile(fout, fin, off, size - off)
            if sent == 0:
                break
            off += sent
        return time.perf_counter() - t0
    finally:
        os.close(fin)
        os.close(fout)
        os.unlink(dst)


def bench_snapshot(quick: bool, directory: str | None = None) -> Figures:
    from shmkv import load

    L, H, D, n = 16, 8, 128, (1024 if quick else 2048)
    name = unique_name("bs")
    store = shmkv.create(name, layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2 * n, max_seqs=4)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((L, n, H, D)).astype(np.float16)
    v = rng.standard_normal((L, n, H, D)).astype(np.float16)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        try:
            seq = store.create_sequence(capacity=n)
            seq.extend(k, v)
            snap, npy = os.path.join(d, "s.shmkv"), os.path.join(d, "s.npy")
            both = np.stack([k, v])
            reps = 3 if quick else 7

            def np_save() -> None:  # the promise store.save keeps: the old file or the new one
                tmp = npy + ".tmp"
                with open(tmp, "wb") as f:
                    np.save(f, both)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, npy)
                _fsync_dir(d)

            t_save = alternated({"shmkv": lambda: store.save(snap), "np": np_save}, reps)

            def shmkv_load() -> float:
                t0 = time.perf_counter()
                s = load(snap, unique_name("bl"))
                dt = time.perf_counter() - t0
                s.close()  # removes the loaded store (untimed)
                return dt

            t_load = alternated({"shmkv": shmkv_load, "limit": lambda: _sendfile_into_fresh_shm(snap),
                                 "np": lambda: np.load(npy)}, reps)
            nbytes = both.nbytes
        finally:
            store.close()
    return {"save_gbps": nbytes / t_save["shmkv"] / 1e9, "np_save_gbps": nbytes / t_save["np"] / 1e9,
            "load_gbps": nbytes / t_load["shmkv"] / 1e9, "np_load_gbps": nbytes / t_load["np"] / 1e9,
            "sendfile_limit_gbps": nbytes / t_load["limit"] / 1e9,
            "save_ratio": t_save["np"] / t_save["shmkv"], "load_ratio": t_load["np"] / t_load["shmkv"],
            "load_vs_limit": t_load["limit"] / t_load["shmkv"]}


# -- prefill into fresh memory -----------------------------------------------------------------------


def bench_prefill(quick: bool) -> Figures:
    L, H, D, n = 16, 8, 128, 2048  # 128 MiB of K and V
    rng = np.random.default_rng(4)
    k = rng.standard_normal((L, n, H, D)).astype(np.float16)
    v = rng.standard_normal((L, n, H, D)).astype(np.float16)
    reserve: list[float] = []

    def shmkv_prefill() -> float:
        store = shmkv.create(unique_name("bp"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                              max_tokens=n, max_seqs=2)  # a new store: fresh memory (untimed)
        try:
            t0 = time.perf_counter()
            seq = store.create_sequence(capacity=n)  # reserves the range
            t1 = time.perf_counter()
            seq.extend(k, v)
            t2 = time.perf_counter()
        finally:
            store.close()
        reserve.append(t1 - t0)
        return t2 - t0

    def pwrite_limit() -> float:
        path = shm_scratch("prefill")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.perf_counter()
            for off, a in ((0, k), (k.nbytes, v)):
                buf = as_bytes(a)
                done = 0
                while done < len(buf):
                    done += os.pwrite(fd, buf[done:], off + done)
            return time.perf_counter() - t0
        finally:
            os.close(fd)
            os.unlink(path)

    def first_touch() -> None:
        a = np.empty_like(k)
        b = np.empty_like(v)
        a[:] = k
        b[:] = v

    t = alternated({"shmkv": shmkv_prefill, "limit": pwrite_limit, "first_touch": first_touch},
                   3 if quick else 7)
    return {"prefill_ms": t["shmkv"] * 1e3, "prefill_reserve_ms": statistics.median(reserve) * 1e3,
            "pwrite_limit_ms": t["limit"] * 1e3, "first_touch_ms": t["first_touch"] * 1e3,
            "prefill_vs_limit": t["limit"] / t["shmkv"]}
