"""The shipped pytest plugin, exercised on sample test files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import importorskip_unless_ci

import shmkv
from shmkv._engine.table import header as _header
from shmkv.testing import unique_name

SAMPLE = '''
import os, time
import numpy as np
import pytest
import shmkv

def write(store, n):
    seq = store.create_sequence(capacity=4)
    seq.extend(np.ones((2, n, 2, 4)), np.ones((2, n, 2, 4)))
    seq.release()
    return seq.id

def explode(store):
    raise ValueError("boom in the child 4242")

def die(store):
    os.kill(os.getpid(), 9)

def hang(store):
    time.sleep(600)

@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_pass(shmkv_store, shmkv_child, method):
    seq_id = shmkv_child.run(write, shmkv_store, 3, start_method=method)
    assert shmkv_store.sequence(seq_id).length == 3

@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_child_raises(shmkv_store, shmkv_child, method):
    shmkv_child.run(explode, shmkv_store, start_method=method)

@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_child_killed(shmkv_store, shmkv_child, method):
    shmkv_child.run(die, shmkv_store, start_method=method)

@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_child_hangs(shmkv_store, shmkv_child, method):
    shmkv_child.run(hang, shmkv_store, start_method=method, timeout=2)

def test_factory(shmkv_store_factory):
    a = shmkv_store_factory(dtype="int8", layers=3)
    b = shmkv_store_factory()
    assert a.layout.layers == 3 and a.name != b.name
'''

LEAKY = '''
import pytest
import shmkv

def test_leaks():
    store = shmkv.create("{a}", layers=1, kv_heads=1, head_dim=2, persistent=True)
    store.close()

@pytest.mark.shmkv_allow_leak
def test_leaks_allowed():
    store = shmkv.create("{b}", layers=1, kv_heads=1, head_dim=2, persistent=True)
    store.close()

def test_clean():
    store = shmkv.create("{c}", layers=1, kv_heads=1, head_dim=2)
    store.close()
'''


def _session_stores() -> set[str]:
    """Names of the stores in /dev/shm that carry this session's tag (made by its process tree)."""
    tag = int(os.environ["SHMKV_PYTEST_SESSION"], 16) & ((1 << 62) - 1)
    out = set()
    for name in shmkv.list_stores():
        try:
            words = np.fromfile(f"/dev/shm/skv_{name}.h", np.int64, 64)
        except OSError:
            continue
        if words.size == 64 and words[_header.W_SESSION] == tag:
            out.add(name)
    return out


def run_sample(pytester, leak_check: bool = True, **files: str):
    """Run a sample test file in a pytest subprocess (it inherits our session tag); return its
    result and the stores of this session it left in /dev/shm (other programs' are ignored)."""
    before = _session_stores()
    if leak_check:
        pytester.makeini("[pytest]\nshmkv_leak_check = true\n")
    pytester.makepyfile(**files)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    return result, _session_stores() - before


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fixtures_and_child_outcomes(pytester):
    result, left = run_sample(pytester, test_sample=SAMPLE)
    result.assert_outcomes(passed=4, failed=9)
    out = result.stdout.str()
    assert out.count("ValueError: boom in the child 4242") >= 3  # the child's error and traceback
    assert "Traceback in child" in out
    assert out.count("killed by signal 9") >= 3
    assert out.count("did not finish within 2") >= 3
    assert "left shmkv stores behind" not in out
    assert left == set()


@pytest.mark.slow
def test_leak_check_names_the_leak(pytester):
    a, b, c = unique_name("leaky"), unique_name("allow"), unique_name("clean")
    result, left = run_sample(pytester, test_leaky=LEAKY.format(a=a, b=b, c=c))
    result.assert_outcomes(passed=3, errors=1)
    out = result.stdout.str()
    assert f"left shmkv stores behind: ['{a}']" in out
    assert b not in out  # opted out
    assert left == {b}  # the check removed what it found, except the test that opted out
    shmkv.remove(b)


@pytest.mark.slow
def test_plugin_can_be_disabled(pytester):
    pytester.makepyfile(test_off="def test_x(shmkv_store):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:shmkv", "-q")
    result.assert_outcomes(errors=1)
    assert "fixture 'shmkv_store' not found" in result.stdout.str()


@pytest.mark.slow
def test_leak_check_is_opt_in(pytester):
    """Another project's suite (no ini option, no marker) gets the fixtures but no leak check."""
    a, b, c = unique_name("leaky"), unique_name("allow"), unique_name("clean")
    marked = ("\nimport pytest\nimport shmkv\n\n@pytest.mark.shmkv_leak_check\ndef test_marked():\n"
              f"    shmkv.create('{c}x', layers=1, kv_heads=1, head_dim=2, persistent=True).close()\n")
    try:
        result, _ = run_sample(pytester, leak_check=False, test_leaky=LEAKY.format(a=a, b=b, c=c),
                               test_marked=marked)
        result.assert_outcomes(passed=4, errors=1)  # only the marked test is checked
        out = result.stdout.str()
        assert f"left shmkv stores behind: ['{c}x']" in out and a not in out
        assert os.path.exists(f"/dev/shm/skv_{a}.h")  # unchecked: left alone
    finally:
        for name in (a, b):
            shmkv.remove(name)


WAITER = '''
import os, time

def test_runs_while_another_program_creates_stores():
    open(os.environ["SHMKV_T_STARTED"], "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["SHMKV_T_GO"]):
        assert time.monotonic() < deadline, "the outer test never said go"
        time.sleep(0.01)
'''

