"""The per-process cache of free ranges: always what the table says, whoever changed it."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv.testing import run_in_process

SEED = 4096


def churn(name: str, seed: int, rounds: int) -> int:
    """Another process creating, growing and freeing sequences in the same store."""
    store = shmkv.attach(name)
    try:
        rng = np.random.default_rng(seed)
        live = []
        for _ in range(rounds):
            if live and rng.random() < 0.4:
                live.pop(int(rng.integers(len(live)))).free()
            else:
                s = store.create_sequence(capacity=int(rng.integers(1, 24)))
                s.extend(*np.ones((2, 2, int(rng.integers(1, 30)), 1, 4)))  # may grow (move)
                live.append(s)
        for s in live:
            s.release()
        return len(live)
    finally:
        store.close()


def check(store: shmkv.Store) -> None:
    with store.transaction():
        assert store._engine.free_ranges() == store._engine.arena._derive_free_ranges()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_cached_free_ranges_match_the_table(make_store, method):
    print(f"seed={SEED}")
    rng = np.random.default_rng(SEED)
    store = make_store(layers=2, kv_heads=1, head_dim=4, dtype="float32", max_tokens=2048, max_seqs=64)
    live: list[shmkv.Sequence] = []
    for i in range(150):
        op = rng.random()
        if live and op < 0.3:
            live.pop(int(rng.integers(len(live)))).free()
        elif live and op < 0.45:
            s = live[int(rng.integers(len(live)))]
            s.extend(*np.ones((2, 2, int(rng.integers(1, 40)), 1, 4)))  # grows, in place or by a move
        elif live and op < 0.55:
            s = live[int(rng.integers(len(live)))]
            s.truncate(int(rng.integers(0, s.length + 1)))
        elif len(live) > 1 and op < 0.65:
            a, b = rng.choice(len(live), 2, replace=False)
            if live[int(a)].length:
                store.copy_prefix(live[int(a)].id, live[int(b)].id, int(rng.integers(1, live[int(a)].length + 1)))
        elif live and op < 0.7:
            live.append(live[int(rng.integers(len(live)))].fork())
        else:
            s = store.create_sequence(capacity=int(rng.integers(1, 32)))
            s.extend(*np.ones((2, 2, int(rng.integers(0, 20)), 1, 4)))
            live.append(s)
        check(store)
        if i % 50 == 25:  # another process changes the table: this one's cache is stale, then right again
            run_in_process(churn, store.name, SEED + i, 20, start_method=method, timeout=120)
            check(store)
