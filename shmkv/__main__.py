import sys

from shmkv.cli import main

sys.exit(main())
