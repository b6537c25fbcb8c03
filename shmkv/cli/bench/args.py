"""Argument types of the benchmarks. They live in the harness, not in shmkv.cli._args:
tools/bench_against.py loads this harness over an older tree's shmkv, whose cli package has only
what that tree had."""

from __future__ import annotations

import argparse
import importlib.util
import os

# what matplotlib's Agg backend writes, by file name suffix
PLOT_SUFFIXES = ("png", "svg", "svgz", "pdf", "ps", "eps", "jpg", "jpeg", "tif", "tiff", "webp", "pgf", "raw", "rgba")


def png_arg(text: str) -> str:
    """A --plot path, checked before any work (a run of minutes must not fail at its last step):
    a file name with a suffix matplotlib writes, matplotlib importable, its directory there and
    writable."""
    suffix = os.path.splitext(text)[1].lstrip(".").lower()
    if not text or text.endswith(os.sep) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name: give one such as bench.png")
    if suffix not in PLOT_SUFFIXES:
        others = ", ".join("." + x for x in PLOT_SUFFIXES[1:])
        raise argparse.ArgumentTypeError(f"{text!r}: a plot is written as .png (or {others}), "
                                         f"not {'.' + suffix if suffix else 'without a suffix'}")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(f"{text!r}: drawing it needs matplotlib: pip install 'shmkv[plot]'")
    where = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(where):
        raise argparse.ArgumentTypeError(f"{text!r}: no directory {where!r}; create it or give another path")
    if not os.access(where, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: directory {where!r} is not writable here; give another path")
    return text
