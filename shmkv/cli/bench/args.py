"""Argument types of the benchmarks. They live in the harness, not in shmkv.cli._args:
tools/bench_against.py loads this harness over an older tree's shmkv, whose cli package has only
what that tree had."""

from __future__ import annotations

import argparse
import importlib.util
import os

def png_arg(text: str) -> str:
    """A --plot path, checked before any work: matplotlib importable, its directory there and writable
    (a run of minutes must not fail at its last step)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(f"{text!r}: drawing it needs matplotlib: pip install 'shmkv[plot]'")
    where = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(where):
        raise argparse.ArgumentTypeError(f"{text!r}: no directory {where!r}; create it or give another path")
    if not os.access(where, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: directory {where!r} is not writable here; give another path")
    return text
