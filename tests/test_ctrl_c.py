"""Ctrl-C as a user meets it: in their own code with shmkv imported and a store attached, inside
``asyncio.run``, and in ``shmkv demo`` at any moment (one line on stderr, no traceback, nothing
left in /dev/shm)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shmkv.testing import shm_entries

SHMKV = os.path.join(os.path.dirname(sys.executable), "shmkv")  # the installed console script a user types

# A user's program: a store with a sequence (shmkv's lock taken and given up many times),
# then a loop of its own; "ready" once it spins there.
USER = textwrap.dedent("""
    import sys
    import numpy as np
    import shmkv
    from shmkv.testing import unique_name

    store = shmkv.create(unique_name("cc"), layers=2, kv_heads=1, head_dim=4, dtype="float32", max_tokens=64)
    print(store.name, flush=True)
    seq = store.create_sequence(capacity=8)
    seq.extend(np.ones((2, 3, 1, 4), np.float32), np.ones((2, 3, 1, 4), np.float32))
    seq.truncate(1)

    def users_own_loop():
        print("ready", flush=True)
        n = 0
        while True:
            n += 1
""")


def _run_until_ready(script: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    lines = []
    while not lines or lines[-1] != "ready":  # (the suite's timeout ends a child that hangs)
        line = p.stdout.readline()
        assert line, f"the child died: {p.communicate(timeout=30)}"
        lines.append(line.strip())
    return p, lines[0]


def _interrupt(p: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        p.send_signal(signal.SIGINT)
        return p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_ctrl_c_in_the_users_own_code_ends_its_traceback_there():
    p, name = _run_until_ready(USER + "try:\n    users_own_loop()\nfinally:\n    store.close()\n")
    _, err = _interrupt(p)
    assert "KeyboardInterrupt" in err, err
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', err)
    assert frames and frames[-1] == ("<string>", "users_own_loop"), err  # not shmkv's SIGINT handler
    assert "shmkv" not in "".join(f for f, _ in frames), err
    assert not [f for f in shm_entries() if f.startswith(f"skv_{name}.")]


def test_asyncio_run_handles_ctrl_c_as_without_shmkv():
    """asyncio.run installs its own SIGINT handler only over Python's default one: with shmkv
    imported and a store used before and inside it, Ctrl-C still cancels the main task, which
    can clean up, and asyncio.run then raises KeyboardInterrupt."""
    script = USER + textwrap.dedent("""
        import asyncio, os, signal, traceback

        async def main():
            s = store.create_sequence(capacity=4)  # the lock taken and given up inside asyncio.run
            s.free()
            handler = signal.getsignal(signal.SIGINT)  # asyncio.run's own (a partial of Runner._on_sigint)
            assert getattr(handler, "func", handler).__qualname__ == "Runner._on_sigint", handler
            print("ready", flush=True)
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                print("main task cancelled", flush=True)
                raise

        try:
            asyncio.run(main())
        except KeyboardInterrupt as e:  # raised by asyncio.run itself once the main task ended
            print("KeyboardInterrupt from", os.path.basename(traceback.extract_tb(e.__traceback__)[-1].filename))
        finally:
            store.close()
    """)
    p, name = _run_until_ready(script)
    out, err = _interrupt(p)
    assert p.returncode == 0, err
    assert out.splitlines() == ["main task cancelled", "KeyboardInterrupt from runners.py"], (out, err)
    assert not [f for f in shm_entries() if f.startswith(f"skv_{name}.")]


def _shmkv_command() -> list[str]:
    """The `shmkv` console script, as pip generates it from pyproject.toml (through _shmkv_entry,
    which keeps a Ctrl-C during the imports to one line); where the installed script is older
    than that, the same call made with this interpreter."""
    with open(SHMKV) as f:
        if "_shmkv_entry" in f.read():
            return [SHMKV]
    return [sys.executable, "-c", "import sys; from _shmkv_entry import main; sys.exit(main())"]


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.5, 1, 2, 3, 5])
def test_ctrl_c_at_any_moment_of_the_demo_prints_one_line(after, tmp_path):
    """`timeout -s INT T shmkv demo`: at most 3 lines on stderr, no traceback (the demo's children
    included), nothing of the demo's left in /dev/shm or in the temporary directory."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run(["timeout", "-s", "INT", str(after), *_shmkv_command(), "demo"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) <= 3, r.stderr
    assert r.returncode in (0, 124), (r.returncode, r.stderr)  # finished, or interrupted (timeout's 124)
    name = re.search(r"starting store '(\w+)'", r.stdout)  # (none yet: interrupted before the store)
    if name:
        assert not [f for f in shm_entries() if f.startswith(f"skv_{name[1]}.")], r.stdout
    assert os.listdir(tmp_path) == [], r.stdout  # the snapshot in the temporary directory went too


EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").glob("*.py")
                  if not p.name.startswith("_") and p.name != "toymodel.py")


@pytest.mark.slow
@pytest.mark.parametrize("after", [1, 4])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_ctrl_c_in_an_example_prints_one_line(path, after, tmp_path):
    """A Ctrl-C ``after`` seconds into `python examples/X.py` (a SIGINT to the process, then to its
    process group, as `timeout -s INT` and a terminal send it): importing, starting its processes or
    working, it ends with one line on stderr (its processes print nothing) and leaves no store
    behind (its own: named after its pid; other tests may run the same example meanwhile)."""
    if path.name == "transformers_workers.py":
        pytest.importorskip("torch")
    before = shm_entries()
    p = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    try:
        try:
            out, err = p.communicate(timeout=after)
        except subprocess.TimeoutExpired:
            for send in (os.kill, os.killpg):  # (the group: its processes too, as the terminal's)
                try:
                    send(p.pid, signal.SIGINT)
                except ProcessLookupError:  # (it ended just now)
                    pass
            out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert "Traceback" not in err and len(err.splitlines()) <= 1, err
    # finished, interrupted (130), or ended by the SIGINT itself with nothing printed: one that
    # lands before Python installs its handler at start-up (-2; a shell shows 130 for it too)
    assert p.returncode in (0, 130) or (p.returncode == -signal.SIGINT and not err), (p.returncode, err)
    # its stores (named after its pid, with its own prefixes): none left
    prefixes = "|".join(re.findall(r'f"([a-z]+)\{os.getpid\(\)\}"', path.read_text()))
    assert prefixes, path.name
    left = [f for f in shm_entries() - before if re.fullmatch(rf"skv_({prefixes}){p.pid}\.\w+", f)]
    assert not left, (left, p.returncode, err, out[-1500:])  # (how far it got: its last lines)
    assert os.listdir(tmp_path) == []


_BENCH_CTRL_C = """
import sys
import multiprocessing.process
import multiprocessing.queues
from shmkv.cli import main

if sys.argv[1] in ("queue", "twice"):  # right after the 128 MiB payload is handed to the Queue's feeder thread
    put = multiprocessing.queues.Queue.put

    def put_then_ctrl_c(self, obj, *args, **kwargs):
        put(self, obj, *args, **kwargs)
        if isinstance(obj, list):
            raise KeyboardInterrupt

    multiprocessing.queues.Queue.put = put_then_ctrl_c
    if sys.argv[1] == "twice":  # and a second Ctrl-C as the scenario's cleanup begins
        import shmkv.cli.bench.cases as cases

        def ctrl_c(procs):
            raise KeyboardInterrupt

        cases.kill = ctrl_c
else:  # right after the first receiver started, before the scenario lists it
    start = multiprocessing.process.BaseProcess.start

    def start_then_ctrl_c(self):
        start(self)
        multiprocessing.process.BaseProcess.start = start
        raise KeyboardInterrupt

    multiprocessing.process.BaseProcess.start = start_then_ctrl_c
sys.exit(main(["bench", "--quick", "--only", "handoff"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["queue", "twice", "start"])
def test_a_ctrl_c_in_the_bench_between_a_child_and_its_cleanup_still_exits(where):
    """The bench exits at a Ctrl-C however its children stand: a child started but not yet in its
    scenario's list, a Queue's feeder thread still sending to a receiver that is killed, or a
    second Ctrl-C that cuts the scenario's cleanup short (``timeout -s INT`` sends two)."""
    p = subprocess.Popen([sys.executable, "-c", _BENCH_CTRL_C, where], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"the bench did not exit after a Ctrl-C ({where})")
    finally:
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"shmkv-bench-{p.pid}-")]
        for f in left:  # (what a failed run left: the machine stays clean)
            os.unlink(os.path.join("/dev/shm", f))
    assert p.returncode == 130 and err.strip() == "shmkv bench: interrupted", (p.returncode, err)
    assert not left, left


@pytest.mark.slow
def test_ctrl_c_in_the_bench_prints_one_line():
    """A Ctrl-C 8 s into the bench (to its whole process group, as a terminal sends it): one line at
    most on stderr, and none of its scratch files left (named after its pid: another bench running
    on the machine keeps its own)."""
    p = subprocess.Popen([*_shmkv_command(), "bench", "--quick", "--only", "handoff"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        try:
            _, err = p.communicate(timeout=8)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)
            _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"shmkv-bench-{p.pid}-")]
        for f in left:  # (what a failed run left: the machine stays clean)
            os.unlink(os.path.join("/dev/shm", f))
    assert "Traceback" not in err and len(err.splitlines()) <= 1, err
    assert not left, left
