"""A decode worker is killed (SIGKILL) mid-step; a replacement takes its sequence over and finishes.

The dead worker's committed tokens stay; its half-written step (keys of one
layer appended, never committed) is invisible and simply overwritten. While
the first worker lives, its lease cannot be taken (``LeaseError``); once it is
dead, ``store.sequence(id, write=True)`` takes it.

Run: python examples/worker_takeover.py
"""

from __future__ import annotations

from _cli import run  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
from toymodel import (HEAD_DIM, KV_HEADS, STORE_LAYOUT, Model, SeqCache, collect, decode_greedy, encode,
                      reference_generate)

import shmkv

PROMPT = encode("Once upon a time")
NEW_TOKENS, BEFORE_CRASH = 20, 8


def first_worker(name: str, seq_id: int, stuck: Any) -> None:
    store = shmkv.attach(name)
    seq = store.sequence(seq_id, write=True)
    decode_greedy(seq, Model(), BEFORE_CRASH)
    seq.append(0, np.zeros((KV_HEADS, HEAD_DIM)), np.zeros((KV_HEADS, HEAD_DIM)))  # a step begun, not committed
    stuck.set()  # tell the parent (a real worker would just be hung or crashing here)
    signal.pause()  # wait to be killed


def replacement(name: str, seq_id: int, results: Any) -> None:
    store = shmkv.attach(name)
    seq = store.sequence(seq_id, write=True)  # the holder is dead: the lease is free to take
    done = len(seq) - len(PROMPT)
    results.put((os.getpid(), done, decode_greedy(seq, Model(), NEW_TOKENS - done)))
    seq.release()
    store.close()


def main() -> None:
    name = f"takeover{os.getpid()}"
    ctx = mp.get_context("spawn")
    with shmkv.create(name, max_tokens=256, **STORE_LAYOUT) as store:
        seq = store.create_sequence(capacity=len(PROMPT) + NEW_TOKENS)
        Model().forward(SeqCache(seq), PROMPT, np.arange(len(PROMPT)))
        seq.commit(tokens=PROMPT)  # the prefill
        seq.release()
        stuck = ctx.Event()
        a = ctx.Process(target=first_worker, args=(name, seq.id, stuck))
        a.start()
        if not stuck.wait(120):
            raise RuntimeError(f"the first worker did not get going (exit code {a.exitcode})")
        try:
            store.sequence(seq.id, write=True)
        except shmkv.LeaseError as e:
            print(f"while worker {a.pid} lives: LeaseError: {e}")
        else:
            raise AssertionError("a live worker's lease was taken")
        os.kill(a.pid, signal.SIGKILL)
        a.join(30)
        info = next(s for s in store.sequences() if s.id == seq.id)
        print(f"worker {a.pid} killed by SIGKILL ({a.exitcode}) after {info.length - len(PROMPT)} tokens; "
              f"lease pid {info.lease_pid}, alive: {info.lease_alive}")
        results = ctx.Queue()
        b = ctx.Process(target=replacement, args=(name, seq.id, results))
        b.start()
        [(pid, done, rest)] = collect(results, 1, [b])
        b.join(30)
        print(f"worker {pid} took the lease over at token {done} and decoded {len(rest)} more")
        out = store.sequence(seq.id).tokens[len(PROMPT) :].tolist()
        want = reference_generate(PROMPT, NEW_TOKENS)
        assert out == want, (out, want)
        print(f"all {NEW_TOKENS} tokens match a single process that never crashed: {out}")


if __name__ == "__main__":
    run(main, __doc__)
