"""A reader at a terminal, for tests/test_docs_snippets.py: ``python _doc_session.py BLOCKS.json WORKDIR``.

BLOCKS.json is a list of ``{"file": null or "NAME.py", "code": "..."}``, one page's ```python
blocks in order. In WORKDIR:

- a block without a file name is pasted into one interactive interpreter that all such blocks
  of the page share, line by line as the classic REPL (Python 3.11, 3.12) reads a paste: a
  compound statement ends at a blank line, and an Enter follows each block;
- a block whose first line is ``# NAME.py`` (the page asks the reader to save it) is saved as
  NAME.py and run at its place in the page: ``python NAME.py``, or ``python -m pytest NAME.py``
  for a ``test_*.py`` file.

The first traceback (a warning too: this runs under ``-W error``) or failed program ends the
session with exit status 1.
"""

from __future__ import annotations

import code
import json
import os
import subprocess
import sys


class _Reader(code.InteractiveConsole):
    failed = False

    def showtraceback(self) -> None:
        self.failed = True
        super().showtraceback()

    def showsyntaxerror(self, filename: str | None = None, **kwargs: object) -> None:
        self.failed = True
        super().showsyntaxerror(filename, **kwargs)


def _paste(console: _Reader, text: str, where: str) -> None:
    for line in [*text.splitlines(), ""]:  # "": the Enter after the paste
        more = console.push(line)
        if console.failed:
            sys.exit(f"{where}: failed at the line {line!r}")
    if more:
        sys.exit(f"{where}: the interpreter still waits for more input after the block")


def _run_file(name: str, text: str, where: str) -> None:
    with open(name, "w") as f:
        f.write(text)
    if os.path.basename(name).startswith("test_"):
        cmd = [sys.executable, "-W", "error", "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
    else:
        cmd = [sys.executable, "-W", "error", name]
    r = subprocess.run(cmd, timeout=600)
    if r.returncode:
        sys.exit(f"{where}: `python {' '.join(cmd[3:])}` exited {r.returncode}")


def main() -> None:
    with open(sys.argv[1]) as f:
        blocks = json.load(f)
    workdir = sys.argv[2]
    os.chdir(workdir)
    console = _Reader(locals={"__name__": "__main__", "__doc__": None})
    for i, block in enumerate(blocks):
        where = f"block {i} (line {block['line']})"
        if block["file"]:
            _run_file(block["file"], block["code"], where)
        else:
            _paste(console, block["code"], where)


if __name__ == "__main__":
    main()
