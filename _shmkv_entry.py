"""The ``shmkv`` command's entry point (pyproject.toml's [project.scripts]).

A Ctrl-C while Python still imports shmkv and numpy (a second or more on a busy machine)
ends with one line on stderr instead of an import traceback; everything else is
``shmkv.cli.main``. A module of its own, outside the package: importing anything in
``shmkv`` runs the package's imports first.
"""

import sys


def main() -> int:
    try:
        from shmkv.cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("shmkv: interrupted\n")
        return 130
    return cli_main()
