"""A save's temporary file is the live writer's while it is written, across PID namespaces and
pid reuse (liveness is a kernel fact). A save (or gc(snapshot_dirs=)) never judges another
save's ``.NAME.tmp-PID-START-X`` by its pid: a writer in another PID namespace (pid 1 there, or
any pid that means another process here) would look dead, its temporary file would be removed
under it, and its save would fail with a raw FileNotFoundError. The writer holds a flock on its
temporary file until it is renamed into place, and only a file nobody holds is stale."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shmkv
from shmkv._snapshot import save as _save
from test_liveness import drivers  # noqa: F401  (the fixture)


def test_a_save_in_another_pid_namespace_keeps_its_temporary_file(make_store, drivers, tmp_path):  # noqa: F811
    store = make_store()
    lay = store.layout
    seq = store.create_sequence(capacity=8)
    k = np.arange(lay.layers * 3 * lay.kv_heads * lay.head_dim, dtype=np.float32)
    seq.extend(k.reshape(lay.layers, 3, lay.kv_heads, lay.head_dim), -k.reshape(lay.layers, 3, lay.kv_heads,
                                                                                  lay.head_dim), tokens=[7, 8, 9])
    seq.release()
    inner = drivers(True)
    path = str(tmp_path / "snap.shmkv")
    assert inner.ask("attach", name=store.name, readonly=True) is None
    assert inner.ask("save_paused", name=store.name, path=path) is None  # its temp file is there now
    (temp,) = [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    assert temp.startswith(".snap.shmkv.tmp-1-")  # pid 1: its own namespace's

    assert _save.remove_stale_temps(str(tmp_path)) == []  # gc(snapshot_dirs=)'s judgement
    store.save(path)  # a save of the same path here cleans stale temps first: this one is live
    assert temp in os.listdir(tmp_path)
    result = inner.ask("save_resume", name=store.name)
    assert "ok" in result, result
    fresh = shmkv.load(path, name=f"{store.name[:20]}r")
    try:
        assert [(s.length, fresh.sequence(s.id).tokens.tolist()) for s in fresh.sequences()] == [(3, [7, 8, 9])]
    finally:
        fresh.close()
    assert [f for f in os.listdir(tmp_path) if ".tmp-" in f] == []


def test_a_dead_writers_temporary_file_is_removed_whatever_its_pid(tmp_path):
    # a writer killed mid-save leaves its file unlocked; the pid in its name may be alive here
    # (our own pid below, or pid 1: a live process of this namespace) and it is still stale
    for pid in (os.getpid(), 1):
        (tmp_path / f".s.shmkv.tmp-{pid}-0-0123abcd").write_bytes(b"half a snapshot")
    assert sorted(os.path.basename(p) for p in _save.remove_stale_temps(str(tmp_path))) == [
        ".s.shmkv.tmp-1-0-0123abcd", f".s.shmkv.tmp-{os.getpid()}-0-0123abcd"]
    assert os.listdir(tmp_path) == []


def test_a_temporary_file_removed_by_hand_during_the_save_is_a_snapshot_error(make_store, tmp_path):
    store = make_store()
    store.create_sequence(capacity=4).extend(np.ones((2, 2, 2, 4)), np.ones((2, 2, 2, 4)))

    def remove_it(done: int, total: int) -> None:
        for f in os.listdir(tmp_path):
            if ".tmp-" in f:
                os.unlink(tmp_path / f)  # `rm` of a live save's file (ignoring its lock)

    with pytest.raises(shmkv.SnapshotError, match="was removed while the save ran"):
        store.save(tmp_path / "s.shmkv", progress=remove_it)  # (never a raw FileNotFoundError)
    assert os.listdir(tmp_path) == []
