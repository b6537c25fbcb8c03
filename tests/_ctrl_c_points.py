"""Where CPython 3.11 can raise a Ctrl-C in shmkv's code, and a trace that delivers one there.

A signal's handler runs only where the interpreter checks for pending calls. In 3.11 that is
a function's first instruction, the next instruction once a call through C returns (a ``CALL``
of a Python function runs in the same loop, with no check as it returns; ``CALL_FUNCTION_EX``
and a class's call go through C), and a jump back that is taken. ``Points`` counts those points
in the code it watches and, at the ``fire``-th, calls the SIGINT handler installed at that
moment, as a real signal's would be: shmkv's own notes it inside lock-path code, Python's raises.

A point is left out where raising at the next instruction would go to another exception
handler than the interpreter's raise at the call or jump would (the two differ only where a
``try`` begins or ends between them), and inside a finalizer of earlier garbage (``__del__``,
a weakref callback, run at any moment): Python swallows an exception there, in any program.
"""

from __future__ import annotations

import dis
import gc
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import shmkv

PKG = os.path.dirname(shmkv.__file__) + os.sep
_AFTER_CALL = frozenset(("CALL", "CALL_FUNCTION_EX"))
_JUMPS_BACK = frozenset(n for n in dis.opname if n.startswith(("JUMP_BACKWARD", "POP_JUMP_BACKWARD")))


CLEAN = (0, False, [], True)  # what ``lock_path_state`` says between operations


def lock_path_state() -> tuple[Any, ...]:
    """This process's Ctrl-C state of the lock path: the holds counted, whether shmkv's handler is
    installed, the Ctrl-Cs deferred, whether Python's own handler is in place (``CLEAN``: none, no,
    none, yes)."""
    from shmkv._engine.locking import interrupts as _interrupts

    return (_interrupts._holds, _interrupts._installed, _interrupts.deferred,
            signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def reset_lock_path() -> None:
    """Put this process's lock path back to ``CLEAN`` (after a failed check: for the next test)."""
    from shmkv._engine.locking import interrupts as _interrupts

    _interrupts._holds, _interrupts._installed = 0, False
    _interrupts.deferred.clear()
    signal.signal(signal.SIGINT, signal.default_int_handler)


def descriptors(*prefixes: str, collect: bool = True) -> list[str]:
    """The files this process has open whose paths or names start with one of ``prefixes``; with
    ``collect``, after a collection if some are open (an object an interrupted call dropped in a
    reference cycle closes its own then)."""

    def scan() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefixes) or os.path.basename(target).startswith(prefixes):
                out.append(target)
        return sorted(out)

    found = scan()
    if not found or not collect:
        return found
    gc.collect()
    return scan()


def _in_finalizer(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code.co_filename.endswith("weakref.py"):
            return True
        frame = frame.f_back
    return False


class Points:
    """A ``sys.settrace`` function over the code whose file ``watch`` accepts (everything under
    shmkv by default): counts the points (``count``, starting at 1) and at the ``fire``-th (0:
    never) calls the installed SIGINT handler; ``where`` names the function it fired in. Run an
    operation under it with ``run``."""

    def __init__(self, fire: int = 0, watch: Callable[[str], bool] | None = None) -> None:
        self.fire = fire
        self.watch = watch if watch is not None else (lambda path: path.startswith(PKG))
        self.count = 0
        self.where = ""
        self._prev: dict[int, tuple[str, int]] = {}  # frame -> (its last opcode, its offset)
        self._ran_python: set[int] = set()  # frames whose call in progress ran a Python frame
        self._tables: dict[Any, list[Any]] = {}

    def run(self, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` under the trace; whether a KeyboardInterrupt came out of it."""
        sys.settrace(self)
        try:
            fn()
        except KeyboardInterrupt:
            return True
        finally:
            sys.settrace(None)
        return False

    @property
    def fired(self) -> bool:
        return 0 < self.fire <= self.count

    def _handler(self, code: Any, offset: int) -> int | None:
        """Where an exception raised at ``offset`` goes (its exception table's entry)."""
        table = self._tables.get(code)
        if table is None:
            table = self._tables[code] = dis._parse_exception_table(code)  # type: ignore[attr-defined]
        return next((e.target for e in table if e.start <= offset < e.end), None)

    def _point(self, frame: Any) -> None:
        if self.fired or _in_finalizer(frame):
            return
        self.count += 1
        if self.count == self.fire:
            sys.settrace(None)  # (the points after it are not counted: an interrupted run's count is its point)
            frame.f_trace = None
            self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}"
            handler = signal.getsignal(signal.SIGINT)
            assert callable(handler)
            handler(signal.SIGINT, frame)

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            off = frame.f_lasti
            name = dis.opname[frame.f_code.co_code[off]]
            was, at = self._prev.get(id(frame), ("", -1))
            # raised here, the KeyboardInterrupt must go where one raised by the call or the jump
            # would (the interpreter raises it there): where the two differ the point is left out
            if ((was in _AFTER_CALL and id(frame) not in self._ran_python) or (was in _JUMPS_BACK and off < at)) \
                    and self._handler(frame.f_code, off) == self._handler(frame.f_code, at):
                self._point(frame)
            self._ran_python.discard(id(frame))
            self._prev[id(frame)] = (name, off)
        return self._local

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        caller = frame.f_back
        if caller is not None and self._prev.get(id(caller), ("",))[0] == "CALL" and \
                frame.f_code.co_name not in ("__init__", "__new__"):  # (a class is called through C)
            self._ran_python.add(id(caller))  # (CALL_FUNCTION_EX always goes through C)
        if not self.watch(frame.f_code.co_filename):
            return None
        frame.f_trace_opcodes = True
        self._prev.pop(id(frame), None)
        self._ran_python.discard(id(frame))
        self._point(frame)  # its first instruction
        return None if self.fired else self._local
