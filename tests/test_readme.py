"""Every Python block of README.md and docs/*.md runs as written.

A block runs alone in a fresh interpreter. A block that is a fragment (it uses a
`store`, a `model`, a Redis URL it does not make) gets what it needs from HTML
comments around it, invisible on the rendered page:

    <!-- test-requires: torch, transformers, redis-server -->   missing: skip (fail under CI)
    <!-- test-setup
    code run before the block (same namespace)
    -->
    <!-- test-sub: "redis://10.0.0.5:6379/0" => REDIS_URL -->   replaced in the block's text
    <!-- test-run: pytest -->                                   the block is a test file: run pytest on it
    ```python
    ...
    ```
    <!-- test-teardown
    code run after the block: checks what the block claims, removes what it made
    -->

Listings that are not Python (signatures with `layers=,`) are fenced as text.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import shmkv
from conftest import importorskip_unless_ci

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_COMMENT = re.compile(r"<!--\s*test-(\w+)(:?)(.*?)-->", re.DOTALL)


@dataclasses.dataclass
class Block:
    page: str
    index: int
    line: int
    code: str
    setup: str = ""
    teardown: str = ""
    requires: tuple[str, ...] = ()
    subs: tuple[tuple[str, str], ...] = ()
    run: str = "python"

    @property
    def id(self) -> str:
        return f"{self.page}#{self.index}(line {self.line})"


def _comments_before(text: str, end: int) -> list[re.Match[str]]:
    """The test comments stacked right before position ``end`` (only whitespace between)."""
    found: list[re.Match[str]] = []
    pos = end
    while True:
        head = text[:pos].rstrip()
        if not head.endswith("-->"):
            return found[::-1]
        start = head.rfind("<!--")
        m = _COMMENT.fullmatch(head[start:])
        if m is None:
            return found[::-1]
        found.append(m)
        pos = start


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    out = []
    for i, m in enumerate(_BLOCK.finditer(text)):
        b = Block(str(page.relative_to(ROOT)), i, text.count("\n", 0, m.start()) + 1, m.group(1))
        for c in _comments_before(text, m.start()):
            kind, value = c.group(1), c.group(3)
            if kind == "setup":
                b.setup = value.strip("\n") + "\n"
            elif kind == "requires":
                b.requires = tuple(r.strip() for r in value.split(",") if r.strip())
            elif kind == "sub":
                old, new = value.split("=>")
                b.subs += ((old.strip(), new.strip()),)
            elif kind == "run":
                b.run = value.strip()
            else:
                raise AssertionError(f"{b.id}: unknown comment test-{kind}")
        after = re.match(r"\s*<!--\s*test-teardown(.*?)-->", text[m.end():], re.DOTALL)
        if after:
            b.teardown = after.group(1).strip("\n") + "\n"
        out.append(b)
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def test_every_page_is_collected():
    """The pages with Python blocks: a guide that loses its blocks (or a new page) shows up here."""
    pages = {b.page for b in ALL}
    assert "README.md" in pages and "docs/prefix-cache.md" in pages and "docs/transformers.md" in pages
    for page in PAGES:  # no Python listing hides under another fence name
        assert "```py\n" not in page.read_text(), page


def _require(names: tuple[str, ...]) -> None:
    for name in names:
        if name == "redis-server":
            if shutil.which("redis-server") is None:
                if os.environ.get("CI", "").lower() == "true":
                    pytest.fail("redis-server is not on PATH under CI")
                pytest.skip("redis-server is not on PATH")
        else:
            importorskip_unless_ci(name)


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block_runs(block: Block, tmp_path: pathlib.Path):
    _require(block.requires)
    code = block.code
    for old, new in block.subs:
        assert old in code, f"{block.id}: test-sub {old!r} is not in the block"
        code = code.replace(old, new)
    if block.run == "pytest":
        script = tmp_path / "test_doc_block.py"
        script.write_text(block.setup + code)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", str(script)]
    else:
        assert block.run == "python", block.run
        script = tmp_path / "doc_block.py"
        # the setup and teardown wrap the block in one namespace; __main__ as a script would be
        script.write_text(block.setup + code + block.teardown)
        cmd = [sys.executable, "-W", "error", str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, f"{block.id} failed:\n{r.stdout}\n{r.stderr}"
    # a store the block leaves behind fails the test: the plugin's leak check (on for this suite)


def test_quick_start_prints_what_it_says(tmp_path):
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
