"""Speculative decoding: verify a draft in one pass, keep the accepted prefix, truncate the rest.

Run: python examples/speculative_rollback.py
"""

from __future__ import annotations

import os

import numpy as np

import shmkv
from shmkv._model import Model, SeqCache, encode, reference_generate


def main() -> None:
    model = Model()
    cfg = model.cfg
    rng = np.random.default_rng(7)
    name = f"spec{os.getpid()}"
    with shmkv.create(name, layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                      dtype="float32") as store:
        seq = store.create_sequence(capacity=256)
        prompt = encode("Speculate: ")
        logits = model.forward(SeqCache(seq), prompt, np.arange(len(prompt)))
        seq.commit(tokens=prompt)
        truth = reference_generate(model, np.zeros(0, np.int64), prompt, 24)  # plain greedy, no shmkv
        out: list[int] = []
        while len(out) < 16:
            # a "draft model" that is right 70% of the time; the first token is the target's own
            greedy = int(np.argmax(logits))
            guess = truth[len(out) + 1 : len(out) + 4]
            draft = [greedy] + [t if rng.random() < 0.7 else (t + 1) % 256 for t in guess]
            pos = np.arange(seq.length, seq.length + len(draft))
            all_logits = model.forward(SeqCache(seq), np.array(draft), pos, all_logits=True)
            seq.commit(tokens=draft, positions=pos)
            keep = 1
            while keep < len(draft) and int(np.argmax(all_logits[keep - 1])) == draft[keep]:
                keep += 1
            seq.truncate(seq.length - len(draft) + keep)  # roll back the rejected tokens
            out += draft[:keep]
            logits = all_logits[keep - 1]  # causal: the kept tokens' logits do not see the rejected ones
            print(f"drafted {len(draft)}, accepted {keep}, length {seq.length}")
        out = out[:16]
        # rollback left exactly what plain greedy decoding produces
        assert out == truth[:16], (out, truth[:16])
        assert seq.positions.tolist() == list(range(seq.length))
        print("tokens equal plain greedy decoding:", out)


if __name__ == "__main__":
    main()
