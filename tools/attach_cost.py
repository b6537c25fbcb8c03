#!/usr/bin/env python3
"""What a fresh process's ``shmkv.attach`` costs, counted as well as timed.

    PYTHONPATH=. python tools/attach_cost.py [--rounds 16]

The bench's ``attach_ms_spawn`` and ``attach_ms_fork`` (``shmkv bench --only wait``) time a
first attach; on a shared machine the times move with the load. This prints, for a spawned
process and for a child forked from a process that created the store (as a server forks its
workers; multiprocessing's fork context, shmkv imported before the fork), the median and
smallest time of one ``attach`` (timed from just before the call to its return, the first
attach of the process) with the minor page faults the kernel counted in it: in a forked
child nearly every one is a copy of a page of the parent's Python heap that attach wrote (a
reference count, a code object's counter, an allocation), and that count does not move with
the load. Alternated spawn/fork, ``--rounds`` of each.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

import shmkv
from shmkv.testing import unique_name


def _child(name: str, out: Any) -> None:
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    store = shmkv.attach(name)
    t = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
    store.close()
    out.put((t, faults))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    name = unique_name("aC")
    store = shmkv.create(name, layers=2, kv_heads=2, head_dim=8, dtype="float16", max_tokens=68, max_seqs=4)
    got: dict[str, list[tuple[float, int]]] = {"spawn": [], "fork": []}
    try:
        for _ in range(args.rounds):
            for method in ("spawn", "fork"):
                ctx: Any = mp.get_context(method)
                out = ctx.Queue()
                p = ctx.Process(target=_child, args=(name, out))
                p.start()
                got[method].append(out.get(timeout=120))
                p.join(60)
    finally:
        store.close()
    for method, runs in got.items():
        ms = [t * 1e3 for t, _ in runs]
        faults = [f for _, f in runs]
        print(f"attach in a {method}ed process: median {statistics.median(ms):.3f} ms, min {min(ms):.3f} ms; "
              f"minor faults median {statistics.median(faults):.0f} (min {min(faults)}, max {max(faults)})")


if __name__ == "__main__":
    main()
