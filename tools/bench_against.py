#!/usr/bin/env python3
"""Is this tree slower than a revision? docs/design.md §7's "no slower than before".

    python tools/bench_against.py REV [--only decode,wait] [--rounds 5] [--confirm 10]

Checks REV out into a temporary git worktree, then runs this tree's ``tools/bench.py --quick
--json --only S`` for each scenario S (every scenario of a plain ``shmkv bench``, or the
``--only`` ones) with this tree's package and with REV's package on ``PYTHONPATH``, one right
after the other (the same harness measures both sides, so each figure is measured the same way
on both), ``--rounds`` times each, the order flipping from scenario to scenario and from round to
round. The two measurements of a figure in a round are seconds apart, a pair: on this shared
2-core machine one figure can move by a third between runs minutes apart (``append_commit_us``
read about 60 in some runs and about 95 us in others, for the same tree), and pairs keep such a
drift off the comparison.

It prints, scenario by scenario, the one sentence that states the scenario's baseline, then
every key the bench printed: the median of each side, their ratio (this tree / REV), and a
verdict when the ratio of medians moves by more than 5% either way (a ``*_overhead`` key, a
share of a throughput lost and near 0, by its difference: more than 0.05 either way):

* ``SLOWER`` / ``faster``: a figure of shmkv's own (the direction from the bench's goal for the
  key, else from its name: throughputs, ``*_ratio`` against a baseline's time, ``speedup``
  are higher-is-better; times and the rest lower-is-better) that moved in the same direction
  in so many of the pairs that chance would do it less than one time in 20 (a sign test: 5 of
  5 pairs, 9 of 10, 12 of 15);
* ``SLOWER?`` / ``faster?``: out of the band, but the pairs disagree (say 3 of 5 slower): the
  run cannot tell the move from the noise. Each scenario with such a ``SLOWER?`` key is run
  again, a pair a round, until each of its keys is decided or ``--confirm`` more rounds have
  run (the verdict then says how many of how many pairs were slower);
* ``moved``: a baseline's own figure (the pipe, numpy, redis...: the harness or the machine
  moved, not shmkv), or a key with no better direction (a count).

Why not the band alone: this tree against itself (``HEAD``, 3 rounds, a quiet machine) moved 35
of 99 keys by more than 5% (``prefix_ttft_ms`` 1.31, ``handoff_speedup_vs_queue`` 0.78): the
spread of 3 medians is wider than 5% for a third of the figures here.

A key only one side printed is listed as such (a scenario that REV lacks, or that its package
cannot run: the harness says "skipped" for a scenario whose imports REV lacks). The worktree is
removed at the end.
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


def _harness() -> object | None:
    """This tree's ``tools/bench.py`` (which registers this checkout's harness as shmkv.cli.bench),
    or None if this interpreter cannot import it."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    try:
        import bench  # tools/bench.py (or its wrapper)
    except Exception:  # (a harness that needs more than this interpreter has: no directions)
        return None
    return bench


def _bench_module() -> tuple[dict[str, tuple[str, float]], set[str]]:
    """This tree's bench goals and the keys that are a baseline's own figures (ROWS' baseline
    column), or empty ones if the harness cannot be imported here."""
    bench = _harness()
    if bench is None:
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


