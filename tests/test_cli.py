"""The command line and the demo (issue 6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _cli_children import own_store

import shmkv
from shmkv import cli, demo
from shmkv.testing import shm_entries, start_in_process, unique_name


def shmkv_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmkv", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def live_store(tmp_path):
    """A store owned and written by another process."""
    name = unique_name()
    ready = tmp_path / "ready"
    child = start_in_process(own_store, name, str(ready), 30.0, start_method="spawn", timeout=90)
    t_end = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < t_end
        time.sleep(0.01)
    yield name
    child.kill(signal.SIGTERM)
    try:
        shmkv.remove(name)
    except shmkv.StoreNotFound:
        pass


def test_demo_equals_single_process_run(tmp_path):
    lines: list[str] = []
    summary = demo.run(workers=2, new_tokens=6, prompts=demo.PROMPTS[:3], snapshot=str(tmp_path / "d.shmkv"),
                       out=lines.append)
    assert summary["ok"] is True
    assert any("equal to a single-process run without shmkv: yes" in x for x in lines)
    assert (tmp_path / "d.shmkv").exists()
    head = shmkv.read_header(tmp_path / "d.shmkv")
    assert head.layout.layers == 4
    assert summary["store"] not in shmkv.list_stores()


def test_demo_command_and_interrupt(tmp_path):
    before = shm_entries()
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, "-m", "shmkv", "demo", "--tokens", "3000", "--snapshot",
                          str(tmp_path / "i.shmkv")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         start_new_session=True)
    t_end = time.monotonic() + 60
    while not (shm_entries() - before) and time.monotonic() < t_end:
        time.sleep(0.05)  # wait until the demo's store exists
    time.sleep(1.0)  # workers are decoding now (3000 tokens each: far from done)
    os.killpg(p.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    try:
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, err  # it was interrupted, not finished
    assert b"interrupted" in err
    time.sleep(0.2)
    assert shm_entries() - before == set()


def test_inspection_commands_on_a_live_store(live_store, tmp_path):
    name = live_store
    store = shmkv.attach(name, readonly=True)
    try:
        gen0 = store.stats().generation
        clients0 = store.clients()
        r = shmkv_cmd("ls", "--json")
        assert r.returncode == 0 and name in [row["name"] for row in json.loads(r.stdout)]
        r = shmkv_cmd("info", name, "--json")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["sequences"][0]["first_tokens"][:5] == [10, 11, 12, 13, 14]
        assert info["sequences"][0]["lease_alive"] is True
        r = shmkv_cmd("info", name)
        assert "first tokens" in r.stdout
        r = shmkv_cmd("watch", name, "--count", "2", "--interval", "0.1", "--json")
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
        r = shmkv_cmd("verify", name)
        assert r.returncode == 0 and "ok" in r.stdout
        # inspectors never write: no structural change, no client registered
        assert store.stats().generation == gen0
        assert store.clients() == clients0
        snap = tmp_path / "live.shmkv"
        r = shmkv_cmd("save", name, str(snap))
        assert r.returncode == 0, r.stderr
        other = unique_name()
        r = shmkv_cmd("load", str(snap), "--name", other)
        assert r.returncode == 0, r.stderr
        try:
            loaded = shmkv.attach(other, readonly=True)
            assert loaded.sequences()[0].length >= 5
            loaded.close()
        finally:
            assert shmkv_cmd("rm", other).returncode == 0
        out = tmp_path / "snaps"
        r = shmkv_cmd("snapshot", name, "--dir", str(out), "--every", "0.05", "--keep", "2", "--count", "4")
        assert r.returncode == 0, r.stderr
        assert len(r.stdout.splitlines()) == 4 and len(os.listdir(out)) == 2
    finally:
        store.close()


def test_snapshotter_stops_on_sigterm(live_store, tmp_path):
    out = tmp_path / "snaps"
    p = subprocess.Popen([sys.executable, "-m", "shmkv", "snapshot", live_store, "--dir", str(out),
                          "--every", "0.2", "--keep", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t_end = time.monotonic() + 30
    while not (out.exists() and os.listdir(out)):
        assert time.monotonic() < t_end
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 0, stderr
    assert "stopping" in stderr
    files = sorted(os.listdir(out))
    assert 1 <= len(files) <= 3 and all(f.endswith(".shmkv") for f in files)
    for f in files:  # every file kept is a complete snapshot
        assert shmkv.read_header(out / f).seq_ids


def test_errors_and_usage():
    missing = unique_name("nope")
    r = shmkv_cmd("info", missing)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no store named" in r.stderr
    assert shmkv_cmd("info").returncode == 2
    assert shmkv_cmd("frobnicate").returncode == 2
    assert shmkv_cmd("rm", missing).returncode == 1


def test_verify_finds_problems(make_store):
    store = make_store()
    a = store.create_sequence(capacity=8)
    b = store.create_sequence(capacity=8)
    assert cli.verify(store) == []
    a._row[shmkv._header.CAPACITY] = 20  # damage: a now overlaps b
    problems = cli.verify(store)
    assert any("sequence 1 and sequence 2 overlap" in p for p in problems), problems
    a._row[shmkv._header.CAPACITY] = 8
    b._row[shmkv._header.LENGTH] = 99
    assert any("outside capacity" in p for p in cli.verify(store))
    b._row[shmkv._header.LENGTH] = 0
    # regression: the range check once read `not 0 <= start and ...` and never fired
    b._row[shmkv._header.START] = store.layout.max_tokens - 4
    assert any("outside max_tokens" in p for p in cli.verify(store))
    b._row[shmkv._header.START] = 8
    # an encoder cache is a row of its own (state 2) with a range of its own: not a problem
    a.set_encoder(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)))
    assert cli.verify(store) == []
    r = shmkv_cmd("verify", store.name, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
