"""Children of tests/test_journal.py.

``python tests/procs/journal.py sigint NAME``: lock-heavy operations in a loop; every
KeyboardInterrupt is caught (its traceback kept, as a REPL keeps it) and reported on
stdout as ``caught HELD DEPTH``: whether this process still holds the store lock, and its
open journaled transactions, right after the interrupt. ``ready`` first; ``pause`` on stdin
pauses it (``paused HELD DEPTH``) until the next line (``go``); stops at EOF on stdin.
"""

from __future__ import annotations

import io
import os
import select
import sys
import traceback

import numpy as np

import shmkv


def _kv(n: int) -> tuple[np.ndarray, np.ndarray]:
    k = np.ones((2, n, 2, 4), np.float32)
    return k, -k


def sigint_loop(name: str) -> None:
    store = shmkv.attach(name)
    w = store.create_sequence(capacity=64)
    w.extend(*_kv(8), tokens=np.arange(8))
    src = store.create_sequence(capacity=16)
    src.extend(*_kv(8), tokens=np.arange(100, 108))
    src.release()
    dst = store.create_sequence(capacity=16)
    dst.release()
    kept: list[BaseException] = []  # the last interrupt, with its traceback (and frames) alive
    print("ready", flush=True)
    i = 0
    report = ""
    bad: list[BaseException] = []
    while True:  # (only the except clause below and this loop's jump back run outside the try: both
        try:     # before the report is printed, which the test waits for before its next signal)
            while True:  # every jump back of the loop inside the try: a Ctrl-C there is caught too
                if report:  # outside the except clause: a Ctrl-C while printing is caught like any other
                    print(report, flush=True)
                    report = ""
                try:
                    i += 1
                    if _step(store, i, w, src, dst):
                        return
                except (shmkv.CacheFullError, shmkv.LeaseError, shmkv.SequenceNotFound):
                    # a create interrupted after it committed leaves a sequence without a handle: free those
                    for info in store.sequences():
                        if info.id not in (w.id, src.id, dst.id) and not info.lease_alive:
                            try:
                                store.sequence(info.id).free()
                            except shmkv.ShmkvError:
                                pass
        except KeyboardInterrupt as e:
            kept[:] = [e]
            report = f"caught {int(store._engine._lock.is_held)} {store._engine.journal.depth}"
            if report != "caught 0 0" and not bad:  # what went wrong, for the test's message
                bad.append(e)
                traceback.print_exception(e)


def _step(store: shmkv.Store, i: int, w: shmkv.Sequence, src: shmkv.Sequence, dst: shmkv.Sequence) -> bool:
    """One lock-heavy operation; True at EOF on stdin."""
    r = i % 7
    if r == 0:
        w.truncate(4)
        w.extend(*_kv(4), tokens=np.arange(4, 8))
    elif r == 1:
        with store.transaction():
            store.copy_prefix(src.id, dst.id, 4)
    elif r == 2:
        s = store.create_sequence(capacity=4)
        s.free()
    elif r == 3:
        store.save(io.BytesIO())
    elif r == 4:
        h = store.sequence(dst.id, write=True)
        h.release()
    elif r == 5:
        store.sequence(src.id).read(0)
    else:
        w.truncate(6)
        w.extend(*_kv(2), tokens=np.arange(6, 8))
    if i % 16 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        cmd = sys.stdin.readline()
        if not cmd:
            return True
        if cmd.strip() == "pause":  # (a "go" that a Ctrl-C kept from the wait below is read here: ignored)
            e = store._engine
            print(f"paused {int(e._lock.is_held)} {e.journal.depth}", flush=True)  # holding nothing until "go"
            if not sys.stdin.readline():
                return True
    return False


if __name__ == "__main__":
    if sys.argv[1] == "sigint":
        sigint_loop(sys.argv[2])
    sys.stdout.flush()
    os._exit(0)
