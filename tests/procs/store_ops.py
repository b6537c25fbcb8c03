"""Functions run in child processes by the tests (module level, so spawn can import them)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import shmkv


def value(seq: int, layer: int, pos: int, which: int = 0) -> float:
    """The known content of a cell: exact in float32 for the sizes the tests use."""
    return float(seq * 100_000 + pos * 16 + layer * 2 + which)


def token_kv(seq: int, layer: int, pos: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    return (np.full((heads, dim), value(seq, layer, pos, 0), np.float32),
            np.full((heads, dim), value(seq, layer, pos, 1), np.float32))


def write_sequence(name: str, n: int) -> int:
    """Attach, create a sequence, write n tokens over all layers, commit; return its id."""
    store = shmkv.attach(name)
    lay = store.layout
    seq = store.create_sequence(capacity=4)
    for pos in range(n):
        for layer in range(lay.layers):
            seq.append(layer, *token_kv(seq.id, layer, pos, lay.kv_heads, lay.head_dim))
        seq.commit(tokens=[1000 + pos])
    seq.release()
    seq_id = seq.id
    store.close()
    return seq_id


def writer_loop(name: str, seq_id: int, n: int, stall_every: int) -> int:
    """Append n tokens one at a time to seq_id, sometimes pausing between layers and commit."""
    store = shmkv.attach(name)
    lay = store.layout
    seq = store.sequence(seq_id, write=True)
    start = seq.length
    for pos in range(start, start + n):
        for layer in range(lay.layers):
            seq.append(layer, *token_kv(seq_id, layer, pos, lay.kv_heads, lay.head_dim))
            if stall_every and pos % stall_every == 0:
                time.sleep(0.0005)  # a reader now sees pending cells beyond length (it must not)
        seq.commit(tokens=[pos])
    store.close()
    return start + n


def reader_loop(name: str, seq_ids: list[int], target: int, deadline_s: float) -> dict[str, int]:
    """Read both sequences until each reaches ``target`` tokens; check every value seen."""
    store = shmkv.attach(name, readonly=True)
    lay = store.layout
    seqs = [store.sequence(i) for i in seq_ids]
    last = {i: 0 for i in seq_ids}
    reads = 0
    t_end = time.monotonic() + deadline_s
    while any(last[s.id] < target for s in seqs):
        if time.monotonic() > t_end:
            raise TimeoutError(f"writers too slow: lengths {last}")
        for s in seqs:
            for layer in range(lay.layers):
                k, v = s.read(layer)
                n = k.shape[0]
                if n < last[s.id] and layer == 0:
                    raise AssertionError(f"length went backwards for {s.id}: {n} < {last[s.id]}")
                pos = np.arange(n)
                want_k = s.id * 100_000 + pos * 16 + layer * 2
                got_k = k.reshape(n, lay.kv_heads * lay.head_dim)
                got_v = v.reshape(n, lay.kv_heads * lay.head_dim)
                if not (np.all(got_k == want_k[:, None]) and np.all(got_v == want_k[:, None] + 1)):
                    bad = int(np.flatnonzero(~np.all(got_k == want_k[:, None], axis=1))[0]) if n else -1
                    raise AssertionError(f"seq {s.id} layer {layer}: torn or foreign token at {bad} of {n}")
                if layer == 0:
                    last[s.id] = max(last[s.id], n)
                reads += 1
    store.close()
    return {"reads": reads, **{str(k): v for k, v in last.items()}}


def hold_lease(name: str, seq_id: int, ready_path: str) -> None:
    """Take the lease on seq_id, write one token, say so, then wait to be killed."""
    store = shmkv.attach(name)
    lay = store.layout
    seq = store.sequence(seq_id, write=True)
    pos = seq.length
    for layer in range(lay.layers):
        seq.append(layer, *token_kv(seq_id, layer, pos, lay.kv_heads, lay.head_dim))
    seq.commit()
    # a pending, uncommitted token that must never become visible
    seq.append(0, *token_kv(seq_id, 0, pos + 1, lay.kv_heads, lay.head_dim))
    with open(ready_path, "w") as f:
        f.write("ready")
    time.sleep(600)


def attach_and_exit(name: str, how: str) -> None:
    store = shmkv.attach(name)
    s = store.sequence(store.sequences()[0].id)
    assert s.length > 0
    if how == "kill":
        os.kill(os.getpid(), 9)
    if how == "close":
        store.close()
    # "exit": leave without closing; interpreter exit must not remove the store


def create_and_exit(name: str, persistent: bool, how: str) -> None:
    store = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=16, max_seqs=2,
                         persistent=persistent)
    seq = store.create_sequence(capacity=4)
    seq.extend(np.ones((1, 2, 1, 2)), np.ones((1, 2, 1, 2)))
    if how == "kill":
        os.kill(os.getpid(), 9)


def write_through_readonly_mapping(name: str) -> None:
    """Try to write into a read-only mapping with ctypes: must die by SIGSEGV."""
    import ctypes

    store = shmkv.attach(name, readonly=True)
    keys = store.sequence(store.sequences()[0].id).keys(0)
    addr = keys.__array_interface__["data"][0]
    ctypes.memset(addr, 0x7F, 4)
    raise AssertionError("wrote into a read-only mapping")


def save_forever(name: str, path: str, ready_path: str) -> None:
    """Save the store to ``path`` in a loop until killed."""
    store = shmkv.attach(name, readonly=True)
    first = True
    while True:
        store.save(path)
        if first:
            with open(ready_path, "w") as f:
                f.write("saved")
            first = False


def sliding_writer(name: str, seq_id: int, n: int) -> int:
    """Append n tokens one at a time; every value of a token is its position."""
    store = shmkv.attach(name)
    lay = store.layout
    seq = store.sequence(seq_id, write=True)
    for pos in range(n):
        x = np.full((lay.kv_heads, lay.head_dim), pos, np.float32)
        for layer in range(lay.layers):
            seq.append(layer, x, x)
        seq.commit()
    store.close()
    return n


def sliding_reader(name: str, seq_id: int, n: int, deadline_s: float) -> int:
    """Copy the sliding layer while the writer compacts it: always a consistent, recent run."""
    store = shmkv.attach(name, readonly=True)
    seq = store.sequence(seq_id)
    cells = store.layout.window_cells
    reads = 0
    t_end = time.monotonic() + deadline_s
    while True:
        k, _ = seq.read(1)
        vals = k[:, 0, 0]
        if vals.size:
            if not np.array_equal(vals, np.arange(vals[0], vals[0] + vals.size)) or vals.size > cells:
                raise AssertionError(f"sliding layer read torn or too long: {vals.tolist()}")
            if not np.all(k == vals[:, None, None]):
                raise AssertionError("a token's values disagree")
        reads += 1
        if vals.size and vals[-1] == n - 1:
            break
        if time.monotonic() > t_end:
            raise TimeoutError(f"writer too slow: last {vals.tolist()[-3:]}")
    store.close()
    return reads


def create_wait_exit(name: str, ready: str, go: str) -> None:
    """Create a non-persistent store, say so, wait for ``go``, then exit without closing it."""
    shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=16, max_seqs=2)
    with open(ready, "w") as f:
        f.write("created")
    deadline = time.monotonic() + 60
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError("go never came")
        time.sleep(0.005)


def create_and_drop(name: str) -> bool:
    """Create a store, drop the only handle, collect it; return whether the store still exists."""
    import gc

    store = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=16, max_seqs=2)
    del store
    gc.collect()
    return name in shmkv.list_stores()


def save_past_a_file_size_limit(name: str, path: str, limit: int) -> str:
    """Save store ``name`` to ``path`` with this process's files limited to ``limit`` bytes
    (RLIMIT_FSIZE, SIGXFSZ ignored: the write past it takes what fits, the next fails, EFBIG):
    what the save raised, by class name ("" if it returned)."""
    import resource
    import signal

    store = shmkv.attach(name, readonly=True)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        store.save(path)
        return ""
    except shmkv.ShmkvError as e:
        return type(e).__name__
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        store.close()


def use_after_the_creator_removed(store: shmkv.Store, seq_id: int, go: Any, out: Any) -> None:
    """In a child forked with ``store`` (the creator's handle): once ``go`` is set (the creator
    closed it: removed), read a sequence, then take the store lock; put what each did on ``out``."""
    go.wait(30)
    got = [float(store.sequence(seq_id).keys(0)[0, 0, 0])]
    try:
        with store.transaction():
            got.append("locked")
    except shmkv.StoreNotFound as e:
        got.append(f"StoreNotFound: {e}")
    out.put(got)
