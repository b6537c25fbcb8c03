"""Ctrl-C on the store lock's path, deferred to the next safe point.

Why (tests/test_journal.py::test_sigints_never_leave_the_lock_held): a KeyboardInterrupt
is raised by the interpreter between bytecodes, at its "eval breaker" checks (a function's
first instruction, after a call into C, a backward jump). One landing between the flock
and the bookkeeping, or at the first instruction of an ``__exit__``, would leave the lock
held by a process that lives on (a REPL keeps the traceback and its frames). So the
code that takes, gives up or rolls back a hold is *critical* (``critical``): while the main
thread runs it (or anything it calls), this module's SIGINT handler notes the signal
instead of raising, and the interrupt is raised at the next safe point: the end of a
release (the lock already given up), or while waiting for the lock (nothing held).
Everything else (the body of a structural operation, a restore's reading) is interrupted
as usual and its journaled transaction rolls back (``journal``).

The handler stands in front of Python's default one only while the main thread holds a
store lock: ``hold`` installs it as a lock is taken (before anything is held) and ``unhold``
puts Python's default handler back when the main thread's last hold ends. Outside those
holds nothing of shmkv is on the SIGINT path: a program's own Ctrl-C raises in its own code
(its traceback ends there) and ``asyncio.run``, which installs its handler only over
Python's default one, handles Ctrl-C as without shmkv. A handler a program installs itself
is left alone (no deferral under it: with ``asyncio.run`` the lock path is not shielded from
a second Ctrl-C). No system call while a hold nests: one ``sigaction`` to install and one to
restore per outermost hold of the main thread; blocking signals with ``pthread_sigmask``
instead cost 2.5 us a call here and does not stop another thread from taking the signal for
the process.
"""

from __future__ import annotations

import _signal  # signal's C half (see hold)
import _thread
import functools
import os
import signal
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

__all__ = ["critical", "critical_here", "deferred", "deliver_deferred", "hold", "shielding", "unhold"]

_CRITICAL: set[CodeType] = set()  # code whose frames defer SIGINT (and what they call)
_CRITICAL_HERE: set[CodeType] = set()  # code whose own instructions defer it (not what it calls)
deferred: list[int] = []  # signals noted by _on_sigint, raised at the next safe point
_main_ident = threading.main_thread().ident
_get_ident = _thread.get_ident  # (threading's, without the module lookup: on every lock hold)
_installed = False  # _on_sigint is the SIGINT handler (put there by hold)
_holds = 0  # store-lock holds the main thread has or is taking (hold / unhold)
FnT = TypeVar("FnT", bound=Callable[..., Any])


def critical(fn: FnT) -> FnT:
    """Mark ``fn`` as lock-path code: a SIGINT while the main thread runs it (or anything it
    calls) is raised at the next safe point instead (see the module docstring)."""
    _CRITICAL.add(fn.__code__)
    return fn


def critical_here(fn: FnT) -> FnT:
    """Mark ``fn``'s own instructions as lock-path code, not what it calls: a SIGINT handled
    while ``fn`` itself runs (between the lock's entry and a call, or as a call returns into it)
    is raised at the next safe point; one in a function it calls is raised there as usual."""
    _CRITICAL_HERE.add(fn.__code__)
    return fn


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if frame is not None and frame.f_code in _CRITICAL_HERE:
        deferred.append(signum)
        return
    f = frame
    while f is not None:
        if f.f_code in _CRITICAL:
            deferred.append(signum)
            return
        f = f.f_back
    signal.default_int_handler(signum, frame)


@critical  # a Ctrl-C inside it, ours installed, waits too
def hold() -> None:
    """A store-lock hold begins: called as a lock is taken, before anything is held, and
    matched by one ``unhold`` whether the hold is then taken or given up (any thread: only the
    main thread's count). The main thread's first puts the SIGINT handler that defers Ctrl-C
    out of lock-path code in front of Python's default handler (a program's own handler is
    left alone)."""
    global _holds, _installed
    if _get_ident() != _main_ident:
        return
    # Installed first, counted last: a Ctrl-C before ours is in place is raised by Python's handler
    # (after any call into C here) with nothing changed yet; once ours is in place it is noted.
    if not _holds:  # the main thread's first hold: a Ctrl-C noted before is stale (a second Ctrl-C,
        deferred.clear()  # raised as the first's hold ended, stood in for it; it must not come out now)
    if not _installed:
        try:  # (_signal's: signal's own wrap the handler in an enum lookup that fails, ~50 us cold an attach)
            if _signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                _signal.signal(signal.SIGINT, _on_sigint)
                _installed = True
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            pass
    _holds += 1


@critical  # a Ctrl-C inside it, ours installed, waits too
def unhold() -> None:
    """A hold ends (given up, or never taken). When the main thread holds no store lock any
    more, Python's default SIGINT handler goes back in place, unless a program replaced ours
    meanwhile. Call from critical code."""
    global _holds, _installed
    if _get_ident() != _main_ident:
        return
    if _holds > 0:
        _holds -= 1
    if _holds or not _installed:
        return
    _installed = False
    try:
        if _signal.getsignal(signal.SIGINT) is _on_sigint:
            _signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):
        pass


def deliver_deferred() -> None:
    """Raise a Ctrl-C that lock-path code deferred (call at a safe point, main thread)."""
    if deferred and _get_ident() == _main_ident:
        signum = deferred[0]
        deferred.clear()
        signal.default_int_handler(signum, None)


_NOTHING: Any = object()


def shielding(undo: Callable[[Any], object] | None = None) -> Callable[[FnT], FnT]:
    """Decorate an operation that opens or closes descriptors outside the store lock (an attach,
    a close, a save's temporary file): it runs under a hold of the deferring handler, so a Ctrl-C
    inside its ``critical`` code (where a descriptor exists that nothing owns yet, or any more)
    is noted and raised as it returns, or earlier by a lock release inside it; ``undo(result)``
    then undoes what it returned (the caller never gets it). The rest of it is interrupted as
    usual."""

    def decorate(fn: FnT) -> FnT:
        @functools.wraps(fn)
        @critical_here  # a Ctrl-C as fn returns into it waits: the result is kept, then undone
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = _NOTHING
            hold()
            try:
                try:
                    deliver_deferred()  # (one noted as the handler was put in place: before anything is made)
                    result = fn(*args, **kwargs)
                finally:
                    unhold()
                    deliver_deferred()
            except BaseException:
                if result is not _NOTHING and undo is not None:
                    undo(result)
                raise
            return result

        return wrapper  # type: ignore[return-value]  # functools.wraps keeps fn's signature; mypy cannot see it

    return decorate


def _after_fork_in_child() -> None:
    global _main_ident, _holds
    _main_ident = _get_ident()  # the forking thread is the child's main thread
    deferred.clear()
    _holds = 0  # the child holds none of the parent's locks
    unhold()


os.register_at_fork(after_in_child=_after_fork_in_child)