# "another program": a process outside the test session (no SHMKV_PYTEST_SESSION).
OTHER_PROGRAM = '''
import sys, numpy as np, shmkv
name, persistent, ready = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
store = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=16, max_seqs=2, persistent=persistent)
seq = store.create_sequence(capacity=4)
seq.extend(np.full((1, 3, 1, 2), 7.0), np.full((1, 3, 1, 2), 8.0), tokens=[7, 8, 9])
seq.release()
open(ready, "w").close()
if not persistent:
    sys.stdin.read()  # alive until the outer test closes our stdin
'''


def _wait_for(path, what, proc=None, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc is None or proc.poll() is None, f"{what}: the process died"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_leak_check_never_touches_another_programs_stores(pytester, tmp_path, monkeypatch):
    """While a plugin-enabled suite runs a test, another program creates a
    store it keeps using and a persistent one it leaves behind; both survive, the suite passes."""
    started, go = tmp_path / "started", tmp_path / "go"
    monkeypatch.setenv("SHMKV_T_STARTED", str(started))
    monkeypatch.setenv("SHMKV_T_GO", str(go))
    pytester.makeini("[pytest]\nshmkv_leak_check = true\n")
    pytester.makepyfile(test_waiter=WAITER)
    outcome = {}

    def run():
        outcome["result"] = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=200)

    suite = threading.Thread(target=run)
    suite.start()
    live_name, left_name = unique_name("live"), unique_name("left")
    env = {k: v for k, v in os.environ.items() if k != "SHMKV_PYTEST_SESSION"}
    live = None
    try:
        _wait_for(started, "the suite's test start")
        live = subprocess.Popen([sys.executable, "-c", OTHER_PROGRAM, live_name, "0", str(tmp_path / "r1")],
                                stdin=subprocess.PIPE, env=env)
        _wait_for(tmp_path / "r1", "the live store's creation", live)
        subprocess.run([sys.executable, "-c", OTHER_PROGRAM, left_name, "1", str(tmp_path / "r2")],
                       env=env, check=True, timeout=120)
        go.touch()
        suite.join(220)
        assert not suite.is_alive()
        outcome["result"].assert_outcomes(passed=1)
        assert "left shmkv" not in outcome["result"].stdout.str()
        for name in (live_name, left_name):  # both still there, content intact
            with shmkv.attach(name, readonly=True) as s:
                assert s.sequence(s.sequences()[0].id).tokens.tolist() == [7, 8, 9]
    finally:
        go.touch()
        suite.join(220)
        if live is not None:
            live.stdin.close()
            live.wait(60)
        try:
            shmkv.remove(left_name)
        except shmkv.StoreNotFound:
            pass
    assert not os.path.exists(f"/dev/shm/skv_{live_name}.h")  # its creator removed it at exit


SESSION_CHILD = '''
import shmkv

def make(store, name):
    shmkv.create(name, layers=1, kv_heads=1, head_dim=2, persistent=True).close()

def test_child_leaks(shmkv_store, shmkv_child):
    shmkv_child.run(make, shmkv_store, "{name}", start_method="{method}")
'''


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_leak_by_a_dead_child_of_the_test_is_judged(pytester, method):
    """A store that a (now dead) child of the test created is the test's leak: named and removed."""
    name = unique_name("kid")
    result, left = run_sample(pytester, test_child=SESSION_CHILD.format(name=name, method=method))
    result.assert_outcomes(passed=1, errors=1)
    assert f"left shmkv stores behind: ['{name}']" in result.stdout.str()
    assert left == set()


XDIST_WAIT = '''
import os, time
import shmkv

def wait_for(path):
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "never came: " + path
        time.sleep(0.01)

def make(store, name):
    shmkv.create(name, layers=1, kv_heads=1, head_dim=2, persistent=True).close()
'''

XDIST_A = XDIST_WAIT + '''
def test_a(shmkv_store, shmkv_child):
    shmkv_child.run(make, shmkv_store, "{name}", start_method="fork")  # made by a child, now dead
    open("{made}", "w").close()
    wait_for("{checked}")  # the other worker's test ended while it existed, and was checked
    shmkv.remove("{name}")  # still there: this test cleans up after itself
'''

XDIST_B = XDIST_WAIT + '''
def test_b_runs_meanwhile():
    wait_for("{made}")

def test_b_after():
    open("{checked}", "w").close()

def test_b_last():  # (an xdist worker runs a test once it has the next one, or is told to stop)
    pass
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_xdist_a_worker_never_judges_another_workers_store(pytester, tmp_path):
    """Under pytest-xdist, a store that one worker's test made through a child that died is not a
    leak of the test another worker runs meanwhile: that worker's leak check leaves it alone."""
    importorskip_unless_ci("xdist")  # (in the dev extra: CI has it)
    name = unique_name("xdist")
    paths = dict(name=name, made=tmp_path / "made", checked=tmp_path / "checked")
    pytester.makeini("[pytest]\nshmkv_leak_check = true\n")
    pytester.makepyfile(test_a=XDIST_A.format(**paths), test_b=XDIST_B.format(**paths))
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-n", "2", "--dist", "loadfile",
                                               timeout=200)
        result.assert_outcomes(passed=4)
        assert "left shmkv stores behind" not in result.stdout.str()
    finally:
        try:
            shmkv.remove(name)
        except shmkv.StoreNotFound:
            pass
