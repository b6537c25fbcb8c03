"""Ctrl-C on the store lock's path, deferred to the next safe point.

Why (tests/test_journal.py::test_sigints_never_leave_the_lock_held): a KeyboardInterrupt
is raised by the interpreter between bytecodes, at its "eval breaker" checks (a function's
first instruction, after a call into C, a backward jump). One landing between the flock
and the bookkeeping, or at the first instruction of an ``__exit__``, would leave the lock
held by a process that lives on (a REPL keeps the traceback and its frames). So the
code that takes, gives up or rolls back a hold is *critical* (``critical``): while the main
thread runs it (or anything it calls), this module's SIGINT handler, installed over
Python's default one (``guard_sigint``), notes the signal instead of raising, and the
interrupt is raised at the next safe point: the end of a release (the lock already given
up), or while waiting for the lock (nothing held). Everything else (the body of a
structural operation, a restore's reading) is interrupted as usual and its journaled
transaction rolls back (``journal``). No system call on the lock path: blocking signals
with ``pthread_sigmask`` cost 2.5 us a call here, and does not stop another thread from
taking the signal for the process. A handler a program installs itself replaces ours
(and ``asyncio.run`` installs its own only over Python's default one: with shmkv attached
first, Ctrl-C in ``asyncio.run`` raises KeyboardInterrupt as before Python 3.11).
"""

from __future__ import annotations

import _signal  # signal's C half (see guard_sigint)
import os
import signal
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

__all__ = ["critical", "deferred", "deliver_deferred", "guard_sigint"]

_CRITICAL: set[CodeType] = set()  # code whose frames defer SIGINT (and what they call)
deferred: list[int] = []  # signals noted by _on_sigint, raised at the next safe point
_main_ident = threading.main_thread().ident
FnT = TypeVar("FnT", bound=Callable[..., Any])


def critical(fn: FnT) -> FnT:
    """Mark ``fn`` as lock-path code: a SIGINT while the main thread runs it (or anything it
    calls) is raised at the next safe point instead (see the module docstring)."""
    _CRITICAL.add(fn.__code__)
    return fn


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    f = frame
    while f is not None:
        if f.f_code in _CRITICAL:
            deferred.append(signum)
            return
        f = f.f_back
    signal.default_int_handler(signum, frame)


def guard_sigint() -> None:
    """Install the SIGINT handler that defers Ctrl-C out of lock-path code, over Python's
    default handler only (a program's own handler is left alone). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:  # (_signal's: signal's own wrap the handler in an enum lookup that fails, ~50 us cold an attach)
        if _signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        pass


def deliver_deferred() -> None:
    """Raise a Ctrl-C that lock-path code deferred (call at a safe point, main thread)."""
    if deferred and threading.get_ident() == _main_ident:
        signum = deferred[0]
        deferred.clear()
        signal.default_int_handler(signum, None)


def _after_fork_in_child() -> None:
    global _main_ident
    _main_ident = threading.get_ident()  # the forking thread is the child's main thread
    deferred.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
