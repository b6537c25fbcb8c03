"""Children of tests/test_wait.py (module level, so spawn and forkserver can import them)."""

from __future__ import annotations

import time

import shmkv


def wait_for_commit(name: str, seq_id: int, ready_path: str) -> tuple[int, int, list[tuple[float | None, bool]]]:
    """Attach read-only, say so through ``ready_path``, wait for the first commit.

    Returns (length returned by wait, time.monotonic_ns() when it returned, each futex wait of
    the wait as (its timeout, what it returned: False when it timed out)).
    """
    from shmkv._engine.clients import futex

    sleeps: list[tuple[float | None, bool]] = []
    real = futex.wait

    def recorded(addr: int, expected: int, timeout: float | None) -> bool:
        woke = real(addr, expected, timeout)
        sleeps.append((timeout, woke))
        return woke

    futex.wait = recorded
    store = shmkv.attach(name, readonly=True)
    try:
        seq = store.sequence(seq_id)
        with open(ready_path, "w") as f:
            f.write("ready")
        n = seq.wait(1, timeout=120)
        return n, time.monotonic_ns(), sleeps
    finally:
        futex.wait = real
        store.close()


def wait_read_write(name: str, seq_id: int, length: int | None, timeout: float | None,
                    readonly: bool = False) -> tuple[str, int | str]:
    """Attach (read-write, or read-only: a registered futex waiter either way), wait; ("ok", length)
    or ("error", its class name)."""
    store = shmkv.attach(name, readonly=readonly)
    try:
        seq = store.sequence(seq_id)
        try:
            return "ok", seq.wait(length, timeout=timeout)
        except shmkv.ShmkvError as e:
            return "error", type(e).__name__
    finally:
        store.close()


def close_or_remove(name: str, what: str) -> str:
    """Attach read-write and close again ("close"), or remove the store by name ("remove")."""
    if what == "remove":
        shmkv.remove(name)
    else:
        shmkv.attach(name).close()
    return what
