"""The shipped pytest plugin, exercised on sample test files (issue 8)."""

from __future__ import annotations

import pytest

from shmkv.testing import shm_entries

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
    store = shmkv.create("leakyxyz42", layers=1, kv_heads=1, head_dim=2, persistent=True)
    store.close()

@pytest.mark.shmkv_allow_leak
def test_leaks_allowed():
    store = shmkv.create("leakyxyz43", layers=1, kv_heads=1, head_dim=2, persistent=True)
    store.close()

def test_clean():
    store = shmkv.create("cleanxyz44", layers=1, kv_heads=1, head_dim=2)
    store.close()
'''


def run_sample(pytester, **files: str):
    """Run a sample test file in a pytest subprocess; return its result and what it left in /dev/shm."""
    before = shm_entries()
    pytester.makepyfile(**files)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    return result, shm_entries() - before


@pytest.mark.timeout(240)
def test_fixtures_and_child_outcomes(pytester):
    result, left = run_sample(pytester, test_sample=SAMPLE)
    result.assert_outcomes(passed=4, failed=9)
    out = result.stdout.str()
    assert out.count("ValueError: boom in the child 4242") >= 3  # the child's error and traceback
    assert "Traceback in child" in out
    assert out.count("killed by signal 9") >= 3
    assert out.count("did not finish within 2") >= 3
    assert "left shmkv shared memory" not in out
    assert left == set()


def test_leak_check_names_the_leak(pytester):
    result, left = run_sample(pytester, test_leaky=LEAKY)
    result.assert_outcomes(passed=3, errors=1)
    out = result.stdout.str()
    assert "left shmkv shared memory behind" in out and "skv_leakyxyz42.d" in out and "skv_leakyxyz42.h" in out
    assert left == set()  # the check removed what it found


def test_plugin_can_be_disabled(pytester):
    pytester.makepyfile(test_off="def test_x(shmkv_store):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:shmkv", "-q")
    result.assert_outcomes(errors=1)
    assert "fixture 'shmkv_store' not found" in result.stdout.str()
