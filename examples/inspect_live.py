"""Inspect a store that a writer process is filling, read-only, without disturbing it.

The inspector learns that the writer is ready from an event (never from a
guessed delay) and follows its progress with ``seq.wait``.

Run: python examples/inspect_live.py
"""

from __future__ import annotations

from _cli import run  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import multiprocessing as mp
import os
from typing import Any

import numpy as np

import shmkv

TOKENS = 200


def writer(name: str, seq_id: int, ready: Any, stop: Any) -> None:
    store = shmkv.attach(name)
    seq = store.sequence(seq_id, write=True)
    ready.set()  # the lease is ours: the inspector may look
    for t in range(TOKENS):
        seq.extend(np.full((2, 1, 2, 8), t), np.zeros((2, 1, 2, 8)), tokens=[t])
    stop.wait(60)  # stay (holding the lease) until the inspector is done
    store.close()


def main() -> None:
    name = f"live{os.getpid()}"
    with shmkv.create(name, layers=2, kv_heads=2, head_dim=8, max_tokens=4096) as store:
        seq = store.create_sequence(capacity=TOKENS)
        seq.release()
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        p = ctx.Process(target=writer, args=(name, seq.id, ready, stop))
        p.start()
        try:
            if not ready.wait(120):
                raise RuntimeError(f"the writer did not start (exit code {p.exitcode})")
            with shmkv.attach(name, readonly=True) as inspector:  # maps read-only: it cannot write
                live = inspector.sequence(seq.id)
                for target in range(40, TOKENS + 1, 40):
                    n = live.wait(target, timeout=60)  # returns once the writer has committed that many
                    info = inspector.sequences()[0]
                    print(f"seq {info.id}: length {n} >= {target}, lease held by pid {info.lease_pid} "
                          f"(alive: {info.lease_alive}); store uses {inspector.stats().bytes_used} bytes")
                print("first tokens:", live.tokens[:8].tolist(), "last key:", float(live.keys(1)[-1, 0, 0]))
        finally:
            stop.set()
            p.join(60)


if __name__ == "__main__":
    run(main, __doc__)
