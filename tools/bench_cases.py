"""The benchmark scenarios of tools/bench.py: each times shmkv and its baseline in this run.

Every scenario returns a dict of figures. Baselines are timed alternately with
shmkv (:func:`alternated`), so that drift on a shared machine hits both; each
scenario states its baseline in one sentence (``BASELINES``), which the README
table repeats. Processes that take part in a hand-off or a throughput figure are
started before the clock starts and wait for a message; times taken in two
processes are compared on ``time.perf_counter`` (CLOCK_MONOTONIC, the same clock
in every process on Linux).
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import queue
import select
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import shmkv
from shmkv.testing import unique_name

Figures = dict[str, float]

BASELINES = {
    "hf": "transformers' DynamicCache in model.generate() of the same tiny random-weight Llama, 256 new tokens, "
          "interleaved, batch 1 and batch 4 (the same tokens checked first)",
    "prefix": "match_prefix of a 300-token prompt with 16 and with 1000 finished sequences cached (flat goal); "
              "time to first token of the demo's model with the 250-token system prompt cached vs computed; "
              "reading a stitched view (a donor's pages + own pages in one array) vs a plain view of the "
              "same bytes; 32 requests over a cached 2,048-token prompt: /dev/shm bytes held vs the distinct "
              "tokens' bytes, and each create vs a one-token extend",
    "remote": "redis-py GET / pipelined SET of the same chunk bytes on the same throwaway redis-server",
    "decode": "the same per-token K/V slices written into preallocated numpy arrays in this process, "
              "taking the [0:t+1] views attention reads (and, for reference, np.concatenate growth)",
    "truncate": "the same append-one-token-to-every-layer + commit steps without the truncate: "
                "truncate_step_us is what the rollback adds per step",
    "handoff": "multiprocessing.Queue.put and Connection.send_bytes of the same K/V arrays to a receiver that is "
               "already started and waiting, timed from the sender's first call to the receiver holding the "
               "data; shmkv's receiver also reads every byte, compared with mmap-ing and reading a plain "
               "/dev/shm file of the same size",
    "copy_prefix": "np.copyto of the same number of bytes between two preallocated arrays",
    "snapshot": "save: np.save of the same bytes + fsync + atomic rename + directory fsync (the same promise); "
                "load: os.sendfile of the snapshot file into a fresh /dev/shm file (the physical limit) and "
                "np.load into anonymous memory",
    "prefill": "os.pwrite of the same bytes into a fresh /dev/shm file (tmpfs then allocates pages without "
               "zeroing them: the physical limit); first-touch numpy copies shown for reference",
    "workers": "the same decode workers with no snapshotter running, alternated run by run, at N = cores - 1 "
               "and N = cores workers",
    "quant": "a float16 store of the same shape: extend (write), every value of every layer's K and V read, "
             "and decode steps (one token appended to every layer, commit) at the prefilled context",
    "table": "none (absolute times per operation at 16, 256 and 4096 sequences: flat is the goal)",
    "wait": "a bare pipe: the same kind of process (spawned, asleep) blocked in os.read of a pipe, woken by "
            "one byte written into it, measured the same way as the commit that wakes a seq.wait of a read-write "
            "and of a read-only attachment (alternated; the waker timed from just before its call, the woken "
            "process from its return); attach: shmkv.attach in a fresh spawned and a fresh forked process "
            "(median of 8 each); an idle waiter's wake-ups counted by the kernel (voluntary context switches)",
}


# -- timing helpers ------------------------------------------------------------------------------


def alternated(fns: dict[str, Callable[[], float | None]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, all run in turn in every repeat (the order rotating).

    A function that returns a float has timed itself (its setup and cleanup untimed);
    otherwise its whole call is timed.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    for r in range(repeats):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for k in order:
            t0 = time.perf_counter()
            own = fns[k]()
            times[k].append(own if isinstance(own, float) else time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def touch(a: np.ndarray) -> int:
    """Read every byte of a contiguous array (what a consumer of handed-over data must do at least once)."""
    flat = a.reshape(-1).view(np.uint8)
    n = flat.size // 8 * 8
    return (int(flat[:n].view(np.uint64).max()) if n else 0) ^ int(flat[n:].sum())


def _result(out: Any, *children: Any, timeout: float = 300.0) -> Any:
    """The next message on ``out`` from ``children``; raise at once, naming the child, when one dies.

    A child that exits with an error code, or all of them exiting without a message, ends the wait
    (a bare ``out.get(timeout=...)`` would sit out its whole timeout behind a crashed child).
    """
    t_end = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=0.05)
        except queue.Empty:
            pass
        dead = [c for c in children if c.exitcode not in (None, 0)]
        if dead or all(c.exitcode is not None for c in children):
            try:  # a message sent just before the exit may still be in the pipe
                return out.get(timeout=0.5)
            except queue.Empty:
                c = (dead or list(children))[0]
                raise RuntimeError(f"bench child {c.name} (pid {c.pid}) exited with code {c.exitcode} "
                                   "before sending its result") from None
        if time.monotonic() > t_end:
            for c in children:
                c.kill()
            raise RuntimeError(f"bench children {[c.name for c in children]} sent nothing in {timeout:.0f} s")


def _kill(procs: list[Any]) -> None:
    """An error path's cleanup: children still running are killed at once and reaped."""
    _reap(procs, grace=0)


