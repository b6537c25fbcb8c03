"""Run in a private /dev/shm (a small tmpfs: tests/_namespaces.py) for tests/test_lazy_pages.py:
a sequence whose capacity is larger than /dev/shm appends and extends until /dev/shm is full,
then again after room is freed. Prints one JSON line of what it saw."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import shmkv
from shmkv._sequence.room import chunk
from shmkv.store._store import engine_of

L, H, D = 2, 8, 64  # float32: a cell of K and V over both layers is 8 KiB
CAP = 4096  # float32: 32 MiB of cells in a 16 MiB /dev/shm


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal as stored: exactly for float32, within the quantization step for int8."""
    if sys.argv[1] == "int8":
        return bool(np.allclose(np.asarray(got, np.float32), want, atol=float(np.abs(want).max()) / 100))
    return bool(np.array_equal(got, want))


def free_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def main() -> None:
    out: dict[str, object] = {}
    store = shmkv.create("lazy", layers=L, kv_heads=H, head_dim=D, dtype=sys.argv[1], max_tokens=CAP, max_seqs=4)
    rng = np.random.default_rng(0)
    ks = rng.standard_normal((L, CAP, H, D)).astype(np.float32)
    vs = rng.standard_normal((L, CAP, H, D)).astype(np.float32)
    seq = store.create_sequence(capacity=CAP)
    out["created"] = True
    seq.extend(ks[:, :100], vs[:, :100], tokens=np.arange(100))
    e = engine_of(store)
    out["chunk"] = chunk(CAP, e.page_unit, e.kv_bytes(L))
    ballast = "/dev/shm/ballast"  # leave room for 1.5 chunks: one chunk of appends fits, the next does not
    fd = os.open(ballast, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, free_bytes() - int(1.5 * int(out["chunk"]) * (store.bytes_per_token + 8)))
    os.close(fd)
    n = 100
    out["append_error"] = None
    while n < CAP:
        try:
            for layer in range(L):
                seq.append(layer, ks[layer, n], vs[layer, n])
        except shmkv.CacheFullError as e:
            out["append_error"] = [*[c.__name__ for c in type(e).__mro__][:3], str(e)]
            break
        seq.commit(tokens=[n])
        n += 1
    out["failed_at"] = n
    out["length_after_append_error"] = len(seq)
    out["pending_after_append_error"] = seq.commit()  # nothing pending: the length as it was
    try:
        seq.extend(ks[:, n : n + 600], vs[:, n : n + 600], tokens=np.arange(n, n + 600))
        out["extend_error"] = None
    except shmkv.CacheFullError as e:
        out["extend_error"] = [*[c.__name__ for c in type(e).__mro__][:3], str(e)]
    out["length_after_extend_error"] = len(seq)
    other = shmkv.attach("lazy", readonly=True)  # another attachment reads what was committed
    r = other.sequence(seq.id)
    out["read_ok"] = bool(all(same(r.keys(i), ks[i, :n]) and same(r.values(i), vs[i, :n])
                              for i in range(L)) and np.array_equal(r.tokens, np.arange(n)))
    os.unlink(ballast)  # room again
    for layer in range(L):
        seq.append(layer, ks[layer, n], vs[layer, n])
    seq.commit(tokens=[n])
    seq.extend(ks[:, n + 1 : n + 601], vs[:, n + 1 : n + 601], tokens=np.arange(n + 1, n + 601))
    m = n + 601
    out["final_length"] = len(seq)
    out["final_ok"] = bool(all(same(seq.keys(i), ks[i, :m]) and same(seq.values(i), vs[i, :m])
                               for i in range(L)) and np.array_equal(seq.tokens, np.arange(m)))
    other.close()
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
