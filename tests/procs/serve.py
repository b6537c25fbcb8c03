"""Children of tests/test_bench_serve.py (module level, so spawn can import them; no torch)."""

from __future__ import annotations

import shmkv
from shmkv._engine.clients import futex
from shmkv.cli.bench import serve_stack


def await_then_match(name: str, prompt: list[int], want: int, ready_path: str) -> tuple[int, int]:
    """A serving worker's wait for another process's prefill. Says through ``ready_path`` when it
    first goes to sleep on the futex; returns what the store then holds of ``prompt`` and how many
    times it slept."""
    real, slept = futex.wait, []

    def recorded(addr: int, expected: int, timeout: float | None) -> bool:
        if not slept:
            with open(ready_path, "w") as f:
                f.write("sleeping")
        slept.append(timeout)
        return real(addr, expected, timeout)

    futex.wait = recorded
    store = shmkv.attach(name)
    try:
        serve_stack.await_prefix(store, prompt, want, timeout=60.0)
        return store.match_prefix(prompt), len(slept)
    finally:
        store.close()