def _reap(procs: list[Any], grace: float = 10.0) -> None:
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join()


def _bytes(a: np.ndarray) -> memoryview:
    """The array's own buffer as bytes (no copy)."""
    return memoryview(a).cast("B")  # type: ignore[arg-type]


def _shm_scratch(tag: str) -> str:
    """A path in /dev/shm for a baseline's plain file (not a store: the leak checks ignore it)."""
    return os.path.join("/dev/shm", f"shmkv-bench-{os.getpid()}-{tag}")


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
    path = _shm_scratch("handoff")
    res: Figures = {"handoff_mib": 2 * k.nbytes / 2**20}
    procs: list[Any] = []
    inputs: dict[str, Any] = {}
    try:
        seq = store.create_sequence(capacity=n)
        seq.extend(k, v)
        with open(path, "wb") as f:
            f.write(_bytes(k))
            f.write(_bytes(v))
        out = ctx.Queue()
        for kind in ("shmkv", "shmfile", "queue", "pipe"):
            if kind == "queue":
                inputs[kind] = ctx.Queue()
                theirs = inputs[kind]
            else:
                theirs, inputs[kind] = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_receiver, args=(kind, theirs, out), name=f"receiver-{kind}")
            p.start()
            procs.append(p)
        for _ in procs:
            _result(out, *procs)  # every receiver is up and waiting
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in inputs}
        sends: dict[str, Callable[[], Any]] = {
            "shmkv": lambda: inputs["shmkv"].send((name, seq.id)),
            "shmfile": lambda: inputs["shmfile"].send(path),
            "queue": lambda: inputs["queue"].put([k, v]),
            # the best a pipe can do: the arrays' own buffers, no tobytes() copy
            "pipe": lambda: (inputs["pipe"].send_bytes(_bytes(k)),
                             inputs["pipe"].send_bytes(_bytes(v))),
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
                got, t1, t2, check = _result(out, *procs)
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
        _reap(procs)
    finally:
        _kill(procs)
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
        # (docs/design.md §11: no copy), so the copying starts one call later there: 5 warm calls reach
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
    dst = _shm_scratch("load")
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
        path = _shm_scratch("prefill")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.perf_counter()
            for off, a in ((0, k), (k.nbytes, v)):
                buf = _bytes(a)
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


# -- decode workers beside a snapshotter -------------------------------------------------------------


def _decode_worker(name: str, seq_id: int, base: int, ctrl: Any, out: Any) -> None:
    """Attach once; per message, append ``n`` tokens to every layer + commit each and report tokens/s."""
    store = shmkv.attach(name)
    lay = store.layout
    seq = store.sequence(seq_id, write=True)
    k = np.ones((lay.kv_heads, lay.head_dim), np.float16)
    append, commit = seq.append, seq.commit
    out.put(("ready", seq_id))
    while True:
        n = ctrl.recv()
        if n is None:
            break
        if n == "reset":  # between runs (untimed): back to the prefilled length
            seq.truncate(base)
            out.put(("reset", seq_id))
            continue
        t0 = time.perf_counter()
        for _ in range(n):
            for layer in range(lay.layers):
                append(layer, k, k)
            commit()
        out.put(("rate", n / (time.perf_counter() - t0)))
    store.close()


def _snapshotter(name: str, path: str, ctrl: Any, stop: Any, out: Any) -> None:
    os.nice(10)  # as `shmkv snapshot` does by default: decode workers come first
    store = shmkv.attach(name, readonly=True)
    out.put(("ready", -1))
    while ctrl.recv() is not None:
        count = 0
        out.put(("started", -1))
        while not stop.is_set():
            store.save(path)
            count += 1
        out.put(("count", count))
    store.close()


def bench_workers(quick: bool) -> Figures:
    """Decode throughput of N workers with and without a snapshotter saving the store in a loop.

    Runs are a fixed number of tokens with no structural operation inside (a worker
    truncates back to the prefilled length between runs, untimed), alternated with
    and without the snapshotter, at N = cores - 1 (the goal) and N = cores.
    """
    L, H, D, base = 16, 8, 128, 1024  # 64 MiB of K and V per worker's sequence, all in every snapshot
    n = 2048 if quick else 3072  # tokens per run (64 KiB each)
    cores = os.cpu_count() or 1
    counts = sorted({max(1, cores - 1), cores})
    rounds = 3 if quick else 7
    ctx = mp.get_context("spawn")
    name = unique_name("bw")
    store = shmkv.create(name, layers=L, kv_heads=H, head_dim=D, dtype="float16",
                          max_tokens=cores * (base + n), max_seqs=cores + 1)
    procs: list[Any] = []
    ctrls: list[Any] = []
    res: Figures = {}
    rates: dict[tuple[int, bool], list[float]] = {(w, s): [] for w in counts for s in (False, True)}
    snaps: dict[int, list[int]] = {w: [] for w in counts}
    with tempfile.TemporaryDirectory() as d:
        try:
            kv = np.random.default_rng(5).standard_normal((2, L, base, H, D), np.float32).astype(np.float16)
            ids = []
            for _ in range(cores):
                s = store.create_sequence(capacity=base + n)
                s.extend(kv[0], kv[1])
                ids.append(s.id)
                s.release()
            del kv
            out, stop = ctx.Queue(), ctx.Event()
            for i in ids:
                theirs, mine = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_decode_worker, args=(name, i, base, theirs, out), name=f"worker-{i}")
                p.start()
                procs.append(p)
                ctrls.append(mine)
            theirs, snap_ctrl = ctx.Pipe(duplex=False)
            snap = ctx.Process(target=_snapshotter, args=(name, os.path.join(d, "w.shmkv"), theirs, stop, out),
                               name="snapshotter")
            snap.start()
            procs.append(snap)
            for _ in procs:
                _result(out, *procs)  # all attached and waiting
            for r in range(rounds):
                for w in counts:
                    for with_snap in ((False, True) if r % 2 == 0 else (True, False)):
                        for c in ctrls:
                            c.send("reset")
                        for _ in ctrls:
                            assert _result(out, *procs)[0] == "reset"
                        if with_snap:
                            stop.clear()
                            snap_ctrl.send(True)
                            assert _result(out, *procs)[0] == "started"
                        for c in ctrls[:w]:
                            c.send(n)
                        got = [_result(out, *procs, timeout=600) for _ in range(w)]
                        assert all(tag == "rate" for tag, _ in got), got
                        rates[(w, with_snap)].append(sum(x for _, x in got))
                        if with_snap:
                            stop.set()
                            tag, count = _result(out, *procs, timeout=600)
                            assert tag == "count"
                            snaps[w].append(count)
            for c in ctrls:
                c.send(None)
            snap_ctrl.send(None)
            _reap(procs)
        finally:
            _kill(procs)
            store.close()
    for w in counts:
        alone, beside = statistics.median(rates[(w, False)]), statistics.median(rates[(w, True)])
        res[f"tokens_per_s_{w}w"] = alone
        res[f"tokens_per_s_{w}w_snap"] = beside
        res[f"snapshots_during_{w}w"] = statistics.median(snaps[w])
        res[f"snapshotter_overhead_{w}w"] = 1 - beside / alone
    res["snapshotter_overhead"] = res[f"snapshotter_overhead_{max(1, cores - 1)}w"]  # the goal: N = cores - 1
    res["snapshotter_overhead_at_cores"] = res[f"snapshotter_overhead_{cores}w"]
    return res


