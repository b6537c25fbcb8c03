"""Chained hashes of token blocks: the names of prefixes.

The prefix cache (docs/design.md §8) indexes committed tokens by the hash of every whole
``BLOCK``-token block chained to the hash of everything before it, so one
64-bit value names a whole prefix, not just its last block:

    h[0] = ROOT
    h[i + 1] = blake2b-64(h[i] as 8 little-endian bytes || tokens of block i as int64 little-endian)
               with the top bit cleared (so a hash fits the int64 words of the index)

The Redis tier (§9) names its chunks with the same values (a chunk of
``chunk_tokens`` tokens, a multiple of ``BLOCK``, ending at token ``e`` is
named by ``h[e // BLOCK]``), so a chunk is found only after the same whole
prefix, on every machine.

The hash must be the same in every process and on every machine, for as long as
stores and Redis keys made with it live: never Python's ``hash()`` (randomized
per process for bytes). ``HASH_VERSION`` goes into every name built from it
(index layout, Redis key); change it with any change to the function.
Zero is never a hash value (index tables use it for an empty slot).
"""

from __future__ import annotations

import hashlib
from typing import NewType

import numpy as np

# A chained prefix hash, kept apart from token ids and cell numbers (both plain ints too).
PrefixHash = NewType("PrefixHash", int)

HASH_VERSION = 1
BLOCK = 16  # tokens a block: the granularity of the index (matches may still end anywhere)
_PERSON = b"shmkv-prefix-v1"  # blake2b personalization: a domain of our own
_MASK63 = (1 << 63) - 1
ROOT = PrefixHash(0x5348_4D4B_565F_5246)  # "SHMKV_RF": the hash of the empty prefix


_BASE = hashlib.blake2b(digest_size=8, person=_PERSON)  # copied: cheaper than a new personalised one

# The whole blocks of the last few prompts hashed from ROOT in this process, most recent first, with
# their hashes: a server sees the same system prompt again and again, and a create over a cached
# 2,048-token prefix would otherwise spend a third of its time hashing it. A prompt
# takes the hashes of its longest common whole-block prefix with one of them (the same tokens after
# ROOT: the same values) and hashes only the rest.
_RECENT: list[tuple[bytes, list[PrefixHash]]] = []
_RECENT_MAX = 8


def _h(parent: int, block: bytes) -> PrefixHash:
    d = _BASE.copy()
    d.update(parent.to_bytes(8, "little"))
    d.update(block)
    return PrefixHash((int.from_bytes(d.digest(), "little") & _MASK63) or 1)  # 0 is reserved for "empty"


def _recent(raw: bytes, t: np.ndarray, n: int) -> list[PrefixHash]:
    """The hashes of the longest whole-block prefix of ``raw`` (``t``'s first ``n`` blocks) that a
    recent prompt shares."""
    step = BLOCK * 8
    best: list[PrefixHash] = []
    for old_raw, old_hs in list(_RECENT):  # (a copy: another thread may add one meanwhile)
        k, b = min(len(old_hs), n), len(best)
        # to beat the best so far, it must share the block after it (and the first: one compare each)
        if k <= b or old_raw[b * step : (b + 1) * step] != raw[b * step : (b + 1) * step] or (
                b and old_raw[:step] != raw[:step]):
            continue
        # (whichever is the shorter is compared whole: no copy of 16 KiB slices)
        if raw.startswith(old_raw) if k == len(old_hs) else old_raw.startswith(raw):
            c = k
        else:
            bad = np.flatnonzero(np.frombuffer(old_raw, "<i8", k * BLOCK) != t[: k * BLOCK])
            c = int(bad[0]) // BLOCK
        if c > b:
            best = old_hs[:c]
            if c == n:
                break
    return best


def _remember(raw: bytes, hs: list[PrefixHash]) -> None:
    step = BLOCK * 8
    for i, (old_raw, _) in enumerate(list(_RECENT)):
        k = len(old_raw)  # (its last block first: a prompt that only shares a system prompt differs there)
        if k <= len(raw) and old_raw[k - step :] == raw[k - step : k] and raw.startswith(old_raw):
            del _RECENT[i : i + 1]  # this one holds it all and more
            break
    _RECENT.insert(0, (raw, hs))
    del _RECENT[_RECENT_MAX:]


def as_tokens(tokens: object) -> np.ndarray:
    """Token ids as a 1-d little-endian int64 array (no copy when they already are)."""
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"token ids must be 1-d, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype="<i8")


def block_hashes(tokens: object, parent: int = ROOT, limit: int | None = None) -> list[PrefixHash]:
    """Hashes after each whole block of ``tokens``: element i names tokens[: (i + 1) * BLOCK].

    ``parent`` is the hash of whatever precedes ``tokens`` (ROOT for a prefix starting at token 0);
    ``limit`` stops after that many blocks. A trailing partial block has no hash.
    """
    t = as_tokens(tokens)
    n = len(t) // BLOCK if limit is None else min(limit, len(t) // BLOCK)
    raw = t[: n * BLOCK].tobytes()
    step = BLOCK * 8
    out: list[PrefixHash] = _recent(raw, t, n) if parent == ROOT and n else []
    h, known = (out[-1] if out else parent), len(out)
    for i in range(known, n):
        h = _h(h, raw[i * step : (i + 1) * step])
        out.append(h)
    if parent == ROOT and n > known:
        _remember(raw, out)
    return list(out)


# The lead of a prefix: its first j tokens for j in LEAD, each named by lead_hash, so a prefix
# shorter than one block is found too (docs/design.md §8: token-granular from token 0). A lead of BLOCK
# tokens would be named like block 0 (the same bytes after ROOT): LEAD stays below BLOCK.
LEAD = (1, 2, 4, 8)
_LEVELS = tuple(sum(1 for j in LEAD if j <= n) for n in range(LEAD[-1] + 1))


def lead_levels(n: int) -> int:
    """How many leads fit in ``n`` tokens (0 for none: LEAD[:lead_levels(n)] are all <= n)."""
    return _LEVELS[n] if n < LEAD[-1] else len(LEAD)


def lead_hash(tokens: np.ndarray, j: int) -> PrefixHash:
    """The name of the first ``j`` tokens (``tokens`` as from as_tokens, at least j of them)."""
    return _h(ROOT, tokens[:j].tobytes())
