"""The README's quick start runs as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import shmkv

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_quick_start_runs(tmp_path):
    text = README.read_text()
    block = re.search(r"## Quick start.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    script = tmp_path / "quick.py"
    script.write_text(block)
    try:
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "(8, 2, 8) [  1   2   3   4   5 100 101 102]" in r.stdout
        assert "quickstart" not in shmkv.list_stores()
    finally:
        pathlib.Path("/tmp/quickstart.shmkv").unlink(missing_ok=True)
