#!/usr/bin/env python3
"""``python tools/bench.py ARGS``: the same as ``shmkv bench ARGS`` (the benchmarks live in
shmkv/cli/bench/). This checkout's benchmark code is the one that runs, whichever shmkv is
first on PYTHONPATH: tools/bench_against.py measures an older tree's package with this
checkout's harness. The loading happens at import, so that the scenarios' spawned children
(which re-run this file as their main module) find the same harness.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parent.parent / "shmkv" / "cli" / "bench"


def _load_harness() -> None:
    """Register this checkout's shmkv/cli/bench as the package ``shmkv.cli.bench``."""
    import shmkv.cli  # the parent package: this checkout's or the one under test

    try:  # the harness's one import from the cli package: an older tree may lack it
        importlib.import_module("shmkv.cli._quiet")
    except ImportError:
        qspec = importlib.util.spec_from_file_location("shmkv.cli._quiet", HARNESS.parent / "_quiet.py")
        assert qspec is not None and qspec.loader is not None
        quiet = importlib.util.module_from_spec(qspec)
        sys.modules["shmkv.cli._quiet"] = quiet
        qspec.loader.exec_module(quiet)
    spec = importlib.util.spec_from_file_location("shmkv.cli.bench", HARNESS / "__init__.py",
                                                  submodule_search_locations=[str(HARNESS)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["shmkv.cli.bench"] = module
    spec.loader.exec_module(module)
    shmkv.cli.bench = module  # type: ignore[attr-defined]


_load_harness()

if __name__ == "__main__":
    sys.exit(importlib.import_module("shmkv.cli.bench.driver").main(sys.argv[1:]))
