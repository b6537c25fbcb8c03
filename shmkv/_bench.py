"""Benchmarks against the alternatives, measured in the same run, reported as ratios.

Run ``python tools/bench.py`` (or ``shmkv bench``); ``--quick`` for a short run,
``--json`` to end with one JSON object. Every scenario times shmkv and its
baseline in this process, on this machine, now; the ratios are what count.
"""

from __future__ import annotations

import argparse
import mmap
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from . import _store
from .testing import unique_name


def _paired(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Medians of ``a`` and ``b`` timed alternately, so drift on a shared machine hits both."""
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- 1. decode ------------------------------------------------------------------


def bench_decode(quick: bool) -> dict[str, float]:
    L, H, D, n = 32, 8, 128, (128 if quick else 512)
    rng = np.random.default_rng(0)
    ks = rng.standard_normal((n, H, D)).astype(np.float16)
    vs = rng.standard_normal((n, H, D)).astype(np.float16)
    store = _store.create(unique_name("bd"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                          max_tokens=n + 8, max_seqs=2)
    try:
        seq = store.create_sequence(capacity=n)  # reserved once: prefill measures reservation

        def run_shmkv() -> None:
            append, commit = seq.append, seq.commit
            for t in range(n):
                k, v = ks[t], vs[t]
                for layer in range(L):
                    append(layer, k, v)  # returns the views attention reads
                commit()

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

        def run_shmkv_fresh() -> None:
            seq.clear()  # a structural op: one lock, outside the per-token path
            run_shmkv()

        reps = 3 if quick else 7
        t_s, t_n = _paired(run_shmkv_fresh, run_numpy, reps)
        t_s, t_n = t_s / n, t_n / n
        t_c = _median(run_concat, 1 if quick else 3) / min(n, 128)
    finally:
        store.close()
    return {"decode_us_per_token": t_s * 1e6, "numpy_us_per_token": t_n * 1e6,
            "concat_us_per_token": t_c * 1e6, "decode_ratio": t_s / t_n}


# -- 2. hand-off ---------------------------------------------------------------


def _child_attach(name: str, seq_id: int, out: Any) -> None:
    t0 = time.perf_counter()
    store = _store.attach(name, readonly=True)
    seq = store.sequence(seq_id)
    views = [seq.kv(layer) for layer in range(store.layout.layers)]
    t1 = time.perf_counter()
    out.put((t1 - t0, float(views[-1][0][-1, 0, 0])))
    store.close()


def _child_queue(q: Any, out: Any) -> None:
    t0 = time.perf_counter()
    arrays = q.get()
    out.put((time.perf_counter() - t0, float(arrays[0][-1, 0, 0, 0])))


def _child_pipe(conn: Any, out: Any) -> None:
    t0 = time.perf_counter()
    k = np.frombuffer(conn.recv_bytes(), np.float16)
    v = np.frombuffer(conn.recv_bytes(), np.float16)
    out.put((time.perf_counter() - t0, float(k[-1] + v[-1])))


def _child_memmap(path: str, shape: tuple[int, ...], out: Any) -> None:
    t0 = time.perf_counter()
    a = np.memmap(path, np.float16, "r", shape=shape)
    out.put((time.perf_counter() - t0, float(a[(-1,) * a.ndim])))


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


def bench_handoff(quick: bool) -> dict[str, float]:
    L, H, D, n = 16, 8, 128, 2048  # 2 x 16 x 2048 x 8 x 128 x 2 bytes = 128 MiB
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(1)
    k = rng.standard_normal((L, n, H, D)).astype(np.float16)
    v = rng.standard_normal((L, n, H, D)).astype(np.float16)
    name = unique_name("bh")
    store = _store.create(name, layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=n, max_seqs=2)
    res: dict[str, float] = {"handoff_mib": 2 * k.nbytes / 2**20}
    try:
        seq = store.create_sequence(capacity=n)
        seq.extend(k, v)
        out = ctx.Queue()
        times = []
        for _ in range(3):
            p = ctx.Process(target=_child_attach, args=(name, seq.id, out))
            p.start()
            times.append(_result(out, p)[0])
            p.join()
        res["handoff_ms"] = statistics.median(times) * 1e3
        q = ctx.Queue()
        times = []
        for _ in range(1 if quick else 3):
            p = ctx.Process(target=_child_queue, args=(q, out))
            p.start()
            t0 = time.perf_counter()
            q.put([k, v])
            dt = _result(out, p)[0]
            p.join()
            times.append(max(dt, time.perf_counter() - t0))
        res["queue_handoff_ms"] = statistics.median(times) * 1e3
        times = []
        for _ in range(1 if quick else 3):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child_pipe, args=(r, out))
            p.start()
            t0 = time.perf_counter()
            w.send_bytes(k.tobytes())  # what a sender does: one copy, then the pipe
            w.send_bytes(v.tobytes())
            dt = _result(out, p)[0]
            p.join()
            times.append(time.perf_counter() - t0)
        res["pipe_handoff_ms"] = statistics.median(times) * 1e3
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "kv.npy")
            t0 = time.perf_counter()
            mm = np.memmap(path, np.float16, "w+", shape=(2, *k.shape))
            mm[0] = k
            mm[1] = v
            mm.flush()
            t_write = time.perf_counter() - t0
            del mm
            p = ctx.Process(target=_child_memmap, args=(path, (2, *k.shape), out))
            p.start()
            dt = _result(out, p)[0]
            p.join()
            res["memmap_handoff_ms"] = (t_write + dt) * 1e3  # K and V written, then mapped
    finally:
        store.close()
    res["handoff_speedup_vs_queue"] = res["queue_handoff_ms"] / res["handoff_ms"]
    return res


# -- 3. copy_prefix --------------------------------------------------------------


def bench_copy_prefix(quick: bool) -> dict[str, float]:
    L, H, D, n = 16, 8, 128, (1024 if quick else 2048)
    store = _store.create(unique_name("bc"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                          max_tokens=2 * n, max_seqs=2)
    try:
        rng = np.random.default_rng(2)
        src = store.create_sequence(capacity=n)
        kv = rng.standard_normal((2, L, n, H, D)).astype(np.float16)
        src.extend(kv[0], kv[1])
        dst = store.create_sequence(capacity=n)
        dst.release()
        store.copy_prefix(src.id, dst.id, n)  # warm
        t_s = _median(lambda: store.copy_prefix(src.id, dst.id, n), 5)
        a = np.empty((2, L, n, H, D), np.float16)
        b = np.empty_like(a)
        a.fill(1)
        b.fill(0)
        t_n = _median(lambda: np.copyto(b, a), 5)
        nbytes = a.nbytes
    finally:
        store.close()
    return {"copy_prefix_gbps": nbytes / t_s / 1e9, "copyto_gbps": nbytes / t_n / 1e9, "copy_prefix_ratio": t_n / t_s}


# -- 4. snapshots -----------------------------------------------------------------


def bench_snapshot(quick: bool, directory: str | None = None) -> dict[str, float]:
    L, H, D, n = 16, 8, 128, (1024 if quick else 2048)
    name = unique_name("bs")
    store = _store.create(name, layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=2 * n, max_seqs=4)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((L, n, H, D)).astype(np.float16)
    v = rng.standard_normal((L, n, H, D)).astype(np.float16)
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=directory) as d:
        try:
            seq = store.create_sequence(capacity=n)
            seq.extend(k, v)
            snap, npy = os.path.join(d, "s.shmkv"), os.path.join(d, "s.npz")
            both = np.stack([k, v])
            reps = 3 if quick else 5

            def np_save() -> None:
                with open(npy, "wb") as f:
                    np.save(f, both)
                    f.flush()
                    os.fsync(f.fileno())

            t_save, t_npsave = _paired(lambda: store.save(snap), np_save, reps)
            t_packb = _median(lambda: msgpack.packb([k.tobytes(), v.tobytes()]), 1 if quick else 3)
            loaded_names = []

            def load() -> None:
                nm = unique_name("bl")
                loaded_names.append(nm)
                s = _load(snap, nm)
                s.close()

            t_load, t_npload = _paired(load, lambda: np.load(npy), reps)
            res = {"save_gbps": both.nbytes / t_save / 1e9, "np_save_gbps": both.nbytes / t_npsave / 1e9,
                   "packb_gbps": both.nbytes / t_packb / 1e9, "load_gbps": both.nbytes / t_load / 1e9,
                   "np_load_gbps": both.nbytes / t_npload / 1e9,
                   "save_ratio": t_npsave / t_save, "load_ratio": t_npload / t_load}
        finally:
            store.close()
    return res


def _load(path: str, name: str) -> _store.Store:
    from ._snapshot import load

    return load(path, name)


# -- 5. prefill into fresh memory ----------------------------------------------------


def bench_prefill(quick: bool) -> dict[str, float]:
    L, H, D, n = 16, 8, 128, 2048
    rng = np.random.default_rng(4)
    k = rng.standard_normal((L, n, H, D)).astype(np.float16)
    store = _store.create(unique_name("bp"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                          max_tokens=n, max_seqs=2)
    try:
        times_w, times_r = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            seq = store.create_sequence(capacity=n)  # reserves and pre-faults the range
            t1 = time.perf_counter()
            seq.extend(k, k)
            t2 = time.perf_counter()
            times_r.append(t1 - t0)
            times_w.append(t2 - t1)
            seq.free()
            # give the pages back so the next round starts from fresh memory
            store._dseg.mm.madvise(mmap.MADV_REMOVE, 0, store._dseg.size)  # type: ignore[union-attr]

        def first_touch() -> None:
            a = np.empty((L, n, H, D), np.float16)
            b = np.empty((L, n, H, D), np.float16)
            a[:] = k
            b[:] = k

        t_ft = _median(first_touch, 3)
    finally:
        store.close()
    t_w = statistics.median(times_w)
    return {"prefill_write_ms": t_w * 1e3, "prefill_reserve_ms": statistics.median(times_r) * 1e3,
            "first_touch_ms": t_ft * 1e3, "prefill_ratio": t_ft / t_w}


# -- 6. decode workers beside a snapshotter ----------------------------------------------


def _decode_worker(name: str, seq_id: int, n: int, out: Any) -> None:
    store = _store.attach(name)
    lay = store.layout
    seq = store.sequence(seq_id, write=True)
    k = np.ones((lay.kv_heads, lay.head_dim), np.float16)
    t0 = time.perf_counter()
    for _ in range(n):
        for layer in range(lay.layers):
            seq.append(layer, k, k)
        seq.commit()
    out.put(n / (time.perf_counter() - t0))
    store.close()


def _snap_loop(name: str, path: str, stop: Any, out: Any) -> None:
    os.nice(10)  # as `shmkv snapshot` does by default: decode workers come first
    store = _store.attach(name, readonly=True)
    count = 0
    while not stop.is_set():
        store.save(path)
        count += 1
    out.put(count)
    store.close()


def bench_workers(quick: bool) -> dict[str, float]:
    L, H, D = 16, 8, 128
    n = 300 if quick else 4000  # long enough that the snapshotter runs during most of it
    ctx = mp.get_context("spawn")
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        for workers in (1, 2):
            for with_snap in (False, True):
                name = unique_name("bw")
                store = _store.create(name, layers=L, kv_heads=H, head_dim=D, dtype="float16",
                                      max_tokens=workers * (n + 2048), max_seqs=4)
                try:
                    ids = []
                    rng = np.random.default_rng(5)
                    for _ in range(workers):
                        s = store.create_sequence(capacity=n + 2048)
                        s.extend(rng.standard_normal((L, 2048, H, D)), rng.standard_normal((L, 2048, H, D)))
                        ids.append(s.id)
                        s.release()
                    out, stop = ctx.Queue(), ctx.Event()
                    snap = None
                    if with_snap:
                        snap = ctx.Process(target=_snap_loop, args=(name, os.path.join(d, "w.shmkv"), stop, out))
                        snap.start()
                        time.sleep(0.3)
                    procs = [ctx.Process(target=_decode_worker, args=(name, i, n, out)) for i in ids]
                    for p in procs:
                        p.start()
                    rates = [_result(out, *procs, timeout=600) for _ in procs]
                    for p in procs:
                        p.join()
                    if snap is not None:
                        stop.set()
                        res[f"snapshots_during_{workers}w"] = _result(out, snap, timeout=600)
                        snap.join()
                    res[f"tokens_per_s_{workers}w{'_snap' if with_snap else ''}"] = sum(rates)
                finally:
                    store.close()
    over = [1 - res[f"tokens_per_s_{w}w_snap"] / res[f"tokens_per_s_{w}w"] for w in (1, 2)]
    res["snapshotter_overhead"] = max(over)
    return res


# -- 7. int8 quantization ------------------------------------------------------------


def bench_quant(quick: bool) -> dict[str, float]:
    L, H, D, n = 8, 8, 128, (512 if quick else 2048)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((L, n, H, D)).astype(np.float32)
    res: dict[str, float] = {}
    stores = {dt: _store.create(unique_name("bq"), layers=L, kv_heads=H, head_dim=D, dtype=dt, max_tokens=n,
                                max_seqs=2) for dt in ("float16", "int8")}
    try:
        seqs = {dt: st.create_sequence(capacity=n) for dt, st in stores.items()}
        for seq in seqs.values():
            seq.extend(x, x)

        def write(dt: str) -> Callable[[], None]:
            def run() -> None:
                seqs[dt].truncate(0)
                seqs[dt].extend(x, x)
            return run

        # the baseline: a plain copy of the same data already in float16
        x16 = x.astype(np.float16)
        dst16 = np.empty_like(x16)
        dst16.fill(0)
        def copy16() -> None:
            np.copyto(dst16, x16)  # K
            np.copyto(dst16, x16)  # V

        t_copy = _median(copy16, 3)
        t_w8 = _median(write("int8"), 3)  # quantize on write (K and V)
        t_r8 = _median(lambda: [seqs["int8"].kv(layer) for layer in range(L)], 3)  # dequantize on read
        t_w16, t_r16 = t_copy, t_copy
        res = {"quantize_ratio": t_w16 / t_w8, "dequantize_ratio": t_r16 / t_r8,
               "int8_bytes_per_token": stores["int8"].bytes_per_token,
               "float16_bytes_per_token": stores["float16"].bytes_per_token,
               "int8_memory_ratio": stores["int8"].bytes_per_token / stores["float16"].bytes_per_token}
    finally:
        for st in stores.values():
            st.close()
    return res


SCENARIOS: dict[str, Callable[[bool], dict[str, float]]] = {
    "decode": bench_decode,
    "handoff": bench_handoff,
    "copy_prefix": bench_copy_prefix,
    "snapshot": bench_snapshot,
    "prefill": bench_prefill,
    "workers": bench_workers,
    "quant": bench_quant,
}

GOALS = {  # DESIGN.md section 7: key -> (comparison, bound)
    "decode_ratio": ("<=", 2.0),
    "handoff_ms": ("<", 1.0),
    "copy_prefix_ratio": (">=", 0.8),
    "save_ratio": (">=", 0.9),
    "load_ratio": (">=", 0.9),
    "prefill_ratio": (">=", 3.0),
    "snapshotter_overhead": ("<", 0.10),
}


ROWS = [  # (what, shmkv key, baseline text, ratio key or None, how the ratio reads)
    ("per-token append + commit, 32 layers", "decode_us_per_token", "preallocated numpy slices",
     "decode_ratio", "time / numpy"),
    ("hand-off of 128 MiB to another process", "handoff_ms", "multiprocessing.Queue (queue_handoff_ms)",
     "handoff_speedup_vs_queue", "Queue time / shmkv time"),
    ("copy_prefix", "copy_prefix_gbps", "np.copyto (copyto_gbps)", "copy_prefix_ratio", "bandwidth / np.copyto"),
    ("snapshot save", "save_gbps", "np.save + fsync (np_save_gbps)", "save_ratio", "bandwidth / np.save"),
    ("snapshot load", "load_gbps", "np.load (np_load_gbps)", "load_ratio", "bandwidth / np.load"),
    ("prefill writes into reserved memory", "prefill_write_ms", "first-touch numpy (first_touch_ms)",
     "prefill_ratio", "first-touch time / shmkv"),
    ("2 decode workers beside a snapshotter", "tokens_per_s_2w_snap", "without it (tokens_per_s_2w)",
     "snapshotter_overhead", "throughput lost"),
    ("int8 quantize on write", "quantize_ratio", "float16 copy", None, "throughput / copy"),
    ("int8 dequantize on read", "dequantize_ratio", "float16 copy", None, "throughput / copy"),
]


def markdown(r: dict[str, float]) -> str:
    lines = ["| scenario | shmkv | baseline | ratio | goal |", "| --- | --- | --- | --- | --- |"]
    for what, key, base, ratio, how in ROWS:
        if key not in r:
            continue
        base_key = base.split("(")[-1].rstrip(")") if "(" in base else None
        base_val = f" = {r[base_key]:.3g}" if base_key in r else ""
        rk = ratio or key
        gk = key if key in GOALS else rk
        goal = GOALS.get(gk)
        goal_s = f"{gk} {goal[0]} {goal[1]}: {'met' if _met(r[gk], goal) else 'missed'}" if goal else ""
        lines.append(f"| {what} | {key} = {r[key]:.3g} | {base}{base_val} | {r[rk]:.3g} ({how}) | {goal_s} |")
    return "\n".join(lines)


def _met(val: float, goal: tuple[str, float]) -> bool:
    op, bound = goal
    return {"<=": val <= bound, "<": val < bound, ">=": val >= bound}[op]


def plot(r: dict[str, float], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'shmkv[plot]'") from None
    keys = [k for k in ("decode_ratio", "copy_prefix_ratio", "save_ratio", "load_ratio", "prefill_ratio")
            if k in r]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(keys, [r[k] for k in keys], color=["#4a7" if _met(r[k], GOALS[k]) else "#c55" for k in keys])
    for i, k in enumerate(keys):
        ax.plot([GOALS[k][1]] * 2, [i - 0.4, i + 0.4], "k--", lw=1)
    ax.set_xlabel("ratio against the baseline measured in the same run (dashed: goal)")
    ax.set_title("shmkv vs numpy / np.save / np.load (green: goal met)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shmkv bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.add_argument("--only", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    p.add_argument("--markdown", action="store_true", help="also print the README's table (Markdown)")
    p.add_argument("--plot", metavar="PNG", help="draw the main ratios (needs the plot extra: matplotlib)")
    a = p.parse_args(argv)
    names = a.only.split(",") if a.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    results: dict[str, float] = {}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"numpy {np.__version__}{', quick' if a.quick else ''}")
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        r = SCENARIOS[name](a.quick)
        results.update(r)
        print(f"\n[{name}] ({time.perf_counter() - t0:.1f} s)")
        for key, val in r.items():
            goal = GOALS.get(key)
            mark = ""
            if goal:
                op, bound = goal
                ok = {"<=": val <= bound, "<": val < bound, ">=": val >= bound}[op]
                mark = f"   goal {op} {bound}: {'met' if ok else 'MISSED'}"
            print(f"  {key:<28} {val:12.3f}{mark}")
    results["seconds"] = time.perf_counter() - t_all
    if a.markdown:
        print("\n" + markdown(results))
    if a.plot:
        plot(results, a.plot)
    if a.json:
        print(json.dumps(results))
    return 0
