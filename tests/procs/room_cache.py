"""Run in a private /dev/shm (a 16 MiB tmpfs: tests/_namespaces.py) for tests/test_create_cost.py:
/dev/shm filled by another file right after shmkv read the room, with that reading trusted for an
hour (``Room.TTL``): what an extend and a create over a cached prefix do. Prints one JSON line."""

from __future__ import annotations

import json
import os

import numpy as np

import shmkv
from shmkv._engine.memory import segment as _segment

L, H, D = 2, 8, 64  # float32: a cell of K and V over both layers is 8 KiB


def free_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def main() -> None:
    _segment.Room.TTL = 3600.0  # every grant the reading allows is made from it
    out: dict[str, object] = {}
    store = shmkv.create("room", layers=L, kv_heads=H, head_dim=D, dtype="float32", max_tokens=8192, max_seqs=8)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((L, 1200, H, D)).astype(np.float32)
    ids = np.arange(1200) + 100
    donor = store.create_sequence(capacity=1024)
    donor.extend(kv[:, :100], kv[:, :100], tokens=ids[:100])  # the room is read here
    donor.finish()
    ballast = "/dev/shm/ballast"  # everything left
    fd = os.open(ballast, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, free_bytes())
    os.close(fd)
    out["granted_stale"] = _segment.ROOM.grant(0) and _segment.ROOM.room > free_bytes() + (1 << 20)
    other = store.create_sequence(capacity=1024)
    try:
        other.extend(kv[:, :600], kv[:, :600], tokens=ids[:600] + 5000)
        out["extend_error"] = None
    except shmkv.CacheFullError:
        out["extend_error"] = "CacheFullError"
    try:  # (its small arrays' first pages are new: a miss, or the error; then its extend)
        s = store.create_sequence(capacity=1100, prefix=ids[:200])  # 100 tokens cached
        out["create_error"] = None
        try:
            s.extend(kv[:, len(s) : 200], kv[:, len(s) : 200], tokens=ids[len(s) : 200])
        except shmkv.CacheFullError:
            out["create_error"] = "CacheFullError"
        s.free()
    except shmkv.CacheFullError:
        out["create_error"] = "CacheFullError"
    d = store.sequence(donor.id)
    out["kept"] = bool(len(other) == 0 and len(d) == 100 and np.array_equal(d.keys(1), kv[1, :100])
                       and np.array_equal(d.tokens, ids[:100]))
    os.unlink(ballast)  # room again
    other.extend(kv[:, :600], kv[:, :600], tokens=ids[:600] + 5000)
    s = store.create_sequence(capacity=1100, prefix=ids[:200])
    n = len(s)
    s.extend(kv[:, n:200], kv[:, n:200], tokens=ids[n:200])
    out["after"] = bool(n == 100 and np.array_equal(s.keys(0), kv[0, :200])
                        and np.array_equal(other.values(1), kv[1, :600]))
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
