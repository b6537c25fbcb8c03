"""Helpers for testing multi-process code on shmkv (used by shmkv's own tests).

* :func:`unique_name` gives a store name no other test uses.
* :func:`run_in_process` runs a function in a child process with a chosen start
  method and a timeout, always reaps it, and re-raises the child's exception in
  the parent with the child's traceback attached.
* :func:`shm_entries` lists the shmkv segments and lock files in /dev/shm, for
  leak checks.
* :func:`assert_store_state` fails when a store breaks an invariant that holds at rest.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

from shmkv._engine.memory import segment as _segment

__all__ = ["ChildFailed", "ChildProcess", "assert_store_state", "run_in_process", "shm_entries", "start_in_process",
           "unique_name"]

_counter = itertools.count()


def unique_name(prefix: str = "t") -> str:
    """A store name unique to this process and call (fits the 24-character limit)."""
    return f"{prefix[:6]}{os.getpid() % 1_000_000:06d}x{next(_counter):05d}"[:24]


def shm_entries() -> set[str]:
    """shmkv segments and lock files currently in /dev/shm."""
    return {f for f in _segment.listdir() if f.startswith(_segment.PREFIX)}


def assert_store_state(store: Any) -> None:
    """Raise AssertionError naming every invariant ``store`` (a ``shmkv.Store``) breaks at rest:
    ``shmkv verify``'s checks (ranges inside the arena and apart, lengths within capacities,
    even generations, an empty undo log, sequence ids) and those of the shared pages' words
    (``_engine/table/audit.py``). A read-write handle checks under the store lock, taken the one way
    in (``store.transaction()``: a dead process's transaction is rolled back first), so that no
    structural operation is in flight; a read-only one checks the table as it is."""
    from shmkv.store._verify import verify

    if store.readonly:
        problems = verify(store)
    else:
        with store.transaction():
            problems = verify(store)
    assert not problems, f"store {store.name!r}: " + "; ".join(problems)


class ChildFailed(AssertionError):
    """The child exited without finishing: killed by a signal, timed out, or exited non-zero."""


class _RemoteTraceback(Exception):
    def __str__(self) -> str:
        return str(self.args[0])


def _child_main(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        result = fn(*args, **kwargs)
        conn.send(("ok", result, ""))
    except BaseException as e:  # everything goes back to the parent
        tb = traceback.format_exc()
        try:
            conn.send(("error", e, tb))
        except Exception:  # unpicklable exception
            conn.send(("error", RuntimeError(repr(e)), tb))
    finally:
        conn.close()


class ChildProcess:
    """A function running in a child process; ``result()`` waits, reaps and re-raises."""

    def __init__(self, fn: Callable[..., Any], *args: Any, start_method: str = "spawn",
                 timeout: float = 60.0, **kwargs: Any) -> None:
        ctx: Any = mp.get_context(start_method)
        self._recv, send = ctx.Pipe(duplex=False)
        self.timeout = timeout
        self.start_method = start_method
        self.process = ctx.Process(target=_child_main, args=(send, fn, args, kwargs), daemon=True)
        self.process.start()
        send.close()

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return int(pid)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child and reap it (SIGKILL if it outlives ``sig`` by 10 s)."""
        if self.process.is_alive():
            os.kill(self.pid, sig)
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the child; return what its function returned.

        Raises:
            the child's own exception (its traceback chained as the cause);
            ChildFailed: the child was killed, timed out (it is then killed), or exited non-zero.
        """
        timeout = self.timeout if timeout is None else timeout
        msg = None
        try:
            if self._recv.poll(timeout):
                try:
                    msg = self._recv.recv()
                except EOFError:
                    msg = None
            self.process.join(5 if msg is not None else 0.5)
        finally:
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
                if msg is None:
                    self._recv.close()
                    raise ChildFailed(
                        f"child {self.pid} ({self.start_method}) did not finish within {timeout} s; killed"
                    )
            self._recv.close()
        if msg is None:
            code = self.process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise ChildFailed(f"child {self.pid} ({self.start_method}) died without a result: {how}")
        status, payload, tb = msg
        if status == "error":
            raise payload from _RemoteTraceback(f"\n\nTraceback in child {self.pid}:\n{tb}")
        return payload


def start_in_process(fn: Callable[..., Any], *args: Any, start_method: str = "spawn",
                     timeout: float = 60.0, **kwargs: Any) -> ChildProcess:
    """Start ``fn(*args, **kwargs)`` in a child process; returns a :class:`ChildProcess`."""
    return ChildProcess(fn, *args, start_method=start_method, timeout=timeout, **kwargs)


def run_in_process(fn: Callable[..., Any], *args: Any, start_method: str = "spawn",
                   timeout: float = 60.0, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a child process and return its result (see ChildProcess)."""
    return ChildProcess(fn, *args, start_method=start_method, timeout=timeout, **kwargs).result()
