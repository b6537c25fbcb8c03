"""Figures in a reader's units: sizes in B/KiB/MiB/GiB, counts with thousands separators."""

from __future__ import annotations

import re


def size(n: float) -> str:
    """``512 B``, ``51.2 KiB``, ``1.50 MiB``, ``2.25 GiB``: the unit that gives a readable figure."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 else f"{v:,.0f} {unit}"
    return f"{int(n)} B"


def count(n: int, what: str) -> str:
    """``1 token``, ``65,536 tokens``."""
    return f"{n:,} {what}{'' if n == 1 else 's'}"


_PYTHON_AND_CLI = re.compile(r"shmkv\.\w+\([^()]*\)\s*(?:or|/)\s*(`shmkv [^`]+`)")


def for_the_shell(message: str) -> str:
    """A library error message in a command's words: where it offers the Python call and the
    command ("shmkv.list_stores() or `shmkv ls`"), keep the command."""
    return _PYTHON_AND_CLI.sub(r"\1", message)
