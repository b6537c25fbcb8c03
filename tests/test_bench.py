"""The benchmarks (shmkv/cli/bench/), run as `shmkv bench` (the installed console script) and as
tools/bench.py.

Timings are never asserted here: the tests check that every figure is there,
that the bench reports a dead child at once, and the measurement helpers.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest


TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
NEW_KEYS = [  # the keys docs/benchmarks.md and the goals need
    "truncate_step_us", "load_vs_limit", "prefill_vs_limit", "sequences_us_per_seq",
    *(f"{k}_{n}" for k in ("create_sequence_us", "free_us", "open_sequence_us", "sequences_us_per_seq")
      for n in (16, 256, 4096)),
    "handoff_ms", "handoff_read_ms", "shm_file_read_ms", "queue_handoff_ms", "pipe_handoff_ms",
    "save_ratio", "load_ratio", "snapshotter_overhead", "snapshotter_overhead_at_cores",
    "quantize_ratio", "dequantize_ratio",
]

# the goals of the serving benchmark, which only `shmkv bench --only serve` runs
SERVE_GOALS = {"ttft_p50_ratio", "throughput_ratio", "pss_ratio", "restart_ttft_ratio", "same_tokens"}


@pytest.fixture(scope="module")
def bench_cases():
    from shmkv.cli.bench import driver, scenarios

    return scenarios, driver


def console_script() -> str:
    """The installed `shmkv` command (the path a user types), beside this interpreter."""
    path = os.path.join(os.path.dirname(sys.executable), "shmkv")
    assert os.access(path, os.X_OK), f"the console script is not installed at {path}"
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)  # (the run's own limit is 600 s: the suite's 300 s would cut a loaded run short)
def test_bench_command_quick_json_prints_every_key(bench_cases):
    cases, bench = bench_cases
    r = subprocess.run([console_script(), "bench", "--quick", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # scenarios on optional components print their keys where those are installed (always in CI)
    have = {"remote_": shutil.which("redis-server") is not None,
            "hf_": all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))}
    if os.environ.get("CI") == "true":
        assert all(have.values()), have
    missing = [k for k in (*bench.GOALS, *NEW_KEYS) if k not in res and k not in SERVE_GOALS
               and all(have[p] for p in have if k.startswith(p))]
    assert not missing
    assert all(isinstance(v, (int, float)) and not np.isnan(v) for v in res.values())
    assert ("wait_wakeup_us" in res) == cases.has_wait()  # only where the library has Sequence.wait
    for name in cases.SCENARIOS:  # each scenario names its baseline, or says why it was skipped
        if name in cases.OPT_IN:  # not in a plain run
            assert f"[{name}]" not in r.stdout
        elif cases.lacking(name):
            assert f"[{name}] skipped: " in r.stdout
        else:
            assert f"[{name}]" in r.stdout and f"baseline: {cases.BASELINES[name]}" in r.stdout
    r = subprocess.run([console_script(), "bench", "--only", "nonsense"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nonsense" in r.stderr


@pytest.mark.slow
def test_bench_runs_as_a_script():
    r = subprocess.run([sys.executable, os.path.join(TOOLS, "bench.py"), "--quick", "--json", "--only",
                        "decode,truncate"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"decode_ratio", "truncate_step_us", "spec_step_us", "append_commit_us"} <= set(res)
    assert "baseline: the same append-one-token" in r.stdout


def test_the_bench_ships_in_the_package_and_import_shmkv_does_not_load_it():
    import shmkv

    pkg = os.path.dirname(shmkv.__file__)
    assert os.path.isfile(os.path.join(pkg, "cli", "bench", "driver.py"))
    r = subprocess.run([sys.executable, "-c", "import sys, shmkv; print(sorted(m for m in sys.modules "
                        "if m.startswith('shmkv.cli')))"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_scenario_without_its_extra_is_skipped_before_any_work(monkeypatch, capsys):
    from shmkv.cli.bench import driver, scenarios

    ran: list[str] = []
    monkeypatch.setitem(scenarios.EXTRAS, "decode", (("shmkv_no_such_module",), (), "the xyz extra: pip install xyz"))
    monkeypatch.setitem(scenarios.SCENARIOS, "decode", lambda quick: ran.append("decode") or {})
    monkeypatch.setitem(scenarios.SCENARIOS, "truncate", lambda quick: ran.append("truncate") or {})
    assert driver.main(["--quick", "--only", "decode,truncate"]) == 0
    out = capsys.readouterr().out
    assert ran == ["truncate"]
    skip = [line for line in out.splitlines() if line.startswith("[decode]")]
    assert skip == ["[decode] skipped: needs the xyz extra: pip install xyz (missing: shmkv_no_such_module)"]
    assert out.index("[decode] skipped") < out.index("[truncate]")  # said first, before the work
    assert "skipped: decode" in out


def test_hf_on_a_shmkv_without_its_imports_exits_with_its_status_and_the_scenario_says_import(monkeypatch, capsys):
    """hf.py on an older shmkv (tools/bench_against.py measures older trees): its own exit status and
    the import's message on stderr; bench_hf turns that status, and only that one, into ImportError."""
    import types

    from conftest import importorskip_unless_ci

    importorskip_unless_ci("torch")
    importorskip_unless_ci("transformers")
    from shmkv.cli.bench import cases_more, hf

    monkeypatch.setitem(sys.modules, "shmkv.transformers", types.ModuleType("shmkv.transformers"))
    assert hf.main(["--quick"]) == hf.NOT_IN_THIS_SHMKV
    err = capsys.readouterr().err
    assert err.startswith("bench_hf: this shmkv cannot run it: cannot import name 'ShmkvCache'"), err
    monkeypatch.undo()

    def finished(status):
        return lambda *a, **kw: subprocess.CompletedProcess(a[0], status, "", f"bench_hf: says {status}\n")

    monkeypatch.setattr(subprocess, "run", finished(hf.NOT_IN_THIS_SHMKV))
    with pytest.raises(ImportError, match=f"says {hf.NOT_IN_THIS_SHMKV}"):
        cases_more.bench_hf(True)
    monkeypatch.setattr(subprocess, "run", finished(1))  # any other failure is the scenario's
    with pytest.raises(RuntimeError, match="says 1"):
        cases_more.bench_hf(True)


