"""A full /dev/shm, out of bytes or out of inodes, is CacheFullError naming the fix, and a failed
create leaves nothing behind (no raw OSError; errors name the fix). Run in a
private mount namespace (``unshare -m``, root) whose /dev/shm is a tiny tmpfs: the machine's
/dev/shm is never filled. Skipped without root or unshare, except under CI=true."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = str(Path(__file__).parent / "procs" / "shm_full.py")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _run() -> list[dict]:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI must run as root with util-linux's unshare (a private /dev/shm)")
        pytest.skip("needs root and unshare for a private /dev/shm")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, CHILD],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_a_full_dev_shm_is_cache_full_and_a_failed_create_leaves_nothing():
    results = {r["label"]: r for r in _run()}
    for inodes in range(1, 6):
        r = results[f"inodes={inodes}"]
        assert not r["ok"]
        assert r["classes"][:3] == ["CacheFullError", "ShmkvError", "MemoryError"], r
        assert "enlarge /dev/shm" in r["msg"], r
        assert r["left"] == [], r  # (a failed create left its lock file)
    assert results["inodes=6"]["ok"] and results["inodes=6"]["left"] == []
    r = results["bytes"]
    assert not r["ok"] and r["classes"][0] == "CacheFullError" and "enlarge /dev/shm" in r["msg"]
