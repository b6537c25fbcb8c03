"""Several decode workers append to their own sequences of one store; the parent reads them.

Run: python examples/multi_worker.py
"""

from __future__ import annotations

from _cli import run  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import multiprocessing as mp
import os

import numpy as np

import shmkv

LAYERS, HEADS, DIM, TOKENS = 4, 2, 16, 32


def worker(name: str, seq_id: int) -> None:
    store = shmkv.attach(name)  # attaching never removes the store on exit
    seq = store.sequence(seq_id, write=True)  # take the write lease
    for pos in range(TOKENS):
        for layer in range(LAYERS):
            k = np.full((HEADS, DIM), seq_id * 1000 + pos, np.float32)
            _keys, _values = seq.append(layer, k, -k)  # zero-copy views, ready for attention
        seq.commit(tokens=[pos])  # visible to every process from here
    store.close()


def main() -> None:
    name = f"multi{os.getpid()}"
    with shmkv.create(name, layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype="float32") as store:
        ids = []
        for _ in range(3):
            seq = store.create_sequence(capacity=TOKENS)
            seq.release()  # hand the lease to a worker
            ids.append(seq.id)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(name, i)) for i in ids]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0, p.exitcode
        for i in ids:
            k = store.sequence(i).keys(LAYERS - 1)
            assert k.shape == (TOKENS, HEADS, DIM) and k[-1, 0, 0] == i * 1000 + TOKENS - 1
            print(f"sequence {i}: {len(store.sequence(i))} tokens, last key {k[-1, 0, 0]:.0f}")
    # leaving the with block closed the creator's handle: the store is gone
    assert name not in shmkv.list_stores()


if __name__ == "__main__":
    run(main, __doc__)