@pytest.mark.parametrize("command", ["bench", "serve"])
def test_a_plot_that_cannot_be_drawn_is_refused_before_any_work(command, tmp_path, monkeypatch, capsys):
    """--plot (shmkv bench, the serving benchmark): no matplotlib, or no directory to write in, is an
    argument error naming the path and the fix, before any scenario or worker runs."""
    from shmkv.cli.bench import driver, scenarios, serve

    ran: list[str] = []
    monkeypatch.setitem(scenarios.SCENARIOS, "decode", lambda quick: ran.append("decode") or {})
    monkeypatch.setattr(serve, "point", lambda *a: ran.append("serve") or {})

    def run(png):
        args = ["--quick", "--plot", str(png)]
        with pytest.raises(SystemExit) as e:
            driver.main([*args, "--only", "decode"]) if command == "bench" else serve.main(args)
        assert e.value.code == 2
        return capsys.readouterr().err

    real_find_spec = importlib.util.find_spec
    for spec in (object(), None):  # matplotlib there (as far as the check can tell), then not
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda n, *a, spec=spec: spec if n == "matplotlib" else real_find_spec(n, *a))
        gone = tmp_path / "no-such-dir" / "r.png"
        if spec is not None:
            assert f"no directory {str(gone.parent)!r}; create it or give another path" in run(gone)
        else:
            assert "needs matplotlib: pip install 'shmkv[plot]'" in run(tmp_path / "r.png")
    # what matplotlib would refuse or write elsewhere: no file name, a directory, no or another suffix
    assert "'' is not a file name" in run("")
    assert f"{str(tmp_path)!r} is not a file name" in run(tmp_path)
    assert "is not a file name" in run(f"{tmp_path}{os.sep}")
    assert "written as .png (or .svg" in run(tmp_path / "r.txt") and "not .txt" in run(tmp_path / "r.txt")
    assert "not without a suffix" in run(tmp_path / "r")
    assert ran == [] and list(tmp_path.iterdir()) == []


def test_the_bench_harness_takes_from_the_cli_package_only_what_older_trees_have():
    """tools/bench_against.py loads this harness (shmkv/cli/bench) over an older tree's shmkv: from the
    rest of shmkv.cli it may import only _quiet (tools/bench.py supplies it when missing) and _model."""
    import ast
    import pathlib

    import shmkv.cli.bench

    allowed = {"shmkv.cli._quiet", "shmkv.cli._model"}
    found = set()
    for path in pathlib.Path(shmkv.cli.bench.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:  # from .. import x, from ..x import y
                found |= {f"shmkv.cli.{node.module or a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shmkv.cli"):
                mod = node.module or ""
                found |= {f"{mod}.{a.name}" for a in node.names} if mod == "shmkv.cli" else {mod}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("shmkv.cli")}
    assert {m for m in found if not m.startswith("shmkv.cli.bench")} <= allowed, found