# -- int8 quantization -------------------------------------------------------------------------------


def bench_quant(quick: bool) -> Figures:
    L, H, D, n = 8, 8, 128, (512 if quick else 2048)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((L, n, H, D)).astype(np.float16)  # what a float16 model produces
    steps_cap = 1 + (64 if quick else 256)
    stores = {dt: shmkv.create(unique_name("bq"), layers=L, kv_heads=H, head_dim=D, dtype=dt,
                               max_tokens=n + steps_cap, max_seqs=2) for dt in ("float16", "int8")}
    try:
        seqs = {dt: st.create_sequence(capacity=n + steps_cap) for dt, st in stores.items()}
        for seq in seqs.values():
            seq.extend(x, x)

        def write(dt: str) -> Callable[[], float]:
            def run() -> float:
                seqs[dt].truncate(0)
                t0 = time.perf_counter()
                seqs[dt].extend(x, x)  # int8: quantized on the way in
                return time.perf_counter() - t0
            return run

        def read(dt: str) -> Callable[[], None]:
            def run() -> None:
                for layer in range(L):
                    k, v = seqs[dt].kv(layer)  # int8: a dequantized copy; float16: zero-copy views
                    touch(k)
                    touch(v)
            return run

        steps = 64 if quick else 256
        one = rng.standard_normal((L, H, D)).astype(np.float16)

        def step(dt: str) -> Callable[[], float]:
            def run() -> float:  # decode steps at n tokens of context, then back to n (untimed)
                seq = seqs[dt]
                for layer in range(L):  # warm: an int8 handle's mirror catches up once (untimed)
                    seq.append(layer, one[layer], one[layer])
                seq.commit()
                t0 = time.perf_counter()
                for _ in range(steps):
                    for layer in range(L):
                        seq.append(layer, one[layer], one[layer])
                    seq.commit()
                t = (time.perf_counter() - t0) / steps
                seq.truncate(n)
                return t
            return run

        reps = 3 if quick else 5
        tw = alternated({"float16": write("float16"), "int8": write("int8")}, reps)
        tr = alternated({"float16": read("float16"), "int8": read("int8")}, reps)
        ts = alternated({"float16": step("float16"), "int8": step("int8")}, reps)
        res = {"quantize_ratio": tw["float16"] / tw["int8"], "dequantize_ratio": tr["float16"] / tr["int8"],
               "int8_step_us": ts["int8"] * 1e6, "float16_step_us": ts["float16"] * 1e6,
               "int8_step_ratio": ts["int8"] / ts["float16"],
               "int8_bytes_per_token": stores["int8"].bytes_per_token,
               "float16_bytes_per_token": stores["float16"].bytes_per_token,
               "int8_memory_ratio": stores["int8"].bytes_per_token / stores["float16"].bytes_per_token}
    finally:
        for st in stores.values():
            st.close()
    return res


