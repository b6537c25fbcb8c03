"""Functions the remote-tier tests run in child processes (module level, so spawn can import them)."""

from __future__ import annotations

import os
import time

import shmkv


def push_when_told(name: str, seq_id: int, tier: object, go: str, ready: str) -> int:
    """Attach read-only, signal ready, wait for the ``go`` file, push; return the chunks written."""
    store = shmkv.attach(name, readonly=True)
    try:
        with open(ready, "w"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError("the parent never said go")
            time.sleep(0.001)
        return int(tier.push(store, seq_id))  # type: ignore[attr-defined]
    finally:
        tier.close()  # type: ignore[attr-defined]
        store.close()
