#!/usr/bin/env python3
"""``python tools/bench_serve.py ARGS``: the same as ``python -m shmkv.cli.bench.serve ARGS``
(the benchmark lives in shmkv/cli/bench/serve.py and serve_stack.py)."""

import sys

from shmkv.cli.bench.serve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
