#!/usr/bin/env python3
"""``python tools/bench_prefix.py ARGS``: the same as ``python -m shmkv.cli.bench.prefix ARGS``
(the benchmark lives in shmkv/cli/bench/prefix.py)."""

import sys

from shmkv.cli.bench.prefix import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