# -- the sequence table at 16, 256 and 4096 sequences -----------------------------------------------


TABLE_SIZES = (16, 256, 4096)


def bench_table(quick: bool) -> Figures:
    top = TABLE_SIZES[-1]
    store = shmkv.create(unique_name("bT"), layers=2, kv_heads=1, head_dim=8, dtype="float16",
                          max_tokens=16 * (top + 4), max_seqs=top + 4)
    res: Figures = {}
    reps = 20 if quick else 60
    try:
        ids: list[int] = []
        for size in TABLE_SIZES:
            while len(ids) < size - 1:  # size - 1 others: the measured one makes it `size`
                s = store.create_sequence(capacity=16)
                ids.append(s.id)
                s.release()
            t_create, t_free, t_open = [], [], []
            for i in range(reps):
                t0 = time.perf_counter()
                s = store.create_sequence(capacity=16)
                t1 = time.perf_counter()
                s.free()
                t2 = time.perf_counter()
                store.sequence(ids[(i * 7919) % len(ids)])  # a read handle on one of them, spread over the table
                t3 = time.perf_counter()
                t_create.append(t1 - t0)
                t_free.append(t2 - t1)
                t_open.append(t3 - t2)
            per_seq = []
            for _ in range(3 if size < top or not quick else 1):
                t0 = time.perf_counter()
                infos = store.sequences()
                per_seq.append((time.perf_counter() - t0) / max(1, len(infos)))
            res[f"create_sequence_us_{size}"] = statistics.median(t_create) * 1e6
            res[f"free_us_{size}"] = statistics.median(t_free) * 1e6
            res[f"open_sequence_us_{size}"] = statistics.median(t_open) * 1e6
            res[f"sequences_us_per_seq_{size}"] = statistics.median(per_seq) * 1e6
    finally:
        store.close()
    res["sequences_us_per_seq"] = max(res[f"sequences_us_per_seq_{s}"] for s in TABLE_SIZES)
    res["create_sequence_flat"] = res[f"create_sequence_us_{top}"] / res[f"create_sequence_us_{TABLE_SIZES[0]}"]
    return res


