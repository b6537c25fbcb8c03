"""Locks this process keeps for all its threads, each given back free in a forked child.

A thread of the parent that holds such a lock as another thread forks does not exist in the
child, and the child's copy of the lock stays held: its first use would hang (inside the store
lock, for the interval lists: every other process's next structural operation then times out;
tests/test_fork_locks.py). ``renewed`` makes a lock and has it replaced by a new one in every
forked child, before the child's other after-fork hooks run (this module registers its hook
first: the modules that use it import it). Call sites keep the lock in a global or an
attribute and use it directly: nothing is added to taking it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renewed"]

LockT = TypeVar("LockT")
_RENEWED: list[tuple[Any, str, Callable[[], Any]]] = []  # (a module's globals or an object, its name, make)


def renewed(where: dict[str, Any] | object, name: str, make: Callable[[], LockT] = threading.Lock) -> LockT:  # type: ignore[assignment]
    """A new lock ``make()``, kept as ``where[name]`` (a module's ``globals()``) or ``where.name``
    (an object living as long as the process) now and a new one in every forked child."""
    lock = make()
    _put(where, name, lock)
    _RENEWED.append((where, name, make))
    return lock


def _put(where: Any, name: str, lock: object) -> None:
    if isinstance(where, dict):
        where[name] = lock
    else:
        setattr(where, name, lock)


def _after_fork_in_child() -> None:
    for where, name, make in _RENEWED:
        _put(where, name, make())


os.register_at_fork(after_in_child=_after_fork_in_child)
