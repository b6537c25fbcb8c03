#!/usr/bin/env python3
"""Is this tree slower than a revision? DESIGN.md section 7's "no slower than before".

    python tools/bench_against.py REV [--only decode,truncate,copy_prefix] [--rounds 5]

Checks REV out into a temporary git worktree, then runs this tree's ``tools/bench.py --quick
--json --only ...`` alternately with this tree's package and REV's package on ``PYTHONPATH``
(the same harness measures both), ``--rounds`` times each, and prints for every key the median
of each side and their ratio (this tree / REV). A key whose goal is "lower is better" is slower
when its ratio is above 1. The worktree is removed at the end.

The machine is shared and noisy: alternating the two sides spreads the noise over both; read
the ratio of medians, never one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent
HIGHER_IS_BETTER = ("_ratio_vs", "copy_prefix_ratio", "save_ratio", "load_vs_limit", "prefill_vs_limit",
                    "quantize_ratio", "dequantize_ratio", "_gbps", "speedup")
KEYS = {  # what each scenario is judged by
    "decode": ["decode_ratio", "decode_us_per_token"],
    "truncate": ["truncate_step_us", "spec_step_us"],
    "copy_prefix": ["copy_prefix_ratio", "copy_prefix_gbps"],
}


def run_once(package_root: Path, only: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(package_root))
    out = subprocess.run([sys.executable, str(HERE / "bench.py"), "--quick", "--json", "--only", only],
                         capture_output=True, text=True, env=env, cwd=str(HERE), timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"bench.py failed with {package_root} first on PYTHONPATH:\n{out.stderr[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the revision to compare against (a commit, branch or tag)")
    p.add_argument("--only", default="decode,truncate,copy_prefix", help="bench.py scenarios")
    p.add_argument("--rounds", type=int, default=5, help="runs of each side (alternated)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: give at least 1")
    with tempfile.TemporaryDirectory(prefix="shmkv-against-") as tmp:
        old = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(CHECKOUT), "worktree", "add", "--detach", "-q", str(old), a.rev], check=True)
        try:
            sides: dict[str, list[dict[str, float]]] = {"this": [], a.rev: []}
            for i in range(a.rounds):
                order = [("this", CHECKOUT), (a.rev, old)]
                if i % 2:
                    order.reverse()
                for label, root in order:
                    sides[label].append(run_once(root, a.only))
                    print(f"round {i + 1}/{a.rounds}: {label} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(CHECKOUT), "worktree", "remove", "--force", str(old)], check=False)
    keys = [k for s in a.only.split(",") for k in KEYS.get(s, [])] or sorted(sides["this"][0])
    print(f"{'key':<28}{'this':>12}{a.rev[:10]:>12}{'this/rev':>10}  verdict (5% band)")
    for key in keys:
        mine = [r[key] for r in sides["this"] if key in r]
        theirs = [r[key] for r in sides[a.rev] if key in r]
        if not mine or not theirs:
            continue
        m, t = statistics.median(mine), statistics.median(theirs)
        ratio = m / t if t else float("nan")
        better_high = any(h in key for h in HIGHER_IS_BETTER)
        slower = ratio < 0.95 if better_high else ratio > 1.05
        print(f"{key:<28}{m:>12.3f}{t:>12.3f}{ratio:>10.3f}  {'SLOWER' if slower else 'ok'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
