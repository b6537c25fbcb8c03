"""A process that owns a live store while CLI commands inspect it."""

from __future__ import annotations

import time

import numpy as np

import shmkv


def own_store(name: str, ready_path: str, seconds: float) -> None:
    """Create ``name``, write to it, say so through ``ready_path``, and stay alive ``seconds``
    (the test ends it sooner with a signal): the store lives as long as the test needs it."""
    store = shmkv.create(name, layers=2, kv_heads=2, head_dim=4, dtype="float32", max_tokens=512, max_seqs=4)
    seq = store.create_sequence(capacity=400)  # no growth: a structural change would be the owner's
    seq.extend(np.ones((2, 5, 2, 4)), np.ones((2, 5, 2, 4)), tokens=[10, 11, 12, 13, 14])
    with open(ready_path, "w") as f:
        f.write("ready")
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        if seq.length < 400:  # a writer that keeps appending while the commands look
            seq.extend(np.ones((2, 1, 2, 4)), np.ones((2, 1, 2, 4)), tokens=[seq.length])
        time.sleep(0.01)
    store.close()
