"""Every Python block of README.md and docs/*.md runs as written.

A block runs alone in a fresh interpreter, in a private /dev/shm and /tmp where the
machine allows it (see ``run_script``), and must leave nothing in /dev/shm. A block that is a fragment (it uses a
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
from _namespaces import available
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


# Each block runs in a private /dev/shm and /tmp where the machine allows it (root: CI):
# the pages use fixed names ("quickstart", "/tmp/quickstart.shmkv"), and another checkout's
# suite running the same pages at the same time must not meet them (/tmp stays the machine's
# when the checkout or the interpreter lives there: see _lives_in_tmp). The command then
# checks that the block left nothing in its /dev/shm. Elsewhere the block runs on the
# machine's /dev/shm, and the plugin's leak check judges what it left.
_ISOLATED = ('mount --make-rprivate / && mount -t tmpfs -o size=1g tmpfs /dev/shm '
             '&& { [ -n "$KEEP_TMP" ] || mount -t tmpfs tmpfs /tmp; } '
             '&& cd "$WORK" && cat > "$FILE" && "$@" "$WORK/$FILE" && left=$(ls -A /dev/shm) '
             '&& { [ -z "$left" ] || { echo "left in /dev/shm: $left" >&2; exit 3; }; }')


def _lives_in_tmp() -> bool:
    """Whether this interpreter, its packages or the checkout lie under /tmp: a tmpfs mounted
    over /tmp would hide them (a clone in /tmp, as CI may make), so /tmp is then left alone."""
    here = [sys.prefix, sys.executable, str(pathlib.Path(__file__).resolve().parent), *sys.path]
    return any(os.path.realpath(p).startswith("/tmp/") for p in here if p)


def run_script(text: str, filename: str, cmd: list[str], tmp_path: pathlib.Path,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``cmd + [path of text saved as filename]``, isolated when the machine allows it."""
    if available() is None:
        keep_tmp = _lives_in_tmp()
        env = {**os.environ, "FILE": filename, "WORK": str(tmp_path) if keep_tmp else "/tmp",
               "KEEP_TMP": "1" if keep_tmp else ""}
        return subprocess.run(["unshare", "-m", "sh", "-c", _ISOLATED, "sh", *cmd], input=text, env=env,
                              capture_output=True, text=True, timeout=timeout)
    script = tmp_path / filename
    script.write_text(text)
    return subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block_runs(block: Block, tmp_path: pathlib.Path):
    _require(block.requires)
    code = block.code
    for old, new in block.subs:
        assert old in code, f"{block.id}: test-sub {old!r} is not in the block"
        code = code.replace(old, new)
    if block.run == "pytest":
        r = run_script(block.setup + code, "test_doc_block.py",
                       [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"], tmp_path)
    else:
        assert block.run == "python", block.run
        # the setup and teardown wrap the block in one namespace; __main__ as a script would be
        r = run_script(block.setup + code + block.teardown, "doc_block.py", [sys.executable, "-W", "error"], tmp_path)
    assert r.returncode == 0, f"{block.id} failed:\n{r.stdout}\n{r.stderr}"


def test_quick_start_prints_what_it_says(tmp_path):
    text = README.read_text()
    block = re.search(r"## Quick start.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    isolated = available() is None
    try:
        r = run_script(block, "quick.py", [sys.executable], tmp_path, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "(8, 2, 8) [  1   2   3   4   5 100 101 102]" in r.stdout
        assert "quickstart" not in shmkv.list_stores()
    finally:
        if not isolated:  # isolated, it wrote into a /tmp that is gone
            pathlib.Path("/tmp/quickstart.shmkv").unlink(missing_ok=True)
