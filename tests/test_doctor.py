"""``shmkv doctor`` / ``shmkv.doctor()``, and the room checks of ``shmkv demo`` and
``shmkv bench``, on this machine's /dev/shm and in private ones of 64 MiB and less
(a mount namespace with its own tmpfs, as Docker's default /dev/shm), and in a
second PID namespace."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import shmkv
from shmkv._engine.clients import liveness as _liveness
from shmkv.store import _doctor
from shmkv.testing import unique_name
from _namespaces import PY, available, in_private_shm

ROOT = pathlib.Path(__file__).parent.parent
MiB = 1 << 20

KEYS = {"ok", "problems", "notes", "system", "machine", "supported_platform", "python", "numpy", "shmkv",
        "shm_path", "shm_fs", "shm_size", "shm_free", "shm_writable", "layout", "bytes_per_token", "tokens_fit",
        "max_map_count", "maps_in_use", "stores_mappable", "pid_namespace", "initial_pid_namespace",
        "proc_matches_pid_namespace", "cross_namespace_liveness", "extras"}
EXTRAS = {"torch", "transformers", "ml_dtypes", "redis", "isal", "numba"}

needs_unshare = pytest.mark.skipif(available() is not None, reason=str(available()))


def doctor_json(*args: str, size: str | None = None, pid_ns: bool = False) -> tuple[int, dict, str]:
    cmd = [PY, "-m", "shmkv", "doctor", "--json", *args]
    if size is None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    else:
        r = in_private_shm(cmd, size, pid_ns=pid_ns, timeout=120)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout), r.stderr


@pytest.mark.slow
def test_doctor_here():
    code, d, _ = doctor_json()
    assert code == 0 and d["ok"] and d["problems"] == []
    assert set(d) == KEYS and set(d["extras"]) == EXTRAS
    size, _ = _doctor.shm_space()
    assert d["shm_size"] == size and d["shm_fs"] == "tmpfs" and d["shm_writable"]
    assert d["machine"] == os.uname().machine and d["supported_platform"]
    assert d["python"] == ".".join(map(str, sys.version_info[:3])) and d["numpy"] == np.__version__
    assert d["layout"] == {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
    assert d["bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert d["tokens_fit"] == d["shm_free"] // d["bytes_per_token"]
    assert d["max_map_count"] == int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    from shmkv._engine.spans.stitch import CACHE_LIMIT  # what is left once a full cache of stitched views is mapped

    assert d["stores_mappable"] == (d["max_map_count"] - d["maps_in_use"] - 2 * CACHE_LIMIT) // _doctor.MAPS_PER_STORE
    assert d["proc_matches_pid_namespace"] is True
    assert d["pid_namespace"] == os.readlink("/proc/self/ns/pid")
    for name, e in d["extras"].items():  # what the doctor says about each extra is what importing finds
        r = subprocess.run([PY, "-c", f"import {name}"], capture_output=True, timeout=120)
        assert e["installed"] == (r.returncode == 0), (name, e)
        assert e["pip"].startswith("pip install")
    # the human form says the same, and exits the same
    r = subprocess.run([PY, "-m", "shmkv", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok: shmkv can run here" in r.stdout and "bfloat16" in r.stdout


def test_doctor_function_matches_the_command():
    d = shmkv.doctor(layers=4, kv_heads=2, head_dim=8, dtype="float16")
    assert isinstance(d, shmkv.Doctor) and d.ok and d.shmkv == shmkv.__version__
    assert d.bytes_per_token == 2 * 4 * 2 * 8 * 2
    q = shmkv.doctor(layers=4, kv_heads=2, head_dim=8, dtype="int8")
    assert q.bytes_per_token == 2 * 4 * 2 * 8 + 2 * 4 * 2 * 4  # codes and one float32 scale per (token, head)
    _, j, _ = doctor_json("--layers", "4", "--kv-heads", "2", "--head-dim", "8", "--dtype", "float16")
    as_dict = d.as_dict()
    for key in KEYS - {"shm_free", "tokens_fit", "maps_in_use", "stores_mappable"}:  # those move between calls
        assert as_dict[key] == j[key], key
    with pytest.raises(dataclass_frozen_error()):
        d.ok = False  # type: ignore[misc]
    with pytest.raises(shmkv.InvalidArgumentError, match="layers=0"):
        shmkv.doctor(layers=0)


def dataclass_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.slow
def test_doctor_tokens_that_do_not_fit_exit_1():
    too_many = 2 * _doctor.shm_space()[0] // 256  # twice all of /dev/shm: never fits, whatever others free
    code, d, _ = doctor_json("--layers", "4", "--kv-heads", "2", "--head-dim", "8", "--dtype", "float16",
                             "--tokens", str(too_many))
    assert code == 1 and not d["ok"]
    assert f"{too_many} tokens of this layout" in d["problems"][0] and "--shm-size=" in d["problems"][0]
    code, d, _ = doctor_json("--tokens", "1")
    assert code == 0 and d["ok"]


def test_maps_per_store():
    """MAPS_PER_STORE, behind doctor's stores_mappable, is what an attach maps (counted among the
    mappings of the store's files: the process may map a heap arena meanwhile)."""
    name = unique_name("maps")

    def maps() -> int:
        return sum(f"/skv_{name}." in line for line in pathlib.Path("/proc/self/maps").read_text().splitlines())

    with shmkv.create(name, layers=2, kv_heads=2, head_dim=4) as store:
        store.create_sequence(capacity=8).extend(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)))
        first = shmkv.attach(name, readonly=True)  # pays the one-time mappings (libraries)
        before = maps()
        ro, rw = shmkv.attach(name, readonly=True), shmkv.attach(name)
        ro.sequences(), rw.sequences()
        assert maps() - before == 2 * _doctor.MAPS_PER_STORE
        for s in (first, ro, rw):
            s.close()


