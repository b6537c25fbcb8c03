"""Children of tests/test_int8_mirror.py (module level, so spawn and forkserver can import them)."""

from __future__ import annotations

import numpy as np

import shmkv


def take_over_and_write(name: str, seq_id: int, n: int, seed: int) -> int:
    """Take the lease of ``seq_id``, append and commit ``n`` tokens, give the lease back."""
    store = shmkv.attach(name)
    try:
        seq = store.sequence(seq_id, write=True)
        lay = store.layout
        rng = np.random.default_rng(seed)
        for _ in range(n):
            for layer in range(lay.layers):
                k, v = rng.standard_normal((2, lay.kv_heads, lay.head_dim)).astype(np.float32)
                seq.append(layer, k, v)
            seq.commit()
        seq.release()
        return seq.length
    finally:
        store.close()
