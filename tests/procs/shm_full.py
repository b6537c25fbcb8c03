"""Run inside a private mount namespace (``unshare -m``) whose /dev/shm is a tiny tmpfs, for
tests/test_shm_full.py: create stores while /dev/shm has no inode (or byte) left for one of
the store's files, and print one JSON line per attempt: the error's classes and message, and
what was left in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

import shmkv


def remount(**opts: object) -> None:
    spec = ",".join(f"{k}={v}" for k, v in opts.items())
    subprocess.run(["umount", "/dev/shm"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", spec, "tmpfs", "/dev/shm"], check=True)


def attempt(label: str, fn) -> None:
    try:
        fn()
        out = {"label": label, "ok": True}
    except Exception as e:
        out = {"label": label, "ok": False, "classes": [c.__name__ for c in type(e).__mro__], "msg": str(e)}
    out["left"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(out), flush=True)


def create(name: str) -> None:
    shmkv.create(name, layers=1, kv_heads=1, head_dim=2, dtype="float32", max_tokens=64, max_seqs=4).close()


def main() -> None:
    # a store is 5 files (.life, .h, .d, .lock, .live): every count short of that fails somewhere else
    for inodes in range(1, 6):
        remount(size="4M", nr_inodes=inodes)
        attempt(f"inodes={inodes}", lambda inodes=inodes: create(f"full{inodes}"))
    remount(size="4M", nr_inodes=6)
    attempt("inodes=6", lambda: create("full6"))  # room for exactly one store: it works
    remount(size="1M")
    big = shmkv.create("big", layers=2, kv_heads=4, head_dim=64, dtype="float32", max_tokens=4096, max_seqs=8)

    def fill() -> None:
        seq = big.create_sequence(capacity=2048)
        seq.extend(np.ones((2, 2048, 4, 64)), np.ones((2, 2048, 4, 64)))

    attempt("bytes", fill)
    big.close()


if __name__ == "__main__":
    sys.exit(main())
