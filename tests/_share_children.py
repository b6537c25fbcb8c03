"""Child-process functions of tests/test_shared_prefix.py (module level, so spawn can import them)."""

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
