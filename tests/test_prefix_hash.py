"""The chained block hash that names prefixes (prefix cache index, Redis chunk keys)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from shmkv._engine.prefixes.hashes import BLOCK, ROOT, as_tokens, block_hashes


def test_definition_and_chaining():
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 50_000, 3 * BLOCK + 5)
    hs = block_hashes(toks)
    assert len(hs) == 3  # the trailing partial block has no hash
    h = ROOT
    for i in range(3):  # the documented definition, spelled out independently
        d = hashlib.blake2b(h.to_bytes(8, "little") + toks[i * BLOCK : (i + 1) * BLOCK].astype("<i8").tobytes(),
                            digest_size=8, person=b"shmkv-prefix-v1").digest()
        h = int.from_bytes(d, "little") & (2**63 - 1)
        assert hs[i] == h
    # a hash names the whole prefix: the same block after a different first block hashes differently
    other = toks.copy()
    other[0] += 1
    assert block_hashes(other)[1] != hs[1]
    # continuing from a parent gives the same values as hashing from the start
    assert block_hashes(toks[BLOCK:], parent=hs[0]) == hs[1:]
    assert block_hashes(toks, limit=2) == hs[:2]
    # dtype does not matter, values do
    assert block_hashes(toks.astype(np.int32)) == hs
    assert all(0 < h < 2**63 for h in hs)  # fits an int64 word of the shared index


def test_same_in_every_process_whatever_the_hash_seed():
    """Python's hash() of bytes is randomized per process; ours must not be (it names Redis keys)."""
    code = ("from shmkv._engine.prefixes.hashes import block_hashes; import numpy as np;"
            "print(block_hashes(np.arange(64) * 7919 % 50000))")
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                           capture_output=True, text=True, check=True).stdout for seed in (1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(np.arange(64) * 7919 % 50000))


def test_pinned_value():
    """A change of the function must come with a new HASH_VERSION: stored indexes and Redis keys use it."""
    assert block_hashes(np.arange(BLOCK))[0] == 0x75AEB2CDFD07696D


@pytest.mark.parametrize("bad", [np.zeros((2, 16), np.int64), np.zeros(16, np.float32)])
def test_bad_tokens(bad):
    with pytest.raises(ValueError, match="token ids"):
        as_tokens(bad)


def _by_definition(toks: np.ndarray) -> list[int]:
    out, h = [], ROOT
    raw = np.asarray(toks).astype("<i8").tobytes()
    for i in range(len(toks) // BLOCK):
        d = hashlib.blake2b(h.to_bytes(8, "little") + raw[i * 8 * BLOCK : (i + 1) * 8 * BLOCK],
                            digest_size=8, person=b"shmkv-prefix-v1").digest()
        h = int.from_bytes(d, "little") & (2**63 - 1)
        out.append(h)
    return out


def test_recent_prompts_shortcut_gives_the_same_values():
    """block_hashes reuses the hashes of a recent prompt's common whole-block prefix (a
    server hashes the same system prompt again and again): every value stays the definition's,
    for prompts that share any prefix with recent ones, diverge inside a block, or stop early."""
    rng = np.random.default_rng(11)
    system = rng.integers(0, 50_000, 40 * BLOCK)
    seen = [system, rng.integers(0, 50_000, 300)]
    for trial in range(120):
        base = seen[int(rng.integers(0, len(seen)))]
        k = int(rng.integers(0, len(base) + 1))
        toks = np.concatenate([base[:k], rng.integers(0, 50_000, int(rng.integers(0, 5 * BLOCK)))])
        if trial % 5 == 0 and len(toks):
            toks[int(rng.integers(0, len(toks)))] += 1  # one token differs somewhere
        want = _by_definition(toks)
        assert block_hashes(toks) == want, trial
        limit = int(rng.integers(0, len(want) + 2))
        assert block_hashes(toks, limit=limit) == want[:limit], trial
        if want:
            assert block_hashes(toks[BLOCK:], parent=want[0]) == want[1:], trial
        seen.append(toks)
    # the list returned is the caller's own: changing it changes nothing remembered
    hs = block_hashes(system)
    hs[0] = 1
    assert block_hashes(system) == _by_definition(system)
