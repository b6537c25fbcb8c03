"""Speculative decoding: verify a draft in one pass, keep the accepted prefix, truncate the rest.

A "draft model" proposes 4 tokens (right about 70% of the time); the target
model runs them in one forward pass, the accepted prefix stays and
``seq.truncate`` rolls the rejected tokens back. The result is exactly what
plain greedy decoding gives.

Run: python examples/speculative_rollback.py
"""

from __future__ import annotations

from _cli import run  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import os

import numpy as np
from toymodel import STORE_LAYOUT, Model, SeqCache, encode, reference_generate

import shmkv

NEW_TOKENS = 16


def main() -> None:
    model = Model()
    rng = np.random.default_rng(7)
    prompt = encode("Speculate: ")
    truth = reference_generate(prompt, NEW_TOKENS + 4, model)  # plain greedy, no shmkv
    name = f"spec{os.getpid()}"
    with shmkv.create(name, max_tokens=256, **STORE_LAYOUT) as store:
        seq = store.create_sequence(capacity=len(prompt) + NEW_TOKENS + 4)
        logits = model.forward(SeqCache(seq), prompt, np.arange(len(prompt)))
        seq.commit(tokens=prompt)
        out: list[int] = []
        while len(out) < NEW_TOKENS:
            # the draft: the target's own next token, then 3 guesses that are right ~70% of the time
            guess = truth[len(out) + 1 : len(out) + 4]
            draft = [int(np.argmax(logits[-1]))] + [t if rng.random() < 0.7 else (t + 1) % 64 for t in guess]
            pos = np.arange(len(seq), len(seq) + len(draft))
            all_logits = model.forward(SeqCache(seq), draft, pos)  # the whole draft in one pass
            seq.commit(tokens=draft, positions=pos)
            keep = 1
            while keep < len(draft) and int(np.argmax(all_logits[keep - 1])) == draft[keep]:
                keep += 1
            seq.truncate(len(seq) - len(draft) + keep)  # roll the rejected tokens back
            out += draft[:keep]
            logits = all_logits[:keep]  # causal: the kept tokens' logits never saw the rejected ones
            print(f"drafted {len(draft)}, accepted {keep}, length {len(seq)}")
        assert out[:NEW_TOKENS] == truth[:NEW_TOKENS], (out, truth)
        assert seq.positions.tolist() == list(range(len(seq)))
        print("tokens equal plain greedy decoding:", out[:NEW_TOKENS])


if __name__ == "__main__":
    run(main, __doc__)
