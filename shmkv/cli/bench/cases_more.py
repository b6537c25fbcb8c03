"""More benchmark scenarios of ``shmkv bench``: decode workers beside a snapshotter, int8, the
sequence table, Sequence.wait, and the prefix, remote and transformers scenarios (in prefix.py,
remote.py and hf.py). See cases.py for how every scenario measures."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
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

from .timing import Figures, kill, reap, result_of, alternated, touch


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
                result_of(out, *procs)  # all attached and waiting
            for r in range(rounds):
                for w in counts:
                    for with_snap in ((False, True) if r % 2 == 0 else (True, False)):
                        for c in ctrls:
                            c.send("reset")
                        for _ in ctrls:
                            assert result_of(out, *procs)[0] == "reset"
                        if with_snap:
                            stop.clear()
                            snap_ctrl.send(True)
                            assert result_of(out, *procs)[0] == "started"
                        for c in ctrls[:w]:
                            c.send(n)
                        got = [result_of(out, *procs, timeout=600) for _ in range(w)]
                        assert all(tag == "rate" for tag, _ in got), got
                        rates[(w, with_snap)].append(sum(x for _, x in got))
                        if with_snap:
                            stop.set()
                            tag, count = result_of(out, *procs, timeout=600)
                            assert tag == "count"
                            snaps[w].append(count)
            for c in ctrls:
                c.send(None)
            snap_ctrl.send(None)
            reap(procs)
        finally:
            kill(procs)
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
        # A process running a model has freed large arrays before; glibc's malloc then keeps
        # freed heap memory for the next ones. In one that never has, it hands each freed top of
        # the heap back to the kernel, and every dequantized copy faults its pages in afresh (3x
        # the read's time here): both stores are measured as a serving process finds malloc.
        np.ones(16 << 20, np.uint8)  # (16 MiB, freed at once)
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


def _switches(pid: int | None) -> int:
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
        reap(procs)
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
                mctx: Any = mp.get_context(method)  # (spawn or fork: both have Process)
                out = mctx.Queue()
                p = mctx.Process(target=_attacher, args=(name, out), name=f"attach-{method}")
                p.start()
                procs.append(p)
                attach_s[method].append(result_of(out, p)[1])
                reap(procs)
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
        reap(procs)
    finally:
        kill(procs)
        store.close()
    return res


def bench_prefix(quick: bool) -> Figures:
    from . import prefix as bp

    return bp.run(quick)


def bench_remote(quick: bool) -> Figures:
    """Needs redis-server on PATH (a throwaway server on a free loopback port) and redis-py."""
    import shutil

    if shutil.which("redis-server") is None:
        print("  (skipped: no redis-server on PATH; apt-get install redis-server)")
        return {}
    from . import remote as br

    res = br.run(repeats=3 if quick else 5)
    return {k: float(v) for k, v in res.items() if isinstance(v, (int, float))}


def bench_hf(quick: bool) -> Figures:
    """model.generate() with ShmkvCache vs DynamicCache (hf.py, in its own process: torch
    threads and imports stay out of the other scenarios). Needs shmkv[transformers]."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        print("  (skipped: needs torch and transformers: pip install torch==2.13.0 'shmkv[transformers]')")
        return {}
    from . import hf

    script = os.path.abspath(hf.__file__)
    r = subprocess.run([sys.executable, script, "--json", *(["--quick"] if quick else [])],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode == hf.NOT_IN_THIS_SHMKV:  # an older tree (tools/bench_against.py): driver.main says so
        raise ImportError(r.stderr.strip())
    if r.returncode:
        raise RuntimeError(f"the hf scenario (shmkv/cli/bench/hf.py) failed ({r.returncode}): {r.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
