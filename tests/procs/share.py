"""Child-process functions of tests/test_sharing_reads.py and test_sharing_interrupts.py (module
level, so spawn can import them)."""

from __future__ import annotations

import shmkv


def read_sequence(name: str, seq_id: int, readonly: bool) -> list[tuple[bytes, bytes]]:
    """In a child: attach and return every layer's committed keys and values as bytes."""
    store = shmkv.attach(name, readonly=readonly)
    try:
        seq = store.sequence(seq_id)
        return [(seq.keys(layer).tobytes(), seq.values(layer).tobytes()) for layer in range(store.layout.layers)]
    finally:
        store.close()


def read_inherited(seq: shmkv.Sequence, layers: int) -> list[tuple[bytes, bytes]]:
    """In a fork child: a handle inherited from the parent."""
    return [(seq.keys(layer).tobytes(), seq.values(layer).tobytes()) for layer in range(layers)]


def verifier(name: str, seconds: float) -> dict[str, int]:
    """Chaos reader (read-only): every committed cell of every live sequence holds the K/V of its
    token id (procs.crash.kv), read again and again while writers die around it; a read
    counts when the row's generation was even and unchanged around it."""
    import time

    import numpy as np
    from procs.crash import kv

    from shmkv._engine.table.header import GEN

    store = shmkv.attach(name, readonly=True)
    out = {"reads": 0, "changed": 0, "gone": 0, "timeouts": 0}
    t = store._engine.table_np
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for info in store.sequences():
                try:
                    s = store.sequence(info.id)
                    slot = s._r.slot
                    g = int(t[slot, GEN])
                    got = [s.read(layer) for layer in range(store.layout.layers)]
                    toks = s.tokens.copy()
                except shmkv.SequenceNotFound:
                    out["gone"] += 1
                    continue
                except shmkv.LockTimeout:
                    out["timeouts"] += 1
                    continue
                if g & 1 or int(t[slot, GEN]) != g or len(toks) != len(got[0][0]):
                    out["changed"] += 1
                    continue
                want_k, want_v = kv(toks, head_dim=store.layout.head_dim)
                for layer, (k, v) in enumerate(got):
                    np.testing.assert_array_equal(k, want_k[layer], err_msg=f"sequence {info.id} layer {layer} K")
                    np.testing.assert_array_equal(v, want_v[layer], err_msg=f"sequence {info.id} layer {layer} V")
                out["reads"] += 1
    finally:
        store.close()
    return out


def snapshotter(name: str, path: str, seconds: float) -> int:
    """Chaos snapshotter: saves the whole store again and again; returns how many saves."""
    import time

    store = shmkv.attach(name)
    n = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                store.save(path)
                n += 1
            except shmkv.LockTimeout:
                continue
    finally:
        store.close()
    return n
