"""What every example does around its work (not about shmkv; skip it when reading an example).

``run(main, __doc__)`` answers ``--help`` with the example's usage before anything is made
(no store, no process), then runs ``main()`` (``run(main, parser)``: ``main(args)``, the
options that parser read). A Ctrl-C at any moment ends with one line on
stderr: the processes the example starts ignore SIGINT (the terminal sends it to all of
them), and this process, which gets it as KeyboardInterrupt, stops them; the store the
example created goes with it (its creator's close, or its exit).
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_importing(signum: int, frame: object) -> None:
    print(f"{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr)
    raise SystemExit(130)  # nothing made yet: no store, no process


# Imported first, before numpy and shmkv (seconds on a busy machine): a Ctrl-C meanwhile ends the
# program with one line. Not in the example's own processes, which inherit SIGINT ignored.
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_importing)

import argparse  # noqa: E402  (after the handler: these imports take a moment too)
import multiprocessing  # noqa: E402
import multiprocessing.process  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402


class temporary_directory:  # (lower case: used as tempfile.TemporaryDirectory is)
    """``with temporary_directory("prefix-") as path:`` a new directory under $TMPDIR, removed on the
    way out, also when a Ctrl-C cuts its making or its removal short: its removal at exit is
    registered before the directory exists (tempfile.TemporaryDirectory registers it after
    making it, and gives it up before removing the directory)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __enter__(self) -> str:
        import atexit
        import functools
        import secrets
        import shutil
        import tempfile

        while True:
            path = os.path.join(tempfile.gettempdir(), f"{self.prefix}{secrets.token_hex(6)}")
            self.remove = functools.partial(shutil.rmtree, path, ignore_errors=True)
            atexit.register(self.remove)
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:  # (another's: never ours to remove)
                atexit.unregister(self.remove)

    def __exit__(self, *exc: object) -> None:
        import atexit

        self.remove()
        atexit.unregister(self.remove)  # (if a Ctrl-C comes first, the exit removes it)


class uninterrupted_imports:  # (lower case: a with-block helper, as temporary_directory)
    """``with uninterrupted_imports():`` imports of seconds (torch, transformers) that a Ctrl-C must
    not cut in the middle: a module left half imported can break a later import of another one
    (numpy's submodule in sys.modules without its attribute: a RecursionError at the next import
    that asks for it). SIGINT is blocked meanwhile; a Ctrl-C that came is delivered once the
    imports are done, as the KeyboardInterrupt ``run`` turns into one line."""

    def __enter__(self) -> None:
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def __exit__(self, *exc: object) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)


def parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def _start_ignoring_sigint(start: Callable[[Any], None]) -> Callable[[Any], None]:
    def quiet_start(self: Any) -> None:
        # An ignored signal stays ignored in the child through fork and exec; SIGINT is blocked
        # meanwhile, so a Ctrl-C in this window is delivered here afterwards, not lost.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        came = False
        try:
            came = signal.SIGINT in signal.sigpending()  # (ignoring SIGINT discards a pending one)
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                start(self)
            finally:
                signal.signal(signal.SIGINT, old)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if came:
            raise KeyboardInterrupt

    return quiet_start


def run(main: Callable[..., object], doc_or_parser: str | argparse.ArgumentParser | None) -> None:
    """Parse the command line (``--help`` exits here), then run ``main`` as described above."""
    own = isinstance(doc_or_parser, argparse.ArgumentParser)
    p = doc_or_parser if isinstance(doc_or_parser, argparse.ArgumentParser) else parser(doc_or_parser)
    args = p.parse_args()
    if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here: KeyboardInterrupt, below
    base = multiprocessing.process.BaseProcess
    base.start = _start_ignoring_sigint(base.start)  # type: ignore[method-assign]
    try:
        main(args) if own else main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C (one to us, one to the group) waits
        children = multiprocessing.active_children()
        for c in children:
            c.terminate()
        for c in children:
            c.join(10)
        print(f"{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr)
        sys.exit(130)
