"""docs/containers.md's claims, on namespaces this machine makes with unshare/nsenter
(as Docker does): a private 64 MiB /dev/shm (Docker's default) fills with a
CacheFullError that names the fix, never a SIGBUS; a second process that joins
the first one's /dev/shm (``--ipc=container:NAME``) attaches its store; the
machine's own /dev/shm never sees it."""

from __future__ import annotations

import subprocess

import pytest

import shmkv
from shmkv.testing import unique_name
from _namespaces import PY, available, in_private_shm

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

CREATOR = """
import sys, numpy as np, shmkv
name = sys.argv[1]
store = shmkv.create(name, layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")   # 128 KiB a token
seq = store.create_sequence(capacity=256)                                              # 32 MiB: fits
seq.extend(np.ones((32, 100, 8, 128), np.float32), np.ones((32, 100, 8, 128), np.float32), tokens=range(100))
seq.release()
big = store.create_sequence(capacity=512)          # 64 MiB of cells: fine (pages are allocated as written)
try:
    big.extend(np.ones((32, 500, 8, 128), np.float32), np.ones((32, 500, 8, 128), np.float32))  # 62.5 MiB: no
    print("no error", flush=True)
except shmkv.CacheFullError as e:
    print("full:", e, len(big), flush=True)
print("ready", seq.id, flush=True)
sys.stdin.readline()                                                                   # until the reader is done
store.close()
"""

READER = """
import sys, shmkv
store = shmkv.attach(sys.argv[1], readonly=True)
seq = store.sequence(int(sys.argv[2]))
print(len(seq), seq.tokens[:3].tolist(), float(seq.keys(31)[99, 7, 127]), flush=True)
store.close()
"""


@pytest.mark.slow
def test_one_store_two_processes_in_a_private_64mib_shm():
    name = unique_name("ctr")
    shm = 'mount --make-rprivate / && mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    p = subprocess.Popen(["unshare", "-m", "sh", "-c", shm, "sh", PY, "-c", CREATOR, name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = ""
    try:
        full = p.stdout.readline()  # pipes, not sleeps: the creator says when it is ready
        ready = p.stdout.readline().split()
        if not full.startswith("full:"):
            p.kill()  # (it waits for our newline: its stderr ends only once it is gone)
            pytest.fail(full + p.communicate()[1])
        assert full.split()[-1] == "0", full  # the extend that did not fit wrote nothing
        assert "enlarge /dev/shm" in full and "--shm-size" in full, full  # the message names the fix
        assert ready[:1] == ["ready"], ready
        assert name not in shmkv.list_stores()  # the machine's /dev/shm never sees it
        # a second process joins the creator's /dev/shm, as `docker run --ipc=container:NAME` does
        r = subprocess.run(["nsenter", "-t", str(p.pid), "-m", PY, "-c", READER, name, ready[1]],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["100", "[0,", "1,", "2]", "1.0"], r.stdout
    finally:
        try:
            _, err = p.communicate("\n", timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert p.returncode == 0, err  # no SIGBUS, a clean close


@pytest.mark.slow
def test_demo_runs_in_docker_default_64mib_shm():
    r = in_private_shm([PY, "-m", "shmkv", "demo"], "64m", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equal to a single-process run without shmkv: yes" in r.stdout

