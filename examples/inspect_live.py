"""Inspect a store that a writer process is filling, read-only, without disturbing it.

Run: python examples/inspect_live.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

import shmkv


def writer(name: str, seq_id: int, stop: mp.synchronize.Event) -> None:
    store = shmkv.attach(name)
    seq = store.sequence(seq_id, write=True)
    while not stop.is_set() and seq.remaining_capacity > 0:
        seq.extend(np.ones((2, 1, 2, 8)), np.ones((2, 1, 2, 8)), tokens=[seq.length])
        time.sleep(0.002)
    store.close()


def main() -> None:
    name = f"live{os.getpid()}"
    with shmkv.create(name, layers=2, kv_heads=2, head_dim=8, max_tokens=4096) as store:
        seq = store.create_sequence(capacity=2048)
        seq.release()
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        p = ctx.Process(target=writer, args=(name, seq.id, stop))
        p.start()
        inspector = shmkv.attach(name, readonly=True)  # maps read-only: it cannot write
        try:
            for _ in range(5):
                time.sleep(0.1)
                info = inspector.sequences()[0]
                st = inspector.stats()
                print(f"seq {info.id}: length {info.length}, lease held by pid {info.lease_pid} "
                      f"(alive: {info.lease_alive}); store uses {st.bytes_used} bytes")
            print("first tokens:", inspector.sequence(seq.id).tokens[:8].tolist())
        finally:
            inspector.close()
            stop.set()
            p.join(30)


if __name__ == "__main__":
    main()
