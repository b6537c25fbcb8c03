"""Every ```python block of README.md and docs/*.md runs as a reader who pastes it would run it.

A page's blocks run in order in one fresh interpreter (``_doc_session.py``: pasted line by line,
as the classic REPL reads a paste); a block whose first line is ``# NAME.py`` is saved under
that name and run (``python NAME.py``; ``python -m pytest NAME.py`` for a ``test_*.py``), as the
page asks the reader to. Nothing is added to what the page shows: no set-up, no checks, no
clean-up of the test's own. A line ``print(...)  # prints: TEXT`` must print TEXT.

Each page runs in a private /dev/shm (a mount namespace with its own tmpfs, as root: CI is),
with TMPDIR and the working directory fresh; afterwards /dev/shm and TMPDIR must be empty (but
for torch's own cache, made when torch is imported) and
the working directory hold only the files the page asked to save. Without root it runs on the
machine's /dev/shm, and no segment of a store name the page uses may be left there.

Pages that need more than a fresh interpreter: docs/transformers.md needs torch and
transformers; docs/redis.md a Redis server: it runs against a throwaway redis-server on
loopback, its one URL (``REDIS_URL`` below) replaced by that server's. Without them these
pages are skipped (failed under CI).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from _namespaces import available, in_private_shm
from conftest import importorskip_unless_ci
from shmkv.testing import shm_entries

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
RUNNER = str(pathlib.Path(__file__).parent / "_doc_session.py")

NEEDS = {"docs/transformers.md": ("torch", "transformers"), "docs/redis.md": ("redis", "redis-server")}
REDIS_URL = {"docs/redis.md": "redis://localhost:6379/0"}  # the URL the page shows, replaced by a live one
LIBRARY_TMP = re.compile(r"torchinductor_.+")  # torch's compile cache, made in TMPDIR when torch is imported

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_FILE = re.compile(r"# ([\w-]+\.py)")
_PRINTS = re.compile(r"^\s*print\(.*\)\s+# prints: (.+)$", re.MULTILINE)


def blocks(page: pathlib.Path) -> list[dict[str, object]]:
    """The page's ```python blocks in order: code, line, and the file name its first line gives."""
    text = page.read_text()
    out: list[dict[str, object]] = []
    for m in _BLOCK.finditer(text):
        code = m.group(1)
        named = _FILE.fullmatch(code.split("\n", 1)[0])
        out.append({"file": named.group(1) if named else None, "code": code,
                    "line": text.count("\n", 0, m.start()) + 1})
    return out


RUNNABLE = [p for p in PAGES if blocks(p)]


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def test_pages_hide_nothing():
    """Every page with Python shows all of it: no hidden test comments, no Python under another fence."""
    assert {"README.md", "docs/stores.md", "docs/prefix-cache.md", "docs/transformers.md",
            "docs/api.md", "docs/pytest-plugin.md"} <= {_rel(p) for p in RUNNABLE}
    for page in PAGES:
        text = page.read_text()
        assert "<!-- test-" not in text, f"{_rel(page)}: a hidden test comment; put what the test needs on the page"
        assert not re.search(r"^```(py|python3)\s*$", text, re.MULTILINE), _rel(page)


def test_readme_front_door():
    """The demo command within the README's first 30 lines, a Python example within its first 60."""
    lines = README.read_text().splitlines()
    assert any("shmkv demo" in line and not line.startswith("#") for line in lines[:30])
    assert "```python" in lines[:60]


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_resolve():
    """Every relative link of the pages names a file of the repository, and its #anchor a heading there."""
    for page in [*PAGES, ROOT / "ARCHITECTURE.md"]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve() if target else page
            assert path.exists(), f"{_rel(page)}: a link to {target}, which does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{_rel(page)}: no heading #{anchor} in {target or _rel(page)}"


def _require(names: tuple[str, ...]) -> None:
    for name in names:
        if name == "redis-server":
            if shutil.which("redis-server") is None:
                if os.environ.get("CI", "").lower() == "true":
                    pytest.fail("redis-server is not on PATH under CI")
                pytest.skip("redis-server is not on PATH")
        else:
            importorskip_unless_ci(name)


# run in the private /dev/shm, then check that it is empty
_THEN_EMPTY = ('"$@" || exit $?; left=$(ls -A /dev/shm); '
               '[ -z "$left" ] || { echo "left in /dev/shm: $left" >&2; exit 3; }')


def _store_of(entry: str) -> str:
    """'skv_NAME.h' -> 'NAME'."""
    return entry.split("_", 1)[1].rsplit(".", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=[_rel(p) for p in RUNNABLE])
def test_page_runs(page: pathlib.Path, tmp_path: pathlib.Path):
    rel = _rel(page)
    _require(NEEDS.get(rel, ()))
    found = blocks(page)
    server = None
    if rel in REDIS_URL:
        from shmkv.testing._redis import RedisServer

        server = RedisServer()
        for b in found:
            b["code"] = str(b["code"]).replace(REDIS_URL[rel], server.url)
    work = tmp_path / "work"
    work.mkdir()
    # TMPDIR short: a forkserver's socket is made in it, and an AF_UNIX path holds 107 bytes
    # (tmp_path under pytest-xdist's basetemp comes close)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="skv-doc-"))
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(found))
    cmd = [sys.executable, "-W", "error", RUNNER, str(spec), str(work)]
    env = {**os.environ, "TMPDIR": str(tmp)}
    left: set[str] = set()
    try:
        if available() is None:
            r = in_private_shm(["sh", "-c", _THEN_EMPTY, "sh", *cmd], "1g", env=env, timeout=900)
        else:
            names = set(re.findall(r"\"([A-Za-z0-9_-]{1,24})\"", "".join(str(b["code"]) for b in found)))
            before = shm_entries()
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            left = {e for e in shm_entries() - before if _store_of(e) in names}
    finally:
        if server is not None:
            server.stop()
        left_tmp = [f for f in os.listdir(tmp) if not LIBRARY_TMP.fullmatch(f)]
        shutil.rmtree(tmp, ignore_errors=True)
    assert r.returncode == 0, f"{rel} failed (exit {r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    assert not left, f"{rel} left stores in /dev/shm: {sorted(left)}"
    assert left_tmp == [], f"{rel} left files in TMPDIR: {left_tmp}"
    saved = {b["file"] for b in found if b["file"]}
    assert set(os.listdir(work)) == saved, f"{rel}: the working directory holds {os.listdir(work)}"
    for b in found:
        for want in _PRINTS.findall(str(b["code"])):
            assert want.strip() in r.stdout, f"{rel}, block at line {b['line']}: did not print {want!r}:\n{r.stdout}"
