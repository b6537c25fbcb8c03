#!/usr/bin/env python3
"""Benchmarks of shmkv against the alternatives, measured in the same run, reported as ratios.

Every scenario times shmkv and a baseline (numpy arrays, np.save, multiprocessing.Queue,
a plain /dev/shm file, redis-py, transformers' DynamicCache, ...) alternately, in this run,
on this machine, and prints its baseline in one sentence; the ratios are what count, as
absolute times move with the machine and its load. Figures with a goal (the project's
performance targets) end in "met" or "MISSED" followed by what the figure measures;
`shmkv bench --goals` lists every goal. A scenario whose optional dependency is not
installed is skipped, with one line naming the extra to install. The report says when the
machine was busy (load average above its cores), which makes MISSED lines likely.

  shmkv bench --quick              a short run (about a minute)
  shmkv bench --only decode,wait   some scenarios
  shmkv bench --quick --json       the figures as one JSON object on the last line
  shmkv bench --only serve         the end-to-end serving benchmark (minutes; not in a plain run):
                                   worker processes answer a chat workload with model.generate(),
                                   DynamicCache vs one shared store vs a warm restart
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time

import numpy as np

from shmkv.cli._quiet import quiet_children

from .args import png_arg
from .goals import GOALS, WHAT, listing, met
from .scenarios import BASELINES, OPT_IN, SCENARIOS, SHM_MARGIN, SHM_NEEDS, lacking
from .timing import end_children, remove_scratch

ROWS = [  # (what, shmkv key, baseline text, baseline key or None, ratio key, how the ratio reads)
    ("per-token append + commit, 32 layers", "decode_us_per_token", "preallocated numpy slices",
     "numpy_us_per_token", "decode_ratio", "time / numpy"),
    ("speculative step: truncate + append + commit", "spec_step_us", "append + commit alone",
     "append_commit_us", "truncate_step_us", "us added per step"),
    ("hand-off of 128 MiB: attach + views", "handoff_ms", "multiprocessing.Queue, receiver waiting",
     "queue_handoff_ms", "handoff_speedup_vs_queue", "Queue time / shmkv time incl. full read"),
    ("hand-off of 128 MiB: full read", "handoff_read_ms", "mmap + read of a /dev/shm file",
     "shm_file_read_ms", "handoff_read_ratio", "time / file read"),
    ("create_sequence at 4096 sequences", "create_sequence_us_4096", "flat: the same at 16 sequences",
     "create_sequence_us_16", "create_sequence_us_4096", "us"),
    ("store.sequence(id) at 4096 sequences", "open_sequence_us_4096", "flat: the same at 16 sequences",
     "open_sequence_us_16", "open_sequence_us_4096", "us"),
    ("store.sequences() per sequence", "sequences_us_per_seq", "worst of 16, 256, 4096 sequences", None,
     "sequences_us_per_seq", "us"),
    ("copy_prefix", "copy_prefix_gbps", "np.copyto", "copyto_gbps", "copy_prefix_ratio", "bandwidth / np.copyto"),
    ("snapshot save", "save_gbps", "np.save + fsync + atomic rename", "np_save_gbps", "save_ratio",
     "bandwidth / np.save"),
    ("snapshot load", "load_gbps", "sendfile into fresh /dev/shm (limit)", "sendfile_limit_gbps",
     "load_vs_limit", "bandwidth / limit"),
    ("snapshot load vs np.load", "load_gbps", "np.load", "np_load_gbps", "load_ratio", "bandwidth / np.load"),
    ("prefill 128 MiB into a new store", "prefill_ms", "pwrite into fresh /dev/shm (limit)", "pwrite_limit_ms",
     "prefill_vs_limit", "limit time / shmkv"),
    ("decode workers beside a snapshotter (N = cores - 1)", "snapshotter_overhead", "the same workers alone",
     None, "snapshotter_overhead", "throughput lost"),
    ("decode workers beside a snapshotter (N = cores)", "snapshotter_overhead_at_cores", "the same workers alone",
     None, "snapshotter_overhead_at_cores", "throughput lost"),
    ("int8 quantize on write", "quantize_ratio", "float16 store, same shape", None, "quantize_ratio",
     "throughput / float16"),
    ("int8 dequantize on read", "dequantize_ratio", "float16 store, same shape", None, "dequantize_ratio",
     "throughput / float16"),
    ("int8 decode step, 2048 tokens", "int8_step_us", "float16 store, same step", "float16_step_us",
     "int8_step_ratio", "time / float16"),
    ("Sequence.wait wake-up", "wait_wakeup_us", "a pipe's wake-up", "pipe_wakeup_us", "wait_vs_pipe",
     "time / pipe"),
    ("Sequence.wait wake-up, read-only attachment", "wait_wakeup_readonly_us", "a pipe's wake-up", "pipe_wakeup_us",
     "wait_readonly_vs_pipe", "time / pipe"),
    ("idle Sequence.wait", "idle_waiter_wakeups_per_s", "none", None, "idle_waiter_wakeups_per_s", "wake-ups/s"),
    ("idle Sequence.wait, read-only attachment", "idle_readonly_waiter_wakeups_per_s", "none", None,
     "idle_readonly_waiter_wakeups_per_s", "wake-ups/s"),
    ("match_prefix, 300 tokens, 1000 cached sequences", "prefix_lookup_us_1000", "the same with 16 cached",
     "prefix_lookup_us_16", "prefix_lookup_us_1000", "us"),
    ("time to first token, system prompt cached", "prefix_ttft_ms", "the same request computed whole",
     "noprefix_ttft_ms", "prefix_ttft_ratio", "time / without reuse"),
    ("32 requests over a cached 2,048-token system prompt: memory", "prefix_memory_ratio",
     "the distinct tokens' bytes", None, "prefix_memory_ratio", "bytes held / distinct bytes"),
    ("create_sequence(prefix=) over a cached 2,048-token prefix", "prefix_request_ms", "a one-token extend",
     "extend1_us", "prefix_request_vs_extend1", "create time / extend time"),
    ("read a stitched 2,112-token view (shared prefix pages)", "stitch_build_us", "a plain view of the same bytes",
     None, "stitched_read_ratio", "plain time / stitched time"),
    ("remote tier pull, 128 MiB", "remote_pull_ms", "redis-py pipelined GET", "remote_get_ms", "remote_pull_ratio",
     "redis-py time / shmkv time"),
    ("generate(), 256 tokens, batch 1", "hf_shmkv_ms", "DynamicCache", "hf_dynamic_ms", "hf_generate_ratio",
     "time / DynamicCache"),
    ("generate(), 256 tokens, batch 4", "hf_shmkv_ms_b4", "DynamicCache", "hf_dynamic_ms_b4", "hf_generate_ratio_b4",
     "time / DynamicCache"),
    ("remote tier push, 128 MiB", "remote_push_ms", "redis-py pipelined SET", "remote_set_ms", "remote_push_ratio",
     "redis-py time / shmkv time"),
]


def markdown(r: dict[str, float]) -> str:
    lines = ["| scenario | shmkv | baseline | ratio | goal |", "| --- | --- | --- | --- | --- |"]
    for what, key, base, base_key, ratio, how in ROWS:
        if key not in r or ratio not in r:
            continue
        base_val = f" ({base_key} = {r[base_key]:.3g})" if base_key in r else ""
        gk = ratio if ratio in GOALS else key
        goal = GOALS.get(gk)
        goal_s = f"{gk} {goal[0]} {goal[1]:g}: {'met' if met(r[gk], goal) else 'missed'}" if goal else ""
        lines.append(f"| {what} | {key} = {r[key]:.3g} | {base}{base_val} | {r[ratio]:.3g} ({how}) | {goal_s} |")
    return "\n".join(lines)


PLOTTED = ("decode_ratio", "handoff_read_ratio", "copy_prefix_ratio", "save_ratio", "load_vs_limit",
           "prefill_vs_limit", "ttft_p50_ratio", "throughput_ratio", "pss_ratio", "restart_ttft_ratio")


def plot(r: dict[str, float], path: str) -> list[str]:
    """Draw the main ratios that ``r`` has (``PLOTTED``) against their goals into ``path``; return
    them (none: nothing is written)."""
    keys = [k for k in PLOTTED if k in r]
    if not keys:
        return keys
    import matplotlib  # (--plot's png_arg checked that it is there)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.barh(keys, [r[k] for k in keys], color=["#4a7" if met(r[k], GOALS[k]) else "#c55" for k in keys])
    for i, k in enumerate(keys):
        ax.plot([GOALS[k][1]] * 2, [i - 0.4, i + 0.4], "k--", lw=1)
    ax.set_xlabel("ratio against the baseline measured in the same run (dashed: goal)")
    ax.set_title("shmkv vs its baselines (green: goal met)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return keys


def shm_refusal(names: list[str], quick: bool) -> str | None:
    """None if /dev/shm has the room the chosen scenarios need (the largest of them: they run
    one after another), else what to say: how much, for which, how to get it, what fits."""
    needs = {n: SHM_NEEDS[n](quick) + SHM_MARGIN for n in names}
    worst = max(needs, key=lambda n: needs[n])
    what = f"shmkv bench{' --quick' if quick else ''} (its largest scenario, {worst})"
    try:
        from shmkv.store._doctor import room
    except ImportError:  # tools/bench_against.py runs this harness against older trees: say it plainly
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        msg = None if free >= needs[worst] else (f"{what} needs {needs[worst] >> 20} MiB free in /dev/shm; it has "
                                                 f"{free >> 20} MiB: `docker run --shm-size=...` gives more")
    else:
        msg = room(needs[worst], what)
    if msg is None:
        return None
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    fit = [n for n in names if needs[n] <= free]
    return f"shmkv bench: {msg}" + (f"; or run only what fits now: --only {','.join(fit)}" if fit else "")


def load() -> float | None:
    """The 1-minute load average (None where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def load_words(at_start: float | None, at_end: float | None = None) -> tuple[str, bool]:
    """The load average in words, and whether the machine counts as busy: more runnable
    processes than cores at the start, or at the end beyond the one the bench adds itself."""
    cores = os.cpu_count() or 1
    if at_start is None:
        return "load average unknown", False
    busy = at_start > cores or (at_end is not None and at_end > cores + 1)
    end = "" if at_end is None else f", {at_end:.1f} at the end (the bench adds about 1)"
    return (f"load average {at_start:.1f} at the start{end} on {cores} cores"
            + (": busy, the figures are slower and noisier than on an idle machine" if busy else "")), busy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shmkv bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.add_argument("--only", help="comma-separated scenarios: " + ",".join(SCENARIOS) + "; "
                   + ", ".join(sorted(OPT_IN)) + " only when named here (--only serve: the end-to-end serving "
                   "benchmark, minutes)")
    p.add_argument("--goals", action="store_true", help="list the goals and what each measures, and exit")
    p.add_argument("--markdown", action="store_true",
                   help="also print the results as a Markdown table (scenario, shmkv, baseline, ratio, goal)")
    p.add_argument("--plot", metavar="PNG", type=png_arg,
                   help="draw the main ratios (needs the plot extra: matplotlib)")
    a = p.parse_args(argv)
    if a.goals:
        print(listing())
        return 0
    names = a.only.split(",") if a.only else [n for n in SCENARIOS if n not in OPT_IN]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    skipped = {n: why for n in names if (why := lacking(n))}  # decided before any work
    names = [n for n in names if n not in skipped]
    refusal = shm_refusal(names, a.quick) if names else None
    if refusal:  # before any scenario starts: not a CacheFullError traceback halfway through
        print(refusal, file=sys.stderr)
        return 1
    results: dict[str, float] = {}
    try:  # private: which crc32 the snapshots use; older trees keep it elsewhere
        from shmkv._snapshot.format import CRC32
    except ImportError:
        CRC32 = "?"

    at_start = load()
    start, busy = load_words(at_start)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"numpy {np.__version__}, snapshot crc32 from {CRC32}{', quick' if a.quick else ''}; {start}", flush=True)
    for name, why in skipped.items():
        print(f"[{name}] skipped: {why}", flush=True)
    t_all = time.perf_counter()
    missed: list[str] = []
    undo = quiet_children()  # a Ctrl-C: this process stops (each scenario's finally ends its processes)
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                r = SCENARIOS[name](a.quick)
            except ImportError as e:
                if not os.environ.get("SHMKV_BENCH_AGAINST"):
                    raise
                # tools/bench_against.py, measuring an older tree that lacks what the scenario
                # uses (shared prefix pages, a module since moved): its keys are one side's only
                why = f"lacks {e.name}" if e.name else f"cannot run it ({e})"
                print(f"\n[{name}] skipped: this shmkv {why}", flush=True)
                continue
            results.update(r)
            print(f"\n[{name}] ({time.perf_counter() - t0:.1f} s) baseline: {BASELINES[name]}")
            for key, val in r.items():
                goal = GOALS.get(key)
                mark = f"   goal {goal[0]} {goal[1]:g}: {'met' if met(val, goal) else 'MISSED'}" if goal else ""
                print(f"  {key:<30} {val:12.3f}{mark}")
                if goal and not met(val, goal):
                    missed.append(key)
                    print(f"  {'':<30} {'':12} ({WHAT[key]})")
            sys.stdout.flush()
    except KeyboardInterrupt:
        # A second Ctrl-C (``timeout -s INT`` signals the process and then its group) may have cut
        # a scenario's cleanup short: from here on SIGINT is ignored, and what a cleanup may have
        # left is ended here: children (one started just before the Ctrl-C is in no list yet) and
        # this process's scratch files. Its stores go at exit (a creator removes its stores).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_children()
        remove_scratch()
        print("shmkv bench: interrupted", file=sys.stderr)
        return 130
    finally:
        undo()
    results["seconds"] = time.perf_counter() - t_all
    end, busy = load_words(at_start, load())
    print(f"\n{len(names)} scenario(s) in {results['seconds']:.0f} s; {end}")
    if skipped:
        print(f"skipped: {', '.join(skipped)} (see their lines at the top)")
    if missed:
        print(f"{len(missed)} goal(s) missed: {', '.join(missed)}"
              + ("; the machine was busy, which slows the figures and makes them noisy: rerun on an idle "
                 "machine before reading a MISSED as slowness of shmkv" if busy else ""))
    if a.markdown:
        print("\n" + markdown(results))
    if a.plot:
        drawn = plot(results, a.plot)
        print(f"plot: {a.plot} ({', '.join(drawn)})" if drawn else
              f"plot: nothing written: none of the ratios it draws ({', '.join(PLOTTED)}) was measured")
    if a.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
