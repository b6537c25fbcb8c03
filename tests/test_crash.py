"""Crash safety: a process SIGKILLed inside any structural operation leaves the store
exactly as before or after it, for the next process that takes the lock.

Every named crash point (shmkv._engine.locking.crash.POINTS) is hit by a child process with SHMKV_CRASH_AT set;
the test then checks, from this process: the logical content equals the state before the
operation or the state after it (the same operation run here without a crash), every cell's K/V
is that of its token id, generations are even, `shmkv verify` is clean, leases can be taken over,
and append/commit/extend/save work. A random-kill stress kills a writer doing mixed operations.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from procs.crash import LAYOUT, base, fill, layout_for, op, prepare, state, stress

import shmkv
from shmkv._engine.locking import crash as _crash
from shmkv._engine.table import header as _header
from shmkv import cli
from shmkv.testing import start_in_process

HERE = os.path.dirname(__file__)


def _store_for(make_store, point: str) -> shmkv.Store:
    return make_store(**layout_for(point))


def _check_usable(store: shmkv.Store, tmp_path) -> None:
    gens = store._engine.table_np[:, _header.GEN]
    assert not (gens & 1).any(), gens
    assert cli.verify(store) == []
    for info in store.sequences():
        s = store.sequence(info.id, write=True)  # lease take-over works (the dead writer's too)
        last = int(s.tokens[-1]) + 1 if len(s) else 9000
        fill(s, [last, last + 1])
        s.release()
    fresh = store.create_sequence(capacity=8)
    fill(fresh, [1, 2, 3])
    ids = [i.id for i in store.sequences()]
    assert len(ids) == len(set(ids))
    store.save(tmp_path / "after.shmkv")
    state(store)  # every cell still the K/V of its token id


@pytest.mark.slow
@pytest.mark.parametrize("point", _crash.POINTS)
def test_killed_at_every_crash_point(make_store, tmp_path, point):
    snap = str(tmp_path / "snap.shmkv")
    # the state after the operation: the same operation, here, without a crash
    ref = _store_for(make_store, point)
    ids = base(ref)
    prepare(ref, point, ids)
    ref.save(snap) if point.startswith("restore") else None
    if point.startswith("restore"):  # restore brings back what the snapshot had: change things first
        ref.sequence(ids["b"], write=True).truncate(3)
        ref.sequence(ids["c"], write=True).free()
    before_ref = state(ref)
    start = {i.id: i.start for i in ref.sequences()} if point.startswith("grow") else {}
    op(ref, point, ids, snap)
    after = state(ref)
    if point.startswith("grow"):  # the growth took the path the point names
        moved = {i.id: i.start for i in ref.sequences()}
        grown = ids["c"] if point in ("grow.extended", "grow.slid") else ids["n"]
        assert {"grow.extended": moved[grown] == start[grown], "grow.slid": moved[grown] < start[grown]}.get(
            point, moved[grown] > start[grown]), (point, start[grown], moved[grown])
    assert after != before_ref or point.startswith("lease")  # a lease changes no content

    store = _store_for(make_store, point)
    assert base(store) == ids
    prepare(store, point, ids)
    if point.startswith("restore"):
        store.sequence(ids["b"], write=True).truncate(3)
        store.sequence(ids["c"], write=True).free()
    before = state(store)
    assert before == before_ref
    env = {**os.environ, "SHMKV_CRASH_AT": point, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, os.path.join(HERE, "procs", "crash.py"), store.name, point,
                        json.dumps(ids), snap], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, f"{point} was not reached: exit {r.returncode}\n{r.stderr[-3000:]}"
    with store.transaction():  # the next lock holder recovers
        pass
    got = state(store)
    if point.startswith("compact"):
        # the scenario commits token by token (each commit complete) until one compacts the
        # window: B holds before's tokens plus some of the new ones, all intact (state() checked)
        assert [g[:1] for g in got] == [a[:1] for a in after]
        b_got, b_after = next(g for g in got if g[0] == ids["b"]), next(a for a in after if a[0] == ids["b"])
        assert b_after[1][: len(b_got[1])] == b_got[1] and len(b_got[1]) < len(b_after[1])
    else:
        assert got in (before, after), f"{point}: neither before nor after"
    _check_usable(store, tmp_path)


def test_every_structural_operation_has_a_crash_point():
    ops = {"create", "free", "truncate", "grow", "copy_prefix", "fork", "remove", "shift_left", "compact",
           "set_encoder", "restore", "lease", "finish", "share", "rewind"}
    assert ops == {p.split(".")[0] for p in _crash.POINTS}
    pkg = pathlib.Path(shmkv.__file__).parent  # the package: points sit in every subpackage
    src = "".join(f.read_text() for f in pkg.rglob("*.py"))
    for p in _crash.POINTS:  # each named point is placed in the code
        assert f'_crash.point("{p}")' in src, p


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["plain", "shared"])
def test_random_kills_of_a_writer_doing_mixed_operations(make_store, layout):
    """``shared``: cells of 1 KiB (a page unit of 4 cells), so that reuses of the writer's shared
    prompts borrow pages, and its truncates, removes, shift_lefts, forks and frees un-share them."""
    kills = int(os.environ.get("SHMKV_CRASH_KILLS", "60"))
    store = make_store(**dict(LAYOUT if layout == "plain" else layout_for("share"), max_tokens=1024, max_seqs=24))
    shared = 0
    rng = np.random.default_rng(int(os.environ.get("SHMKV_CRASH_SEED", "11")))
    print(f"seed {os.environ.get('SHMKV_CRASH_SEED', '11')}, {kills} kills")
    recovered = 0
    # no lock: the child is SIGKILLed at any instruction, also inside ``done.value += 1``, and a
    # lock it held then would stay taken for the next round's ``done.value = 0``
    done = multiprocessing.get_context("fork").Value("l", 0, lock=False)
    for i in range(kills):
        done.value = 0
        child = start_in_process(stress, store.name, i, done, start_method="fork", timeout=60)
        # the kill lands a random time into its operations, counted from the first (not from the
        # fork: on a loaded machine a child may not have started any within a fixed time)
        t_end = time.monotonic() + 60
        while done.value < 2 and child.process.is_alive() and time.monotonic() < t_end:
            time.sleep(0.001)
        time.sleep(float(rng.uniform(0.002, 0.06)))
        shared = max(shared, store.stats().shared_tokens)
        child.kill(signal.SIGKILL)
        with store.transaction():  # the next lock holder recovers
            pass
        gens = store._engine.table_np[:, _header.GEN]
        assert not (gens & 1).any(), f"kill {i}: odd generation"
        assert cli.verify(store) == [], f"kill {i}"
        state(store)  # zero corrupted committed tokens: every cell holds its token's K/V
        ids = [s.id for s in store.sequences()]
        assert len(ids) == len(set(ids))
        recovered = int(store._engine.hdr[_header.W_RECOVERIES])
        shared = max(shared, store.stats().shared_tokens)
    print(f"{recovered} recoveries in {kills} kills, at most {shared} tokens shared")
    assert (shared > 0) == (layout == "shared")
    s = store.create_sequence(capacity=4)
    fill(s, [1, 2])
    assert recovered > 0  # some kills landed inside structural operations


@pytest.mark.slow
@pytest.mark.parametrize("lock_timeout", [30.0, 0.01])
def test_reader_on_a_read_only_attachment_through_long_structural_operations(make_store, lock_timeout):
    from procs.crash import copier, reader

    n = 16384  # 64 MiB a copy: long enough that reads land inside copies
    store = make_store(layers=2, kv_heads=8, head_dim=64, dtype="float32", max_tokens=4 * n + 64, max_seqs=4)
    ids = []
    for base_tok in (10_000, 50_000):
        s = store.create_sequence(capacity=n)
        t = np.arange(base_tok, base_tok + n)
        k = np.broadcast_to((t * 4).astype(np.float32)[None, :, None, None], (2, n, 8, 64))
        s.extend(k, -k, tokens=t)
        s.release()
        ids.append(s.id)
    dst = store.create_sequence(capacity=n)
    dst.release()
    store.copy_prefix(ids[0], dst.id, n)
    w = start_in_process(copier, store.name, ids[0], ids[1], dst.id, n, rounds=12, start_method="spawn", timeout=300)
    r = start_in_process(reader, store.name, dst.id, lock_timeout, 3.0, start_method="spawn", timeout=300)
    got = r.result()
    print(lock_timeout, got)
    assert w.result() == 12
    assert got["reads"] > 0
    if lock_timeout >= 1:
        assert got["timeouts"] == 0  # only LockTimeout may fail a read, and only when the timeout is short


@pytest.mark.slow
def test_verify_reports_a_dead_operation_and_repair_rolls_it_back(make_store, tmp_path):
    store = make_store(**LAYOUT)
    ids = base(store)
    env = {**os.environ, "SHMKV_CRASH_AT": "remove.copied",
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, os.path.join(HERE, "procs", "crash.py"), store.name, "remove.copied",
                        json.dumps(ids), str(tmp_path / "x")], env=env, capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL
    shmkv_bin = os.path.join(os.path.dirname(sys.executable), "shmkv")
    r = subprocess.run([shmkv_bin, "verify", store.name], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "left 1 row(s) to roll back" in r.stdout and "odd" in r.stdout
    r = subprocess.run([shmkv_bin, "verify", "--repair", store.name], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(store._engine.hdr[_header.W_RECOVERIES]) == 1
    state(store)
