"""Liveness by kernel-released locks: across PID namespaces and fork (docs/design.md §3).

Containers that share /dev/shm but not a PID namespace (Docker ``--ipc=host``, a Kubernetes
pod without a shared process namespace) see meaningless pids of each other. Liveness is a
kernel lock (the liveness file's bytes), so a writer under ``unshare -p -f --mount-proc`` is
alive for ``clients()``, ``shmkv ls``, gc and lease take-over from outside, the same holds the
other way round, and a killed one is dead at once (no polling: its byte is free when it is reaped).

Needs root (or user namespaces) and util-linux's ``unshare``; skipped without them, except under
CI=true, where it must run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmkv
from shmkv import cli
from shmkv._engine.locking import lifecycle_lock as _lifecycle_lock
from shmkv.store import _lifecycle
from shmkv.testing import unique_name

CHILD = str(Path(__file__).parent / "procs" / "liveness.py")
IN_CI = os.environ.get("CI", "").lower() == "true"


class Driver:
    """A tests/procs/liveness.py process (optionally in its own PID namespace), asked line by line."""

    def __init__(self, namespaced: bool) -> None:
        cmd = [sys.executable, CHILD]
        if namespaced:
            cmd = ["unshare", "-p", "-f", "--kill-child", "--mount-proc", *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.namespaced = namespaced

    def ask(self, op: str, timeout: float = 60.0, **kw: Any) -> Any:
        """The answer's value; an error answer comes back as ("error", class name)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"child gave no answer to {op!r} within {timeout} s: {err[-2000:]}")
        answer = json.loads(line)
        return ("error", answer["error"]) if "error" in answer else answer["ok"]

    def python_pid(self) -> int:
        """The driven Python's pid in our namespace (unshare's forked child when namespaced)."""
        if not self.namespaced:
            return self.proc.pid
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/status") as f:
                        status = f.read()
                except OSError:
                    continue
                if f"\nPPid:\t{self.proc.pid}\n" in status:
                    return int(entry)
            time.sleep(0.01)
        raise AssertionError("unshare's child not found")

    def kill(self) -> None:
        """SIGKILL the driven Python and reap it (unshare reaps its child before it exits)."""
        os.kill(self.python_pid(), signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def _namespaced_driver() -> Driver:
    if shutil.which("unshare") is None:
        if IN_CI:
            pytest.fail("unshare (util-linux) is missing; CI must run the PID-namespace tests")
        pytest.skip("unshare (util-linux) is missing")
    d = Driver(namespaced=True)
    try:
        pid = d.ask("pid", timeout=30)
    except AssertionError as e:
        d.stop()
        if IN_CI:
            raise
        pytest.skip(f"cannot make a PID namespace here (root or user namespaces needed): {e}")
    assert pid == 1  # the first process of its own PID namespace: our pids mean nothing to it
    return d


@pytest.fixture
def drivers():
    made: list[Driver] = []

    def make(namespaced: bool) -> Driver:
        d = _namespaced_driver() if namespaced else Driver(namespaced=False)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


def _ls(name: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["ls", "--json"])
    return next(r for r in json.loads(out.getvalue()) if r["name"] == name)


def _collect(name: str) -> bool:
    """gc's judgement of one store (a test never runs a global gc)."""
    with _lifecycle_lock.lifecycle(name):
        return _lifecycle._collect(name, include_persistent=False, grace=30.0)


def _remove_quietly(name: str) -> None:
    with contextlib.suppress(shmkv.StoreNotFound):
        shmkv.remove(name)


def test_writer_in_its_own_pid_namespace_is_alive_outside_and_dead_once_killed(make_store, drivers):
    store = make_store()
    a = store.create_sequence(capacity=8)
    a.extend(np.ones((store.layout.layers, 2, store.layout.kv_heads, store.layout.head_dim)),
             np.ones((store.layout.layers, 2, store.layout.kv_heads, store.layout.head_dim)))
    a.release()
    inner = drivers(True)
    own = unique_name()  # a store the namespaced writer creates
    try:
        assert inner.ask("attach", name=store.name) is None
        assert inner.ask("lease", name=store.name, id=a.id) is None
        assert inner.ask("create", name=own) is None

        assert len(store.clients()) == 2  # the writer is alive for clients()
        assert [(s.id, s.lease_alive) for s in store.sequences()] == [(a.id, True)]
        with pytest.raises(shmkv.LeaseError):  # ... and for lease take-over: no second writer
            store.sequence(a.id, write=True)
        line = _ls(own)  # ... and for `shmkv ls`
        assert line["creator_alive"] and not line["gc_removes"] and len(line["live_clients"]) == 1
        assert len(_ls(store.name)["live_clients"]) == 2
        assert not _collect(own) and own in shmkv.list_stores()  # ... and for gc
        mine = shmkv.attach(own)  # a read-write attach from here leaves its client row alone
        assert len(mine.clients()) == 2 and len(inner.ask("clients", name=own)) == 2
        mine.close()

        inner.kill()
        # dead at once: its bytes were released when the kernel closed its descriptors
        assert store.clients() == [os.getpid()]
        assert [(s.id, s.lease_alive) for s in store.sequences()] == [(a.id, False)]
        taken = store.sequence(a.id, write=True)
        assert taken.length == 2
        line = _ls(own)
        assert not line["creator_alive"] and line["gc_removes"] and line["live_clients"] == []
        assert _collect(own) and own not in shmkv.list_stores()
    finally:
        _remove_quietly(own)


def test_writer_outside_is_alive_inside_a_pid_namespace_and_dead_once_killed(drivers):
    outer = drivers(False)  # a writer in our namespace, killable
    inner = drivers(True)
    name = unique_name()
    try:
        assert outer.ask("create", name=name) is None
        b = outer.ask("new_seq", name=name)
        assert inner.ask("attach", name=name) is None

        assert len(inner.ask("clients", name=name)) == 2
        assert inner.ask("sequences", name=name) == [[b, True]]
        assert inner.ask("lease", name=name, id=b) == ("error", "LeaseError")
        line = inner.ask("ls", name=name)
        assert line["creator_alive"] and not line["gc_removes"] and len(line["live_clients"]) == 2
        assert inner.ask("collect", name=name) is False

        outer.kill()
        assert len(inner.ask("clients", name=name)) == 1
        assert inner.ask("sequences", name=name) == [[b, False]]
        assert inner.ask("lease", name=name, id=b) is None  # taken over from the dead writer
        line = inner.ask("ls", name=name)
        assert not line["creator_alive"] and len(line["live_clients"]) == 1 and not line["gc_removes"]
        assert inner.ask("close", name=name) is None
        assert inner.ask("collect", name=name) is True  # nobody alive keeps it: gc removes it
        assert not inner.ask("exists", name=name)
    finally:
        _remove_quietly(name)


def _hold_a_new_lease(store: shmkv.Store, go_path: str) -> int:
    """In a forked child: a lease through the inherited handle (its own client slot), then wait."""
    seq = store.create_sequence(capacity=4)
    deadline = time.monotonic() + 60
    while not os.path.exists(go_path) and time.monotonic() < deadline:
        time.sleep(0.005)
    return seq.id


def test_forked_child_takes_a_slot_of_its_own(make_store, tmp_path):
    from shmkv.testing import start_in_process

    store = make_store()
    child = start_in_process(_hold_a_new_lease, store, str(tmp_path / "go"), start_method="fork", timeout=60)
    try:
        deadline = time.monotonic() + 60
        while not store.sequences() and time.monotonic() < deadline:
            time.sleep(0.005)
        (info,) = store.sequences()
        assert info.lease_pid == child.pid and info.lease_alive
        assert sorted(store.clients()) == sorted([os.getpid(), child.pid])
        with pytest.raises(shmkv.LeaseError):
            store.sequence(info.id, write=True)
    finally:
        child.kill()
    # the child's slot died with it; the parent's (shared descriptor until the fork) did not
    assert store.clients() == [os.getpid()]
    assert [s.lease_alive for s in store.sequences()] == [False]
    store.sequence(info.id, write=True).release()


def test_forked_child_does_not_keep_a_dead_parent_alive(make_store, drivers):
    store = make_store()
    a = store.create_sequence(capacity=4)
    a.release()
    parent = drivers(False)
    assert parent.ask("attach", name=store.name) is None
    assert parent.ask("lease", name=store.name, id=a.id) is None
    sleeper = parent.ask("fork_sleeper")  # holds copies of the parent's descriptors... dropped at fork
    try:
        assert len(store.clients()) == 2
        parent.kill()
        assert store.clients() == [os.getpid()]
        store.sequence(a.id, write=True).release()  # the dead parent's lease is taken over
    finally:
        os.kill(sleeper, signal.SIGKILL)


_HOLD_AND_EXIT = """
import os, sys, threading
import shmkv
store = shmkv.attach(sys.argv[1])
made = threading.Event()

def worker():  # a daemon thread's frame: never unwound, so the handle is never dropped
    seq = store.create_sequence(capacity=8)  # a live write handle, never released
    print(seq.id, flush=True)
    made.set()
    threading.Event().wait()

threading.Thread(target=worker, daemon=True).start()
made.wait(60)
if sys.argv[2] == "hard":
    os._exit(0)  # no interpreter exit: nothing of this process runs after
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["normal", "hard"])
def test_an_interpreter_that_exits_holding_a_write_handle_gives_its_lease_back(make_store, how):
    """A program that ends normally with a write handle it never released (held by a daemon
    thread, so never dropped) gives the lease back at exit (the row shows no holder, not a dead
    one); one that ends without its interpreter's exit
    (os._exit) leaves its pid there, for the liveness file to tell that the holder is dead."""
    store = make_store(layers=1, kv_heads=1, head_dim=4, dtype="float32", max_tokens=64, max_seqs=4)
    r = subprocess.run([sys.executable, "-c", _HOLD_AND_EXIT, store.name, how], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seq_id = int(r.stdout.split()[0])
    info = [s for s in store.sequences() if s.id == seq_id]
    assert len(info) == 1
    if how == "normal":
        assert info[0].lease_pid == 0
    else:
        assert info[0].lease_pid != 0 and not info[0].lease_alive
    store.sequence(seq_id, write=True).release()  # either way another process takes it
