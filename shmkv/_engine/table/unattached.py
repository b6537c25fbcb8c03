"""A store's header as a process reads it without attaching (no engine exists there): an attach
waiting for its creator's magic word and checking the header once, a removal comparing a
store's identity, gc and the pytest plugin judging its owners (``origin_of``). The word indices stay here and
in ``header.py``; callers get values.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from shmkv._engine.table.header import (
    C_KEY,
    C_PID,
    CLIENT_WORDS,
    FIXED_BYTES,
    FORMAT_VERSION,
    LAYER_KINDS_OFF,
    MAGIC,
    MAX_LAYERS,
    W_CREATOR_CLIENT,
    W_CREATOR_PID,
    W_DATA_BYTES,
    W_GENERATION,
    W_IDENTITY,
    W_LAYERS,
    W_MAGIC,
    W_NEXT_ID,
    W_PERSISTENT,
    W_SESSION,
    W_VERSION,
    Offsets,
)
from shmkv._engine.memory.segment import Segment

__all__ = ["Origin", "clients_of", "creator_of", "data_bytes_of", "fixed_words", "identity_of",
           "origin_of", "other_version", "persistent_of", "published", "read_key"]


def fixed_words(hseg: Segment) -> np.ndarray | None:
    """The fixed block of a header segment as int64 words (a view the caller drops before it
    closes the segment), None when the segment is too short to hold it."""
    return hseg.array(np.int64, FIXED_BYTES // 8) if hseg.size >= FIXED_BYTES else None


def published(words: np.ndarray) -> bool:
    """Whether the creator has written the magic word (it writes it last)."""
    return int(words[W_MAGIC]) != 0


def identity_of(words: np.ndarray) -> int | None:
    """The store identity of a header with the shmkv magic (a version-1 header holds 0 there:
    never a store we know), else None."""
    return int(words[W_IDENTITY]) if int(words[W_MAGIC]) == MAGIC else None


class Origin(NamedTuple):
    """Where a store comes from: the session tag of the test run (or the environment) that created
    it (0: none), its identity, and its creator's pid (for display only) and client key."""

    session: int
    identity: int
    creator_pid: int
    creator_client: int


def origin_of(words: np.ndarray) -> Origin | None:
    """The origin of a header with the shmkv magic, else None."""
    if int(words[W_MAGIC]) != MAGIC:
        return None
    return Origin(int(words[W_SESSION]), int(words[W_IDENTITY]), int(words[W_CREATOR_PID]),
                  int(words[W_CREATOR_CLIENT]))


def other_version(words: np.ndarray) -> bool:
    """Whether the header is a shmkv store of another format version (its tables are not ours to read)."""
    return int(words[W_MAGIC]) == MAGIC and int(words[W_VERSION]) != FORMAT_VERSION


def creator_of(words: np.ndarray) -> tuple[int, int]:
    """(pid, client key) of the store's creator (the pid for display only)."""
    return int(words[W_CREATOR_PID]), int(words[W_CREATOR_CLIENT])


def persistent_of(words: np.ndarray) -> bool:
    """Whether the store outlives its creator's close."""
    return bool(words[W_PERSISTENT])


def data_bytes_of(words: np.ndarray) -> int:
    """The data segment's size the header names (``header.read`` checked it against the layout)."""
    return int(words[W_DATA_BYTES])


def clients_of(hseg: Segment, off: Offsets, max_clients: int) -> list[tuple[int, int]]:
    """(pid, client key) of every row of the client table, in slot order (an empty row: (0, 0))."""
    rows = hseg.array(np.int64, max_clients * CLIENT_WORDS, off.client_off).reshape(-1, CLIENT_WORDS)
    out: list[tuple[int, int]] = [(int(p), int(k)) for p, k in rows[:, [C_PID, C_KEY]].tolist()]
    return out


# The words header.read() checks: the fixed block's first 22 but the generation and next id, which
# change (their bytes are zeroed in a key).
_KEY_WORDS, _CHANGING = 22, (W_GENERATION, W_NEXT_ID)


def read_key(words: np.ndarray, raw: np.ndarray, size: int) -> bytes:
    """What ``header.read`` decides from: the words it checks, the layer kinds and the segment's
    size. Two headers with the same key read the same (a cache of read()'s answers keys on it)."""
    kinds = LAYER_KINDS_OFF + min(max(int(words[W_LAYERS]), 0), MAX_LAYERS)
    key = bytearray(words[:_KEY_WORDS].tobytes())  # (a slice: no fancy index, cold in a fresh process)
    for w in _CHANGING:
        key[8 * w : 8 * w + 8] = bytes(8)
    return bytes(key) + raw[LAYER_KINDS_OFF:kinds].tobytes() + size.to_bytes(8, "little")
