"""``python -m shmkv.cli.bench``: the same as ``shmkv bench``."""

import sys

from shmkv.cli.bench.driver import main

sys.exit(main(sys.argv[1:]))
