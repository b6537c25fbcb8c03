"""Ctrl-C in commands that start processes: the processes ignore it, the command handles it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside ignore SIGINT for good (an ignored signal stays ignored through
    fork and exec), so a Ctrl-C to the process group never prints a child's traceback, whatever
    the child was doing (importing, unpickling, exiting); the caller handles Ctrl-C and stops
    them. SIGINT is blocked meanwhile, so a Ctrl-C in the window is delivered, not lost, when
    the caller's handler is back. Main thread only (elsewhere it changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    came = False
    try:
        came = signal.SIGINT in signal.sigpending()  # (ignoring SIGINT discards a pending one)
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.SIG_DFL if old is None else old)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if came:
        raise KeyboardInterrupt


def quiet_children() -> Callable[[], None]:
    """From now on every multiprocessing process this process starts ignores SIGINT (as
    ``children_ignore_sigint``); returns the function that ends it. For a command whose
    processes are started by code it does not own (the bench's scenarios): its own Ctrl-C
    handling (finally blocks) stops them."""
    from multiprocessing.process import BaseProcess

    start = BaseProcess.start

    def quiet_start(self: Any) -> None:
        with children_ignore_sigint():
            start(self)

    BaseProcess.start = quiet_start  # type: ignore[method-assign]

    def undo() -> None:
        BaseProcess.start = start  # type: ignore[method-assign]

    return undo