# -- Sequence.wait wake-up (when the library has it) ---------------------------------------------


def _waiter(name: str | None, seq_id: int, rounds: int, pipes: tuple[Any, Any, Any], readonly: bool) -> None:
    """A woken process: ``seq.wait`` on a store's sequence, or (``name`` None, the baseline) a
    bare ``os.read`` of one byte from a pipe. Both report the same way, through raw pipes:
    "w" when about to sleep, then the time it returned (perf_counter, 8 bytes)."""
    seq = None
    if name is not None:
        store = shmkv.attach(name, readonly=readonly)
        seq = store.sequence(seq_id)
    c, a, w = (end.fileno() for end in pipes)  # control in, reports out, the baseline's wake-up
    for _ in range(rounds):
        target = int.from_bytes(os.read(c, 8), "little")
        os.write(a, b"w")
        if seq is None:
            os.read(w, 1)
        else:
            seq.wait(length=target, timeout=30)
        t1 = time.perf_counter()
        os.write(a, struct.pack("d", t1))
    if name is not None:
        store.close()


def _attacher(name: str, out: Any) -> None:
    """A fresh process's first ``shmkv.attach`` of a store (read-write), timed alone."""
    t0 = time.perf_counter()
    store = shmkv.attach(name)
    t = time.perf_counter() - t0
    store.close()
    out.put(("attached", t))


def _read_from(child: Any, fd: int, n: int, timeout: float = 60.0) -> bytes:
    """``n`` bytes from a child's pipe; RuntimeError, naming it, when it dies or says nothing."""
    got = b""
    t_end = time.monotonic() + timeout
    while len(got) < n:
        if select.select([fd], [], [], 0.05)[0]:
            part = os.read(fd, n - len(got))
            if not part:
                raise RuntimeError(f"bench child {child.name} (pid {child.pid}) closed its pipe "
                                   f"(exit code {child.exitcode})")
            got += part
        elif child.exitcode is not None or time.monotonic() > t_end:
            child.kill()
            raise RuntimeError(f"bench child {child.name} (pid {child.pid}) sent nothing "
                               f"(exit code {child.exitcode})")
    return got


def _idle_waiter(name: str, seq_id: int, ready: Any, readonly: bool = False) -> None:
    store = shmkv.attach(name, readonly=readonly)
    seq = store.sequence(seq_id)
    ready.set()
    try:
        seq.wait(length=1 << 40, timeout=120)
    except Exception:  # freed or timed out: the bench is over
        pass
    store.close()


