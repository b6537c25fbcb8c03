"""Continuous batching: one forward pass per step over every active sequence (store.forward).

Requests join and leave the batch between steps: request 2 arrives at step 3
and is prefilled inside the same forward pass that decodes the others (its
prompt tokens are rows of the batch beside their one new token each);
requests leave when they have their tokens. ``batch.put`` gives, per layer,
the keys and values of every row's sequence and a mask in which each row sees
exactly its own sequence's earlier tokens.

Run: python examples/batch_forward.py
"""

from __future__ import annotations

from _cli import run  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import os
from typing import Any

import numpy as np
from toymodel import STORE_LAYOUT, Model, encode, reference_generate

import shmkv

REQUESTS = [  # (prompt, new tokens, step at which it arrives)
    (encode("The cat"), 10, 0),
    (encode("A shared cache is"), 6, 0),
    (encode("Late arrival:"), 8, 3),
]


class BatchCache:
    """The batch as the model's cache: put() gives K, V and the batch mask."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def put(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> tuple[Any, Any, Any]:
        return self.batch.put(layer, k, v)


def main() -> None:
    model = Model()
    name = f"batch{os.getpid()}"
    with shmkv.create(name, max_tokens=512, **STORE_LAYOUT) as store:
        seqs: dict[int, Any] = {}  # request -> write handle (this process holds the leases)
        feed: dict[int, list[int]] = {}  # request -> tokens to run in the next step
        out: dict[int, list[int]] = {i: [] for i in range(len(REQUESTS))}
        step = 0
        while step == 0 or seqs:
            for i, (prompt, n, arrives) in enumerate(REQUESTS):
                if arrives == step:
                    seqs[i] = store.create_sequence(capacity=len(prompt) + n)  # room for all of it
                    feed[i] = list(prompt)
            ids, positions, tokens, last_row = [], [], [], {}
            for i, seq in seqs.items():
                start = len(seq)
                ids += [seq.id] * len(feed[i])
                positions += range(start, start + len(feed[i]))
                tokens += feed[i]
                last_row[i] = len(ids) - 1
            with store.forward(ids, positions, tokens=tokens) as batch:
                logits = model.forward(BatchCache(batch), tokens, np.array(positions))
                batch.commit()  # every row's tokens become visible together
            print(f"step {step}: one forward pass, {len(ids)} new tokens of requests {sorted(seqs)}")
            for i in list(seqs):
                tok = int(np.argmax(logits[last_row[i]]))
                out[i].append(tok)
                feed[i] = [tok]
                if len(out[i]) == REQUESTS[i][1]:  # done: it leaves the batch
                    seqs.pop(i).release()
            step += 1
        for i, (prompt, n, _) in enumerate(REQUESTS):
            want = reference_generate(prompt, n, model)
            assert out[i] == want, (i, out[i], want)
            print(f"request {i}: {out[i]} matches decoding it alone without shmkv")


if __name__ == "__main__":
    run(main, __doc__)
