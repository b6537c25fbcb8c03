"""A monitor follows decode workers with ``seq.wait``, notices one that died, and has it replaced.

Three workers decode one request each; worker 1 crashes half-way (``os._exit``,
as a segfault or the OOM killer would end it: no clean-up runs). The monitor,
a read-only attachment that cannot disturb anyone, waits for each sequence's
tokens with ``seq.wait(..., timeout=)`` (no sleeps of its own: a commit wakes
it within milliseconds). When a wait times out it looks at the lease: a sequence whose lease holder is dead and
which is not finished has lost its worker. The parent starts a replacement,
which takes the lease over and finishes.

Run: python examples/monitor.py
"""

from __future__ import annotations

from _cli import run  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import multiprocessing as mp
import os
from typing import Any

import numpy as np
from toymodel import STORE_LAYOUT, Model, SeqCache, collect, decode_greedy, encode, reference_generate

import shmkv

PROMPTS = [encode(p) for p in ("Monitor me:", "I will crash:", "Steady on:")]
NEW_TOKENS, CRASH_AFTER = 16, 6


def worker(name: str, seq_id: int, target: int, crash: bool) -> None:
    store = shmkv.attach(name)
    seq = store.sequence(seq_id, write=True)  # a replacement takes a dead worker's lease here
    if crash:
        decode_greedy(seq, Model(), CRASH_AFTER)
        os._exit(1)  # dies holding the lease, without any clean-up
    decode_greedy(seq, Model(), target - len(seq))  # carries on from the committed tokens
    seq.release()
    store.close()


def monitor(name: str, targets: dict[int, int], events: Any) -> None:
    store = shmkv.attach(name, readonly=True)  # read-only: it can look, never write
    seqs = {sid: store.sequence(sid) for sid in targets}
    reported: set[tuple[int, int]] = set()
    while seqs:
        for sid, seq in list(seqs.items()):
            try:
                n = seq.wait(targets[sid], timeout=0.05)  # returns as soon as the tokens are there
            except shmkv.WaitTimeout:
                info = next(s for s in store.sequences() if s.id == sid)
                if info.lease_pid and not info.lease_alive and (sid, info.lease_pid) not in reported:
                    reported.add((sid, info.lease_pid))
                    events.put(("dead", sid, info.lease_pid, info.length))
                continue
            events.put(("done", sid, n, None))
            del seqs[sid]
    store.close()


def main() -> None:
    name = f"monitor{os.getpid()}"
    ctx = mp.get_context("spawn")
    with shmkv.create(name, max_tokens=512, **STORE_LAYOUT) as store:
        targets = {}
        for prompt in PROMPTS:
            seq = store.create_sequence(capacity=len(prompt) + NEW_TOKENS)
            Model().forward(SeqCache(seq), prompt, np.arange(len(prompt)))
            seq.commit(tokens=prompt)
            seq.release()
            targets[seq.id] = len(prompt) + NEW_TOKENS
        events = ctx.Queue()
        mon = ctx.Process(target=monitor, args=(name, targets, events))
        mon.start()
        procs = [mon] + [ctx.Process(target=worker, args=(name, sid, targets[sid], i == 1))
                         for i, sid in enumerate(targets)]
        for p in procs[1:]:
            p.start()
        finished = 0
        while finished < len(targets):
            [(what, sid, a, b)] = collect(events, 1, [mon])
            if what == "dead":
                print(f"monitor: seq {sid} lost its worker (pid {a} is dead, length {b} of {targets[sid]}); "
                      "starting a replacement")
                procs.append(ctx.Process(target=worker, args=(name, sid, targets[sid], False)))
                procs[-1].start()
            else:
                finished += 1
                print(f"monitor: seq {sid} is complete ({a} tokens)")
        for p in procs:
            p.join(60)
        print("exit codes:", [p.exitcode for p in procs], "(the crashed worker: 1)")
        model = Model()
        for (sid, n), prompt in zip(targets.items(), PROMPTS, strict=True):
            out = store.sequence(sid).tokens[len(prompt) : n].tolist()
            assert out == reference_generate(prompt, NEW_TOKENS, model), sid
        print("every sequence matches a single-process run, the crashed one included")


if __name__ == "__main__":
    run(main, __doc__)