def _switches(pid: int) -> int:
    """Voluntary context switches of a process's main thread (each wake-up from a sleep is one)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def has_wait() -> bool:
    return hasattr(shmkv.Sequence, "wait")


def bench_wait(quick: bool) -> Figures:
    if not has_wait():
        return {}  # Sequence.wait is not in this version of the library: no figure
    rounds = 15 if quick else 41
    ctx = mp.get_context("spawn")
    name = unique_name("bW")
    store = shmkv.create(name, layers=2, kv_heads=2, head_dim=8, dtype="float16",
                              max_tokens=4 * rounds + 8, max_seqs=4)
    procs: list[Any] = []
    res: Figures = {}
    try:
        seq = store.create_sequence(capacity=4 * rounds + 8)
        k = np.ones((2, 1, 2, 8), np.float16)
        # three processes of the same kind (spawned, started before the clock), each woken by one
        # event from this one: a commit (seq.wait, read-write and read-only) or one byte written
        # into a pipe (the baseline: a bare os.read); each times its own return, this one times
        # from just before its call; everything else goes through raw pipes, untimed
        children: dict[str, tuple[Any, int, int, int]] = {}
        ends: list[Any] = []  # this process's ends of the pipes (open until the children are reaped)
        for kind in ("rw", "pipe", "ro"):
            ctl_r, ctl_w = ctx.Pipe(duplex=False)
            ack_r, ack_w = ctx.Pipe(duplex=False)
            wake_r, wake_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_waiter, args=(None if kind == "pipe" else name, seq.id, rounds,
                                                  (ctl_r, ack_w, wake_r), kind == "ro"), name=f"waiter-{kind}")
            p.start()
            procs.append(p)
            for end in (ctl_r, ack_w, wake_r):
                end.close()
            children[kind] = (p, ctl_w.fileno(), ack_r.fileno(), wake_w.fileno())
            ends += [ctl_w, ack_r, wake_w]
        lat: dict[str, list[float]] = {k_: [] for k_ in ("rw", "pipe", "ro")}
        for _ in range(rounds):
            for kind in ("rw", "pipe", "ro"):  # alternated, in the same run
                p, ctl, ack, wake = children[kind]
                os.write(ctl, (len(seq) + 1).to_bytes(8, "little"))
                if _read_from(p, ack, 1) != b"w":
                    raise RuntimeError(f"bench child {p.name}: unexpected message")
                if kind != "pipe":
                    for layer in range(2):  # one token written (untimed): the commit wakes the waiter
                        seq.append(layer, k[layer], k[layer])
                time.sleep(0.02)  # let it fall asleep (in wait(), or in the pipe read)
                t0 = time.perf_counter()
                if kind == "pipe":
                    os.write(wake, b"x")
                else:
                    seq.commit()
                (t1,) = struct.unpack("d", _read_from(p, ack, 8))
                lat[kind].append(t1 - t0)
        _reap(procs)
        procs = []
        for end in ends:
            end.close()
        res["wait_wakeup_us"] = statistics.median(lat["rw"]) * 1e6
        res["wait_wakeup_readonly_us"] = statistics.median(lat["ro"]) * 1e6
        res["pipe_wakeup_us"] = statistics.median(lat["pipe"]) * 1e6
        res["wait_vs_pipe"] = res["wait_wakeup_us"] / res["pipe_wakeup_us"]
        res["wait_readonly_vs_pipe"] = res["wait_wakeup_readonly_us"] / res["pipe_wakeup_us"]
        # attach: a fresh spawned process (shmkv imported first), and a child forked from this
        # process (which holds the store, as a server forking its workers does); 8 of each,
        # alternated, each timing its own first attach
        attach_s: dict[str, list[float]] = {"spawn": [], "fork": []}
        for _ in range(8):
            for method in ("spawn", "fork"):
                mctx = mp.get_context(method)
                out = mctx.Queue()
                p = mctx.Process(target=_attacher, args=(name, out), name=f"attach-{method}")
                p.start()
                procs.append(p)
                attach_s[method].append(_result(out, p)[1])
                _reap(procs)
                procs = []
        res["attach_ms_spawn"] = statistics.median(attach_s["spawn"]) * 1e3
        res["attach_ms_fork"] = statistics.median(attach_s["fork"]) * 1e3
        # idle waiters (read-write, read-only): their wake-ups a second, counted by the kernel
        # (context switches)
        idle = {}
        for ro in (False, True):
            ready = ctx.Event()
            p = ctx.Process(target=_idle_waiter, args=(name, seq.id, ready, ro), name=f"idle-waiter-{ro}")
            p.start()
            procs.append(p)
            if not ready.wait(120):
                raise RuntimeError("the idle waiter did not start")
            idle[ro] = p
        time.sleep(0.5)  # into their waits
        span = 2.0 if quick else 5.0
        before, t0 = {ro: _switches(p.pid) for ro, p in idle.items()}, time.perf_counter()
        time.sleep(span)
        t = time.perf_counter() - t0
        res["idle_waiter_wakeups_per_s"] = (_switches(idle[False].pid) - before[False]) / t
        res["idle_readonly_waiter_wakeups_per_s"] = (_switches(idle[True].pid) - before[True]) / t
        seq.free()  # ends its wait (SequenceNotFound)
        _reap(procs)
    finally:
        _kill(procs)
        store.close()
    return res


def bench_prefix(quick: bool) -> Figures:
    import bench_prefix as bp  # tools/bench_prefix.py

    return bp.run(quick)


def bench_remote(quick: bool) -> Figures:
    """Needs redis-server on PATH (a throwaway server on a free loopback port) and redis-py."""
    import shutil

    if shutil.which("redis-server") is None:
        print("  (skipped: no redis-server on PATH; apt-get install redis-server)")
        return {}
    import bench_remote as br  # tools/bench_remote.py

    res = br.run(repeats=3 if quick else 5)
    return {k: float(v) for k, v in res.items() if isinstance(v, (int, float))}


def bench_hf(quick: bool) -> Figures:
    """model.generate() with ShmkvCache vs DynamicCache (tools/bench_hf.py, in its own process: torch
    threads and imports stay out of the other scenarios). Needs shmkv[transformers]."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        print("  (skipped: needs torch and transformers: pip install torch==2.13.0 'shmkv[transformers]')")
        return {}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_hf.py")
    r = subprocess.run([sys.executable, script, "--json", *(["--quick"] if quick else [])],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"tools/bench_hf.py failed ({r.returncode}): {r.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


SCENARIOS: dict[str, Callable[[bool], Figures]] = {
    "decode": bench_decode,
    "truncate": bench_truncate,
    "handoff": bench_handoff,
    "copy_prefix": bench_copy_prefix,
    "snapshot": bench_snapshot,
    "prefill": bench_prefill,
    "workers": bench_workers,
    "quant": bench_quant,
    "table": bench_table,
    "wait": bench_wait,
    "prefix": bench_prefix,
    "remote": bench_remote,
    "hf": bench_hf,
}

_MiB = 1 << 20
_TOK = 16 * 8 * 128 * 2 * 2  # bytes of one token of the 16-layer float16 shapes (K and V): 64 KiB

# Peak /dev/shm bytes each scenario holds at once (stores and baseline files), by --quick
# or not: measured in a private tmpfs (issue 26: decode 16 MiB quick, handoff 256,
# copy_prefix 192, snapshot 128, prefill 128, workers 384 on 2 cores, quant 24.3, table
# 12, prefix 28, remote 256; without --quick decode 64, copy_prefix 384, snapshot 256, quant 97,
# workers 512 on 2 cores) and written as the shapes' arithmetic, which gives the same figures. tools/bench.py
# refuses up front, saying how much, when /dev/shm has less free (plus SHM_MARGIN).
SHM_NEEDS: dict[str, Callable[[bool], int]] = {
    "decode": lambda quick: 32 * 8 * 128 * 2 * 2 * (128 if quick else 512),
    "truncate": lambda quick: 16 * _MiB,
    "handoff": lambda quick: 2 * 2048 * _TOK,  # the store and a plain /dev/shm file of the same bytes
    "copy_prefix": lambda quick: 3 * (1024 if quick else 2048) * _TOK,
    "snapshot": lambda quick: 2 * (1024 if quick else 2048) * _TOK,
    "prefill": lambda quick: 2048 * _TOK,  # the store or the pwrite file, never both
    "workers": lambda quick: (os.cpu_count() or 1) * (1024 + (2048 if quick else 3072)) * _TOK,
    # a float16 store and an int8 one (codes and a float32 scale per token and head), K and V
    "quant": lambda quick: (512 if quick else 2048) * 2 * 8 * 8 * (128 * 2 + 128 + 4),
    "table": lambda quick: 16 * _MiB,
    "wait": lambda quick: 4 * _MiB,
    "prefix": lambda quick: 32 * _MiB,
    "remote": lambda quick: 2 * 2048 * _TOK,  # two stores: the pusher's and the puller's
    "hf": lambda quick: 16 * _MiB,
}
SHM_MARGIN = 16 * _MiB  # headers, tables, the allocator's rounding