def test_the_bench_plot_draws_the_ratios_it_has(tmp_path):
    from conftest import importorskip_unless_ci

    importorskip_unless_ci("matplotlib")
    from shmkv.cli.bench import driver

    png = tmp_path / "bench.png"
    assert driver.plot({"decode_ratio": 1.4, "load_vs_limit": 0.75, "save_ratio": 1.0, "other_us": 3.0},
                       str(png)) == ["decode_ratio", "save_ratio", "load_vs_limit"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    serve = tmp_path / "serve.png"  # shmkv bench --only serve: the serving goals' ratios
    assert driver.plot({"ttft_p50_ratio": 0.1, "throughput_ratio": 2.3, "pss_ratio": 0.9, "restart_ttft_ratio": 0.4,
                        "same_tokens": 1.0}, str(serve)) == ["ttft_p50_ratio", "throughput_ratio", "pss_ratio",
                                                              "restart_ttft_ratio"]
    assert serve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert driver.plot({"other_us": 3.0}, str(tmp_path / "none.png")) == []  # nothing drawn, no empty axes
    assert not (tmp_path / "none.png").exists()


def test_a_missed_goal_says_what_it_measures_and_a_busy_machine_is_named(monkeypatch, capsys):
    from shmkv.cli.bench import driver, goals, scenarios

    monkeypatch.setitem(scenarios.SCENARIOS, "decode", lambda quick: {"decode_ratio": 99.0})
    monkeypatch.setattr(driver, "load", lambda: 10.0 * (os.cpu_count() or 1))
    assert driver.main(["--only", "decode"]) == 0
    out = capsys.readouterr().out
    assert "goal <= 1.5: MISSED" in out and goals.WHAT["decode_ratio"] in out
    assert "busy" in out and "1 goal(s) missed: decode_ratio; the machine was busy" in out
    monkeypatch.setattr(driver, "load", lambda: 0.0)
    monkeypatch.setitem(scenarios.SCENARIOS, "decode", lambda quick: {"decode_ratio": 1.0})
    assert driver.main(["--only", "decode"]) == 0
    out = capsys.readouterr().out
    assert "busy" not in out and "MISSED" not in out and "goal <= 1.5: met" in out


def test_the_serving_benchmark_runs_only_when_named(monkeypatch, capsys):
    """It takes minutes: a plain run leaves it out, --only serve runs it and checks its goals."""
    from shmkv.cli.bench import driver, goals, scenarios

    ran: list[str] = []
    for name in scenarios.SCENARIOS:
        monkeypatch.setitem(scenarios.SCENARIOS, name, lambda quick, name=name: ran.append(name) or {})
    monkeypatch.setattr(driver, "lacking", lambda name: None)
    monkeypatch.setattr(driver, "shm_refusal", lambda names, quick: None)
    assert driver.main(["--quick"]) == 0
    assert "serve" in scenarios.SCENARIOS and ran == [n for n in scenarios.SCENARIOS if n != "serve"]
    ran.clear()
    monkeypatch.setitem(scenarios.SCENARIOS, "serve", lambda quick: {"ttft_p50_ratio": 0.5, "same_tokens": 1.0})
    capsys.readouterr()
    assert driver.main(["--only", "serve"]) == 0
    out = capsys.readouterr().out
    assert f"baseline: {scenarios.BASELINES['serve']}" in out
    assert "goal <= 0.2: MISSED" in out and goals.WHAT["ttft_p50_ratio"] in out and "goal >= 1: met" in out
    assert set(goals.GOALS) >= SERVE_GOALS
    help_text = subprocess.run([sys.executable, "-m", "shmkv", "bench", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert "--only serve" in help_text and "serving benchmark" in help_text


@pytest.mark.slow
def test_bench_help_cites_no_file_outside_the_package_and_every_goal_says_what_it_measures():
    r = subprocess.run([console_script(), "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--goals" in r.stdout
    assert "DESIGN" not in r.stdout and "README" not in r.stdout and ".md" not in r.stdout
    from shmkv.cli.bench import goals

    assert set(goals.GOALS) == set(goals.WHAT)
    r = subprocess.run([console_script(), "bench", "--goals"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and all(k in r.stdout for k in goals.GOALS)


def test_alternated_rotates_the_order_and_takes_self_timed_results():
    from shmkv.cli.bench.timing import alternated
    calls: list[str] = []
    own = iter([0.3, 0.1, 0.2, 0.5, 0.4])

    def a() -> float:
        calls.append("a")
        return next(own)

    def b() -> None:
        calls.append("b")

    t = alternated({"a": a, "b": b}, 5)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert t["a"] == 0.3 and 0 <= t["b"] < 0.1


def test_touch_reads_every_byte():
    from shmkv.cli.bench.timing import touch
    for n in (0, 7, 8, 4097):  # with and without a tail after the last whole word
        a = np.zeros(n, np.uint8)
        assert touch(a) == 0
        if n:
            a[-1] = 5  # only the last byte set: found whether it is in a word or the tail
            assert touch(a) != 0
    k = np.zeros((3, 4, 8), np.float16)
    k[2, 3, 7] = 1.0
    assert touch(k) != 0


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.slow
def test_bench_fails_fast_naming_a_killed_child():
    """A killed hand-off child ends the bench at once, with an error naming it: the bench never
    waits on its queue for a result that will not come."""
    p = subprocess.Popen([console_script(), "bench", "--quick", "--only", "handoff"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    killed: set[int] = set()
    try:
        t_end = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < t_end:
            for c in _children_of(p.pid):
                try:
                    with open(f"/proc/{c}/cmdline", "rb") as f:
                        cmd = f.read()
                except FileNotFoundError:
                    continue
                # only the bench's own children: a spawned child runs spawn_main (the resource tracker
                # does not; nor does a child between fork and exec, whose cmdline is still the bench's)
                if b"spawn_main" in cmd and c not in killed:
                    os.kill(c, signal.SIGKILL)
                    killed.add(c)
            time.sleep(0.005)
        # every child is killed as soon as it shows: the first one that had not yet answered ends the bench
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert killed
    assert p.returncode != 0
    assert "exited with code -9 before sending its result" in err, err[-2000:]


def _bench_against():
    spec = importlib.util.spec_from_file_location("bench_against", os.path.join(TOOLS, "bench_against.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_against_calls_a_key_slower_only_when_its_pairs_agree():
    ba = _bench_against()
    goals, base = {"decode_ratio": ("<=", 1.5)}, {"pipe_wakeup_us"}
    assert ba.chance(5, 5) == 1 / 32 and ba.chance(0, 5) == 1.0
    assert ba.judge("decode_us_per_token", [(1.2, 1.0)] * 5, goals, base) == ("SLOWER", False)
    assert ba.judge("decode_us_per_token", [(1.02, 1.0)] * 5, goals, base) == ("ok", False)
    # out of the band by its medians, 3 of 5 pairs slower: undecided, worth more rounds
    assert ba.judge("decode_us_per_token", [(1.2, 1.0)] * 3 + [(0.9, 1.0)] * 2, goals, base) == \
        ("SLOWER? (3 of 5 pairs slower)", True)
    # higher is better by the goal's direction or by name; a faster? is not worth more rounds
    assert ba.judge("decode_ratio", [(1.2, 1.0)] * 5, goals, base) == ("SLOWER", False)
    assert ba.judge("tokens_per_s_1w", [(1.2, 1.0)] * 5, goals, base) == ("faster", False)
    assert ba.judge("tokens_per_s_1w", [(1.2, 1.0)] * 3 + [(0.9, 1.0)] * 2, goals, base)[1] is False
    assert ba.judge("pipe_wakeup_us", [(2.0, 1.0)] * 5, goals, base) == ("moved (a baseline's figure)", False)
    # a share lost: by its difference
    assert ba.judge("snapshotter_overhead", [(0.04, 0.0)] * 5, goals, base) == ("ok", False)
    assert ba.judge("snapshotter_overhead", [(0.2, 0.0)] * 5, goals, base) == ("SLOWER", False)


def test_bench_against_runs_an_undecided_scenario_again_until_its_pairs_decide(monkeypatch, capsys, tmp_path):
    ba = _bench_against()
    monkeypatch.setattr(ba, "_bench_module", lambda: ({}, set()))
    old = {}

    def run_once(root, name):
        side = "this" if root == ba.CHECKOUT else "rev"
        if side == "rev":
            old["root"] = root
        n = calls[name, side] = calls.get((name, side), 0) + 1
        # decode: this side slower in 3 of the first 5 pairs, then in every pair; wait: REV's
        # side noisy, slower and faster by turns, its median out of the band; table: equal
        if name == "decode":
            fig = 1.3 if side == "this" and (n > 5 or n % 5 in (1, 2, 3)) else 1.0
        elif name == "wait":
            fig = 1.3 if side == "this" else (1.0 if n % 2 else 1.4)
        else:
            fig = 1.0
        return {f"{name}_us": fig}, {f"{name}_us": name}, {name: f"the {name} baseline"}

    calls: dict = {}
    monkeypatch.setattr(ba, "run_once", run_once)
    assert ba.main(["HEAD", "--only", "decode,wait,table", "--rounds", "5", "--confirm", "6"]) == 0
    out = capsys.readouterr().out
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and "_us" in ln}
    # decode: decided by its 11th pair (9 of 11 slower: chance 0.033), so not run a 12th time
    assert line["decode_us"].split()[-1] == "SLOWER" and calls["decode", "rev"] == 11
    assert "SLOWER? (6 of 11 pairs slower)" in line["wait_us"] and calls["wait", "this"] == 11  # the cap
    assert line["table_us"].split()[-1] == "ok" and calls["table", "this"] == 5  # never run again
    assert not os.path.exists(old["root"])  # the worktree is removed
