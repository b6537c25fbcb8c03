#!/usr/bin/env python3
"""Benchmarks against numpy, np.save/np.load and multiprocessing, as ratios (same as `shmkv bench`)."""

import sys

from shmkv._bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