@pytest.mark.slow
@needs_unshare
def test_doctor_in_docker_default_64mib_shm():
    code, d, _ = doctor_json(size="64m")
    assert code == 0 and d["ok"], d["problems"]
    assert set(d) == KEYS
    assert d["shm_size"] == 64 * MiB and d["shm_free"] == 64 * MiB
    assert d["tokens_fit"] == 64 * MiB // (128 * 1024) == 512
    assert any("Docker's default" in n and "--shm-size=1g" in n for n in d["notes"]), d["notes"]
    # 1024 tokens of the default layout are 128 MiB: they do not fit, and the fix is named
    code, d, _ = doctor_json("--tokens", "1024", size="64m")
    assert code == 1 and not d["ok"]
    assert "128 MiB" in d["problems"][0] and "--shm-size=256m" in d["problems"][0]
    r = in_private_shm([PY, "-m", "shmkv", "doctor", "--tokens", "1024"], "64m")
    assert r.returncode == 1 and "PROBLEM: 1024 tokens" in r.stdout and "cannot run here" in r.stdout


@needs_unshare
def test_doctor_in_a_tiny_shm_exit_1():
    code, d, _ = doctor_json(size="2m")
    assert code == 1 and not d["ok"]
    assert "too little for any store" in d["problems"][0] and "--shm-size=256m" in d["problems"][0]


@needs_unshare
def test_doctor_in_a_second_pid_namespace():
    code, d, _ = doctor_json(size="64m", pid_ns=True)
    assert code == 0 and d["proc_matches_pid_namespace"] is True
    assert d["initial_pid_namespace"] is False and d["pid_namespace"] != os.readlink("/proc/self/ns/pid")
    if not d["cross_namespace_liveness"]:
        assert any("PID namespace of its own" in n for n in d["notes"])
    # without a /proc of its own, pid-based liveness would read the wrong processes: exit 1
    r = subprocess.run(["unshare", "-p", "-f", PY, "-m", "shmkv", "doctor", "--json"], capture_output=True,
                       text=True, timeout=120)
    d = json.loads(r.stdout)
    assert d["proc_matches_pid_namespace"] is False
    if d["cross_namespace_liveness"]:  # stores do not read /proc: a note, not a problem
        assert r.returncode == 0 and any("/proc belongs to another PID namespace" in n for n in d["notes"])
    else:
        assert r.returncode == 1 and "/proc belongs to another PID namespace" in d["problems"][0]


CHILD = """
import sys, numpy as np, shmkv
store = shmkv.create(sys.argv[1], layers=1, kv_heads=1, head_dim=4)
seq = store.create_sequence(capacity=8)   # this process holds the lease
seq.extend(np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))
print(seq.id, flush=True)
sys.stdin.readline()                      # until the test has looked
store.close()
"""


@needs_unshare
def test_cross_namespace_liveness_is_what_doctor_says():
    """A live lease holder in a second PID namespace sharing /dev/shm (Docker --ipc=host
    without --pid=host) is seen alive from here exactly when doctor says liveness crosses
    namespaces."""
    name = unique_name("pidns")
    p = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", PY, "-c", CHILD, name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # the child's ready signal (a pipe: no sleep)
        assert line.strip(), "the child did not start"
        with shmkv.attach(name, readonly=True) as store:
            (info,) = store.sequences()
            assert info.id == int(line)
            assert info.lease_alive is _liveness.CROSS_NAMESPACE_LIVENESS
            assert shmkv.doctor().cross_namespace_liveness is _liveness.CROSS_NAMESPACE_LIVENESS
    finally:
        try:
            _, err = p.communicate("\n", timeout=60)  # let it go; reaped, pipes closed
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
            if name in shmkv.list_stores():  # the child's close removes it; if it died first, we do
                shmkv.remove(name)
    assert p.returncode == 0, err


@needs_unshare
def test_demo_refuses_up_front_in_a_tiny_shm():
    r = in_private_shm([PY, "-m", "shmkv", "demo"], "4m", timeout=120)
    assert r.returncode == 1
    assert "the demo's store needs 5 MiB free in /dev/shm" in r.stderr and "--shm-size=256m" in r.stderr
    assert "Traceback" not in r.stderr and "starting store" not in r.stdout


@needs_unshare
def test_bench_refuses_up_front_in_docker_default_shm():
    r = in_private_shm([PY, "-m", "shmkv", "bench", "--quick", "--only", "handoff,decode"], "64m", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "(its largest scenario, handoff) needs 272 MiB free in /dev/shm" in r.stderr  # 2 x 128 MiB + margin
    assert "it has 64 MiB free of 64 MiB" in r.stderr and "docker run --shm-size=512m" in r.stderr
    assert "--only decode" in r.stderr  # what fits
    assert "Traceback" not in r.stderr and "CacheFullError" not in r.stderr
    assert "machine:" not in r.stdout  # refused before the first scenario
