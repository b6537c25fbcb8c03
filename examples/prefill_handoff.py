"""A stack: a long-lived parent owns the store; a prefill process hands sequences to decode workers.

- The parent creates the store and outlives everyone: the store lives as long as
  it does (see "Who creates the store" in the README).
- The prefill process computes a shared system prompt once, gives every request
  its own sequence with ``copy_prefix``, prefills the request's prompt, and for
  request 0 also ``fork``s a second branch (``capacity=`` leaves room for the
  whole decode, so the fork never moves). It hands the sequences over and
  exits: committed tokens stay, only its leases go.
- Decode workers take each sequence's lease and decode greedily on zero-copy views.
- The parent checks every result against one process without shmkv.

Run: python examples/prefill_handoff.py
"""

from __future__ import annotations

from _cli import run  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import multiprocessing as mp
import os
from typing import Any

import numpy as np
from toymodel import STORE_LAYOUT, Model, SeqCache, collect, decode_greedy, encode, reference_generate

import shmkv

SYSTEM = encode("You are a terse assistant. ")
PROMPTS = [encode(p) for p in ("What is a KV cache?", "Why share memory?", "Who frees a sequence?")]
NEW_TOKENS = 12
WORKERS = 2


def prefill(name: str, jobs: Any) -> None:
    store = shmkv.attach(name)
    model = Model()
    try:
        system = store.create_sequence(capacity=len(SYSTEM))
        model.forward(SeqCache(system), SYSTEM, np.arange(len(SYSTEM)))
        system.commit(tokens=SYSTEM)  # computed once, for every request
        for i, prompt in enumerate(PROMPTS):
            n = len(SYSTEM) + len(prompt)
            seq = store.create_sequence(capacity=n + NEW_TOKENS)  # room for the whole decode
            store.copy_prefix(system.id, seq.id, len(SYSTEM))
            pos = np.arange(len(SYSTEM), n)
            logits = model.forward(SeqCache(seq), prompt, pos)
            seq.commit(tokens=prompt, positions=pos)
            if i == 0:  # a second answer to the same prompt, starting from the runner-up token
                branch = seq.fork(capacity=n + NEW_TOKENS)
                branch.release()
                jobs.put((f"{i}b", branch.id, int(np.argsort(logits[-1])[-2])))
            seq.release()  # a worker takes the lease
            jobs.put((str(i), seq.id, None))
        system.free()  # its cells were copied: every request holds its own
    finally:
        for _ in range(WORKERS):
            jobs.put(None)
        store.close()  # an attached process never removes the store


def worker(name: str, jobs: Any, results: Any) -> None:
    store = shmkv.attach(name)
    model = Model()
    while (job := jobs.get()) is not None:
        request, seq_id, first = job
        seq = store.sequence(seq_id, write=True)  # the lease: this process alone appends
        out: list[int] = []
        logits = None
        if first is not None:  # the branch's forced first token
            pos = int(seq.positions[-1]) + 1
            logits = model.forward(SeqCache(seq), [first], [pos])
            seq.commit(tokens=[first], positions=[pos])
            out.append(first)
        out += decode_greedy(seq, model, NEW_TOKENS - len(out), logits)
        seq.release()
        results.put((request, seq_id, os.getpid(), out))
    store.close()


def main() -> None:
    name = f"handoff{os.getpid()}"
    ctx = mp.get_context("spawn")
    with shmkv.create(name, max_tokens=1024, max_seqs=16, **STORE_LAYOUT) as store:  # the parent owns it
        jobs, results = ctx.Queue(), ctx.Queue()
        pre = ctx.Process(target=prefill, args=(name, jobs))
        workers = [ctx.Process(target=worker, args=(name, jobs, results)) for _ in range(WORKERS)]
        for p in (pre, *workers):
            p.start()
        got = collect(results, len(PROMPTS) + 1, [pre, *workers])
        pre.join(60)
        print(f"prefill process exited (code {pre.exitcode}); the sequences it made live on in {name!r}")
        for p in workers:
            p.join(60)
        assert pre.exitcode == 0 and all(p.exitcode == 0 for p in workers)
        model = Model()
        for request, seq_id, pid, out in sorted(got):
            prompt = list(SYSTEM) + list(PROMPTS[int(request[0])])
            if request.endswith("b"):
                want = out[:1] + reference_generate(prompt + out[:1], NEW_TOKENS - 1, model)
            else:
                want = reference_generate(prompt, NEW_TOKENS, model)
            assert out == want, (request, out, want)
            seq = store.sequence(seq_id)
            assert seq.tokens[len(prompt) :].tolist() == out and seq.capacity == len(prompt) + NEW_TOKENS
            print(f"request {request} (seq {seq_id}, worker {pid}): {out} matches a single-process run")
    print("done: every request matches; the store was removed with its creator's close()")


if __name__ == "__main__":
    run(main, __doc__)
