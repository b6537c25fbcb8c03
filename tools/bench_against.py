#!/usr/bin/env python3
"""Is this tree slower than a revision? docs/design.md §7's "no slower than before".

    python tools/bench_against.py REV [--only decode,wait] [--rounds 5]

Checks REV out into a temporary git worktree, then runs this tree's ``tools/bench.py --quick
--json --only S`` for each scenario S (every scenario of a plain ``shmkv bench``, or the
``--only`` ones) with this tree's package and with REV's package on ``PYTHONPATH``, one right
after the other (the same harness measures both sides, so each figure is measured the same way
on both), ``--rounds`` times each, the order flipping from scenario to scenario and from round to
round. Alternating a scenario at a time, not a whole bench run, keeps the two measurements of a
figure seconds apart: on this 2-core machine a figure such as ``append_commit_us`` reads about
60 or about 95 us depending on whether another process runs on the other core meanwhile, and a
whole run (minutes) apart the two sides' medians could land in different modes. It prints, scenario
by scenario, the one sentence that states the scenario's baseline, then every key the bench
printed: the median of each side and their ratio (this tree / REV), and a verdict when the
ratio moves by more than 5% either way (a ``*_overhead`` key, a share of a throughput lost and
near 0, by its difference: more than 0.05 either way):

* ``SLOWER`` / ``faster``: a figure of shmkv's own (the direction from the bench's goal for the
  key, else from its name: throughputs, ``*_ratio`` against a baseline's time, ``speedup``
  are higher-is-better; times and the rest lower-is-better);
* ``moved``: a baseline's own figure (the pipe, numpy, redis...: the harness or the machine
  moved, not shmkv), or a key with no better direction (a count).

A key only one side printed is listed as such (a scenario that REV lacks, or that its package
cannot run: the harness says "skipped" for a scenario whose imports REV lacks). The worktree is
removed at the end. The machine is shared and noisy: alternating spreads the noise over both
sides; read the ratio of medians, never one run, and rerun a flagged key with ``--only`` and
more rounds before believing it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent
HIGHER_IS_BETTER = ("_ratio_vs", "copy_prefix_ratio", "save_ratio", "load_vs_limit", "prefill_vs_limit",
                    "quantize_ratio", "dequantize_ratio", "_gbps", "speedup", "stitched_read_ratio",
                    "remote_pull_ratio", "remote_push_ratio", "tokens_per_s", "_per_s_throughput", "_mbps")
NO_DIRECTION = ("seconds",)  # not compared (the whole run's wall time)
# A baseline's own figures that the bench's goal table (ROWS) does not name: measured beside
# shmkv's, they say how the machine or the harness moved, not shmkv
BASELINE_KEYS = {"numpy_us_per_token", "concat_us_per_token", "queue_handoff_ms", "pipe_handoff_ms",
                 "shm_file_read_ms", "copyto_gbps", "np_save_gbps", "np_load_gbps", "sendfile_limit_gbps",
                 "pwrite_limit_ms", "first_touch_ms", "pipe_wakeup_us", "noprefix_ttft_ms", "remote_get_ms",
                 "remote_set_ms", "hf_dynamic_ms", "hf_dynamic_ms_b4"}
_SCENARIO = re.compile(r"^\[(\w+)\] \([\d.]+ s\) baseline: (.*)$")
_KEY = re.compile(r"^  (\S+)\s+(-?[\d.]+(?:e[-+]?\d+)?|nan|inf)")


def run_once(package_root: Path, only: str | None) -> tuple[dict[str, float], dict[str, str], dict[str, str]]:
    """One bench run with ``package_root`` first on PYTHONPATH: its figures, each key's scenario,
    and each scenario's baseline sentence (as this tree's harness prints them)."""
    env = dict(os.environ, PYTHONPATH=str(package_root), SHMKV_BENCH_AGAINST="1")  # (see driver.main)
    cmd = [sys.executable, str(HERE / "bench.py"), "--quick", "--json", *(["--only", only] if only else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(HERE), timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"bench.py failed with {package_root} first on PYTHONPATH:\n{out.stderr[-2000:]}")
    lines = out.stdout.strip().splitlines()
    result: dict[str, float] = json.loads(lines[-1])
    scenario_of: dict[str, str] = {}
    baselines: dict[str, str] = {}
    current = ""
    for line in lines[:-1]:
        m = _SCENARIO.match(line)
        if m:
            current = m.group(1)
            baselines[current] = m.group(2)
            continue
        k = _KEY.match(line)
        if k and current:
            scenario_of[k.group(1)] = current
    return result, scenario_of, baselines


def _bench_module() -> tuple[dict[str, tuple[str, float]], set[str]]:
    """This tree's bench goals and the keys that are a baseline's own figures (ROWS' baseline
    column), or empty ones if the harness cannot be imported here."""
    sys.path.insert(0, str(HERE))
    try:
        import bench  # tools/bench.py (or its wrapper)
    except Exception:  # (a harness that needs more than this interpreter has: no directions)
        return {}, set(BASELINE_KEYS)
    goals = dict(getattr(bench, "GOALS", {}))
    rows = getattr(bench, "ROWS", [])
    base_keys = {r[3] for r in rows if len(r) > 3 and r[3]} | BASELINE_KEYS
    return goals, base_keys


def higher_is_better(key: str, goals: dict[str, tuple[str, float]]) -> bool:
    if key in goals:
        return goals[key][0].startswith(">")
    return any(h in key for h in HIGHER_IS_BETTER)


def is_fraction(key: str) -> bool:
    """A share of a throughput lost (``*_overhead``: 1 - with/without), 0 at best and near it: a
    ratio of two of them is noise over noise (-0.04 against -0.02 is "2x"), so they are compared
    by their difference, in points of that share."""
    return "overhead" in key


def verdict(key: str, ratio: float, goals: dict[str, tuple[str, float]], base_keys: set[str],
            diff: float = 0.0) -> str:
    if is_fraction(key):
        return "ok" if abs(diff) <= 0.05 else ("SLOWER" if diff > 0 else "faster")
    if math.isnan(ratio):  # a zero on REV's side
        return "?"
    if 0.95 <= ratio <= 1.05:
        return "ok"
    if key in base_keys:
        return "moved (a baseline's figure)"
    up = ratio > 1.05
    return ("faster" if up else "SLOWER") if higher_is_better(key, goals) else ("SLOWER" if up else "faster")


def scenarios(only: str | None) -> list[str]:
    """The scenarios to run: ``only``'s, else those a plain ``shmkv bench`` runs (this tree's
    harness: every scenario but the opt-in ones)."""
    if only:
        return [n for n in only.split(",") if n]
    sys.path.insert(0, str(HERE))
    import bench  # noqa: F401  # tools/bench.py: registers this checkout's harness as shmkv.cli.bench
    from shmkv.cli.bench.scenarios import OPT_IN, SCENARIOS

    return [n for n in SCENARIOS if n not in OPT_IN]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the revision to compare against (a commit, branch or tag)")
    p.add_argument("--only", default=None, help="bench.py scenarios, comma-separated (default: all of them)")
    p.add_argument("--rounds", type=int, default=5, help="runs of each side (alternated)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: give at least 1")
    scenario_of: dict[str, str] = {}
    baselines: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="shmkv-against-") as tmp:
        old = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(CHECKOUT), "worktree", "add", "--detach", "-q", str(old), a.rev], check=True)
        try:
            sides: dict[str, list[dict[str, float]]] = {"this": [], a.rev: []}
            names = scenarios(a.only)
            for i in range(a.rounds):
                got: dict[str, dict[str, float]] = {"this": {}, a.rev: {}}  # (one round's figures a side)
                for j, name in enumerate(names):
                    order = [("this", CHECKOUT), (a.rev, old)]
                    if (i + j) % 2:
                        order.reverse()
                    for label, root in order:
                        res, where, said = run_once(root, name)
                        got[label].update(res)
                        scenario_of.update(where)
                        baselines.update(said)
                    print(f"round {i + 1}/{a.rounds}: {name} done", file=sys.stderr, flush=True)
                for label, res in got.items():
                    sides[label].append(res)
        finally:
            subprocess.run(["git", "-C", str(CHECKOUT), "worktree", "remove", "--force", str(old)], check=False)
    goals, base_keys = _bench_module()
    keys = sorted({k for side in sides.values() for r in side for k in r if k not in NO_DIRECTION},
                  key=lambda k: (list(baselines).index(scenario_of[k]) if scenario_of.get(k) in baselines
                                 else len(baselines), k))
    flagged = 0
    shown = None
    for key in keys:
        scen = scenario_of.get(key, "?")
        if scen != shown:
            shown = scen
            print(f"\n[{scen}] baseline: {baselines.get(scen, '(not printed)')}")
            print(f"  {'key':<36}{'this':>12}{a.rev[:10]:>12}{'this/rev':>10}  verdict (5% band)")
        mine = [r[key] for r in sides["this"] if key in r]
        theirs = [r[key] for r in sides[a.rev] if key in r]
        if not mine or not theirs:
            print(f"  {key:<36}{'only ' + ('this' if mine else a.rev[:10]):>34}")
            continue
        m, t = statistics.median(mine), statistics.median(theirs)
        ratio = m / t if t else float("nan")
        v = verdict(key, ratio, goals, base_keys, diff=m - t)
        flagged += v not in ("ok",)
        moved = f"{m - t:>+10.3f}" if is_fraction(key) else f"{ratio:>10.3f}"
        print(f"  {key:<36}{m:>12.4g}{t:>12.4g}{moved}  {v}{' (this - rev, 0.05 band)' if is_fraction(key) else ''}")
    print(f"\n{len(keys)} keys, {flagged} moved by more than 5% (medians of {a.rounds} rounds each, the sides "
          "alternated a scenario at a time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
