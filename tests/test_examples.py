"""Every program in examples/ runs as is and leaves nothing behind."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


def test_examples_found():
    assert {p.name for p in EXAMPLES} >= {"multi_worker.py", "inspect_live.py", "snapshot_restore.py",
                                          "speculative_rollback.py"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path):
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip()