def chance(k: int, n: int) -> float:
    """The chance that ``k`` or more of ``n`` pairs move one way when each way is as likely."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def judge(key: str, pairs: list[tuple[float, float]], goals: dict[str, tuple[str, float]],
          base_keys: set[str]) -> tuple[str, bool]:
    """The verdict on a key from its pairs (this tree's figure, REV's, measured in one round) and
    whether more pairs could decide it (a ``SLOWER?``: out of the band, the pairs disagreeing)."""
    m = statistics.median(p[0] for p in pairs)
    t = statistics.median(p[1] for p in pairs)
    if is_fraction(key):
        moved, up, ups = abs(m - t) > 0.05, m > t, [a > b for a, b in pairs]
        worse_if_up = True  # (a larger share lost)
    else:
        if not t:  # a zero on REV's side
            return "?", False
        ratio = m / t
        moved, up, ups = not 0.95 <= ratio <= 1.05, ratio > 1, [a > b for a, b in pairs]
        worse_if_up = not higher_is_better(key, goals)
    if not moved:
        return "ok", False
    if key in base_keys and not is_fraction(key):
        return "moved (a baseline's figure)", False
    slower = up == worse_if_up
    word = "SLOWER" if slower else "faster"
    k, n = sum(u == up for u in ups), len(ups)
    if chance(k, n) <= 0.05:
        return word, False
    return f"{word}? ({k} of {n} pairs {word.lower()})", slower


def scenarios(only: str | None) -> list[str]:
    """The scenarios to run: ``only``'s, else those a plain ``shmkv bench`` runs (this tree's
    harness: every scenario but the opt-in ones)."""
    if only:
        return [n for n in only.split(",") if n]
    if _harness() is None:
        raise SystemExit("tools/bench.py cannot be imported here: name the scenarios with --only")
    from shmkv.cli.bench.scenarios import OPT_IN, SCENARIOS

    return [n for n in SCENARIOS if n not in OPT_IN]


class Rounds:
    """Both sides' figures, a round at a time: ``pairs(key)`` are the two sides' figures of a key
    from the rounds in which both printed it."""

    def __init__(self, rev: str, old: Path) -> None:
        self.rev, self.roots = rev, {"this": CHECKOUT, rev: old}
        self.rounds: list[dict[str, dict[str, float]]] = []
        self.scenario_of: dict[str, str] = {}
        self.baselines: dict[str, str] = {}

    def run(self, names: list[str], label: str) -> None:
        """One round of ``names``, the order of the sides flipping from scenario to scenario and
        from round to round."""
        i = len(self.rounds)
        got: dict[str, dict[str, float]] = {"this": {}, self.rev: {}}
        for j, name in enumerate(names):
            order = ["this", self.rev] if (i + j) % 2 == 0 else [self.rev, "this"]
            for side in order:
                res, where, said = run_once(self.roots[side], name)
                got[side].update(res)
                self.scenario_of.update(where)
                self.baselines.update(said)
            print(f"{label}: {name} done", file=sys.stderr, flush=True)
        self.rounds.append(got)

    def all_keys(self) -> list[str]:
        order = list(self.baselines)
        found = {k for r in self.rounds for side in r.values() for k in side if k not in NO_DIRECTION}
        return sorted(found, key=lambda k: (order.index(self.scenario_of[k]) if self.scenario_of.get(k) in order
                                            else len(order), k))

    def pairs(self, key: str) -> list[tuple[float, float]]:
        return [(r["this"][key], r[self.rev][key]) for r in self.rounds if key in r["this"] and key in r[self.rev]]

    def only_on(self, key: str) -> str:
        return "this" if any(key in r["this"] for r in self.rounds) else self.rev


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the revision to compare against (a commit, branch or tag)")
    p.add_argument("--only", default=None, help="bench.py scenarios, comma-separated (default: all of them)")
    p.add_argument("--rounds", type=int, default=5, help="runs of each side (alternated)")
    p.add_argument("--confirm", type=int, default=10,
                   help="at most this many more rounds of a scenario with a SLOWER? key (0: none)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: give at least 1")
    if a.confirm < 0:
        p.error(f"--confirm {a.confirm}: give 0 or more")
    goals, base_keys = _bench_module()
    with tempfile.TemporaryDirectory(prefix="shmkv-against-") as tmp:
        old = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(CHECKOUT), "worktree", "add", "--detach", "-q", str(old), a.rev], check=True)
        try:
            r = Rounds(a.rev, old)
            names = scenarios(a.only)
            for i in range(a.rounds):
                r.run(names, f"round {i + 1}/{a.rounds}")
            for extra in range(a.confirm):
                unsure = sorted({r.scenario_of[k] for k in r.all_keys() if k in r.scenario_of and r.pairs(k)
                                and judge(k, r.pairs(k), goals, base_keys)[1]}, key=names.index)
                if not unsure:
                    break
                r.run(unsure, f"confirming {','.join(unsure)} ({extra + 1}/{a.confirm})")
        finally:
            subprocess.run(["git", "-C", str(CHECKOUT), "worktree", "remove", "--force", str(old)], check=False)
    verdicts: dict[str, int] = {}
    shown = None
    keys = r.all_keys()
    for key in keys:
        scen = r.scenario_of.get(key, "?")
        if scen != shown:
            shown = scen
            print(f"\n[{scen}] baseline: {r.baselines.get(scen, '(not printed)')}")
            print(f"  {'key':<36}{'this':>12}{a.rev[:10]:>12}{'this/rev':>10}{'pairs':>6}  verdict (5% band)")
        pairs = r.pairs(key)
        if not pairs:
            print(f"  {key:<36}{'only ' + r.only_on(key)[:10]:>34}")
            continue
        m, t = statistics.median(x for x, _ in pairs), statistics.median(y for _, y in pairs)
        v, _ = judge(key, pairs, goals, base_keys)
        verdicts[v.split(" ")[0]] = verdicts.get(v.split(" ")[0], 0) + 1
        moved = f"{m - t:>+10.3f}" if is_fraction(key) else (f"{m / t:>10.3f}" if t else f"{'-':>10}")
        print(f"  {key:<36}{m:>12.4g}{t:>12.4g}{moved}{len(pairs):>6}  {v}"
              f"{' (this - rev, 0.05 band)' if is_fraction(key) else ''}")
    print(f"\n{len(keys)} keys, medians of paired rounds ({a.rounds} each, more for a scenario with a SLOWER? key): "
          + ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
