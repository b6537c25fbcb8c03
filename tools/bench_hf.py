#!/usr/bin/env python3
"""``python tools/bench_hf.py ARGS``: the same as ``python -m shmkv.cli.bench.hf ARGS``
(the benchmark lives in shmkv/cli/bench/hf.py)."""

import sys

from shmkv.cli.bench.hf import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
