#!/usr/bin/env python3
"""``python tools/bench_remote.py ARGS``: the same as ``python -m shmkv.cli.bench.remote ARGS``
(the benchmark lives in shmkv/cli/bench/remote.py)."""

import sys

from shmkv.cli.bench.remote import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
