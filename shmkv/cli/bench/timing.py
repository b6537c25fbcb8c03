"""Timing helpers of the benchmark scenarios: alternated runs, reading every byte, children's results."""

from __future__ import annotations

import os
import queue
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

Figures = dict[str, float]


# -- timing helpers ------------------------------------------------------------------------------


def alternated(fns: dict[str, Callable[[], float | None]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, all run in turn in every repeat (the order rotating).

    A function that returns a float has timed itself (its setup and cleanup untimed);
    otherwise its whole call is timed.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    for r in range(repeats):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for k in order:
            t0 = time.perf_counter()
            own = fns[k]()
            times[k].append(own if isinstance(own, float) else time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def touch(a: np.ndarray) -> int:
    """Read every byte of a contiguous array (what a consumer of handed-over data must do at least once)."""
    flat = a.reshape(-1).view(np.uint8)
    n = flat.size // 8 * 8
    return (int(flat[:n].view(np.uint64).max()) if n else 0) ^ int(flat[n:].sum())


def result_of(out: Any, *children: Any, timeout: float = 300.0) -> Any:
    """The next message on ``out`` from ``children``; raise at once, naming the child, when one dies.

    A child that exits with an error code, or all of them exiting without a message, ends the wait
    (a bare ``out.get(timeout=...)`` would sit out its whole timeout behind a crashed child).
    """
    t_end = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=0.05)
        except queue.Empty:
            pass
        dead = [c for c in children if c.exitcode not in (None, 0)]
        if dead or all(c.exitcode is not None for c in children):
            try:  # a message sent just before the exit may still be in the pipe
                return out.get(timeout=0.5)
            except queue.Empty:
                c = (dead or list(children))[0]
                raise RuntimeError(f"bench child {c.name} (pid {c.pid}) exited with code {c.exitcode} "
                                   "before sending its result") from None
        if time.monotonic() > t_end:
            for c in children:
                c.kill()
            raise RuntimeError(f"bench children {[c.name for c in children]} sent nothing in {timeout:.0f} s")


def kill(procs: list[Any]) -> None:
    """An error path's cleanup: children still running are killed at once and reaped."""
    reap(procs, grace=0)


def end_children() -> None:
    """Kill and reap every child process this process still has (after a Ctrl-C)."""
    import multiprocessing

    kill(multiprocessing.active_children())


def reap(procs: list[Any], grace: float = 10.0) -> None:
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join()


def as_bytes(a: np.ndarray) -> memoryview:
    """The array's own buffer as bytes (no copy)."""
    return memoryview(a).cast("B")  # type: ignore[arg-type]


def shm_scratch(tag: str) -> str:
    """A path in /dev/shm for a baseline's plain file (not a store: the leak checks ignore it)."""
    return os.path.join("/dev/shm", f"shmkv-bench-{os.getpid()}-{tag}")


def remove_scratch() -> None:
    """Remove every scratch file of this process (``shm_scratch``)."""
    prefix = os.path.basename(shm_scratch(""))
    for f in os.listdir("/dev/shm"):
        if f.startswith(prefix):
            try:
                os.unlink(os.path.join("/dev/shm", f))
            except FileNotFoundError:
                pass
