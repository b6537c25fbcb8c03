"""Functions and scripts the tests run in child processes.

Each module serves one or a few test modules (``procs.crash`` serves tests/test_crash.py and
tests/test_journal.py, ...). Their functions are module level, so a child started by spawn or
forkserver imports them by name: pytest puts tests/ on ``sys.path`` (rootdir-relative
``prepend`` import mode, no ``tests/__init__.py``), and such a child inherits the parent's
``sys.path``. Modules with a ``__main__`` block are also run as scripts
(``python tests/procs/crash.py ...``); they import nothing from tests/.
"""
