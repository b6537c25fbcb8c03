"""Memory on demand (the bench's prefix_memory_ratio goal): a range's capacity is reserved as cells,
its pages are allocated only ahead of what is written (``_engine/memory/pages.py``,
``_sequence/room.py``), and never is a write made into a page that is not allocated: a full
/dev/shm is CacheFullError from the call that needs the room, nothing lost."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import shmkv

from shmkv._sequence.room import chunk
from shmkv.store._store import engine_of
from shmkv.testing import unique_name
import _namespaces

L, H, D = 2, 4, 64  # float16: 512 bytes of K (or V) per layer per cell, 8 cells a page
CAP = 8192
KV_CELL = 2 * L * H * D * 2  # K and V of every layer


def _chunk(store, capacity: int) -> int:
    e = engine_of(store)
    return chunk(capacity, e.page_unit, e.kv_bytes(e.layout.layers))


def _held(store) -> int:
    return os.fstat(engine_of(store)._dseg.fileno()).st_blocks * 512


def _kv(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((L, n, H, D)).astype(np.float16)


def _bounds(cells: list[int]) -> tuple[int, int]:
    """(least, most) bytes ranges of ``cells`` allocated cells hold: K/V exactly, token ids,
    positions and hashes (8 bytes a cell each) and page rounding at most, per range: a page at
    each end of each of the 2 x L K/V arrays and of the 3 small arrays, plus theirs."""
    page = mmap.PAGESIZE
    least = sum(c * KV_CELL for c in cells)
    most = sum(c * (KV_CELL + 24) + 2 * (2 * L + 3) * page for c in cells)
    return least, most


def test_large_capacities_hold_pages_only_for_what_is_written_plus_a_chunk(make_store):
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=6 * CAP, max_seqs=8)
    empty = _held(st)
    step = _chunk(st, CAP)
    assert step < CAP // 4
    # prefills only: the extend's tokens, exactly
    pre = []
    for i, n in enumerate((100, 333, 1000)):
        s = st.create_sequence(capacity=CAP)
        k = _kv(n, i)
        s.extend(k, k, tokens=np.arange(n))
        pre.append((s, k))
    least, most = _bounds([100, 333, 1000])
    assert least <= _held(st) - empty <= most
    # decodes: the first append past the prefill allocates one chunk, the next chunk when crossed
    dec = []
    for i, (n, steps) in enumerate(((100, 3), (50, step + 10))):
        s = st.create_sequence(capacity=CAP)
        k = _kv(n + steps, 10 + i)
        s.extend(k[:, :n], k[:, :n])
        for t in range(n, n + steps):
            for layer in range(L):
                s.append(layer, k[layer, t], k[layer, t])
            s.commit()
        dec.append((s, k))
    cells = [100, 333, 1000, 100 + step, 50 + 2 * step]
    least, most = _bounds(cells)
    held = _held(st) - empty
    assert least <= held <= most, (held, least, most)
    assert held < 5 * CAP * KV_CELL / 4  # not 5 whole capacities' pages
    for s, k in pre + dec:  # and every sequence reads what it wrote
        for layer in range(L):
            np.testing.assert_array_equal(s.keys(layer), k[layer, : len(s)])
    stats = st.stats()
    assert stats.reserved_tokens == 5 * CAP  # the cells are reserved in full: max_tokens accounting


def test_growth_and_a_move_allocate_only_what_they_copy(make_store):
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=4 * CAP, max_seqs=8)
    empty = _held(st)
    a = st.create_sequence(capacity=64)
    k = _kv(200, 1)
    a.extend(k[:, :64], k[:, :64])
    blocker = st.create_sequence(capacity=16)  # right after a: a's growth moves it
    blocker.extend(k[:, :16], k[:, :16])
    for t in range(64, 200):  # grows past its capacity twice: moved, then grown in place
        for layer in range(L):
            a.append(layer, k[layer, t], k[layer, t])
        a.commit()
    assert a.capacity >= 200
    for layer in range(L):
        np.testing.assert_array_equal(a.keys(layer), k[layer, :200])
    # the old range (64 cells, written), the blocker's 16, and in the new range at most what
    # was copied plus a chunk: never the whole new capacity's pages
    held = _held(st) - empty
    _, most = _bounds([64, 16, 200 + _chunk(st, a.capacity)])
    assert held <= most


CHILD = str(Path(__file__).parent / "procs" / "lazy_pages.py")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_full_dev_shm_during_appends_beyond_the_chunk_is_cache_full_and_nothing_is_lost(dtype):
    """In a 16 MiB /dev/shm (a private tmpfs) a sequence of a larger capacity is created, prefilled,
    and appended to one token at a time with room for one and a half chunks left: the append that
    crosses the first chunk is CacheFullError (no SIGBUS: the child exits 0), nothing committed is
    lost or changed, an extend that does not fit changes nothing either, and after the room is
    freed the same sequence appends and extends again."""
    why = _namespaces.available()
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must be able to make a private /dev/shm: {why}")
        pytest.skip(why)
    proc = _namespaces.in_private_shm([_namespaces.PY, CHILD, dtype], "16m", timeout=240)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["created"]  # a capacity larger than /dev/shm is cells, not memory
    assert out["append_error"] is not None and out["append_error"][:3] == ["CacheFullError", "ShmkvError",
                                                                           "MemoryError"], out
    assert "/dev/shm" in out["append_error"][3]
    # a float prefill allocates exactly its tokens (written through the descriptor), an int8 one
    # goes through append's checked path (a first chunk); then one more chunk fitted, the next not
    prefilled = 100 if dtype == "float32" else max(100, out["chunk"])
    assert out["failed_at"] == prefilled + out["chunk"], out
    assert out["length_after_append_error"] == out["failed_at"] == out["pending_after_append_error"]
    assert out["extend_error"] is not None and out["extend_error"][0] == "CacheFullError", out
    assert out["length_after_extend_error"] == out["failed_at"]
    assert out["read_ok"]
    assert out["final_length"] == out["failed_at"] + 601 and out["final_ok"], out


def test_a_loaded_snapshot_holds_pages_for_its_tokens_and_appends_after_them(make_store, tmp_path):
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=4 * CAP, max_seqs=8)
    ks = [_kv(n, n) for n in (70, 500)]
    for k in ks:
        s = st.create_sequence(capacity=CAP)
        s.extend(k, k, tokens=np.arange(k.shape[1]))
    path = tmp_path / "snap.shmkv"
    st.save(path)
    loaded = shmkv.load(path, name=unique_name())
    try:
        least, most = _bounds([70, 500])
        assert least <= _held(loaded) <= most
        seqs = {i.id: loaded.sequence(i.id, write=True) for i in loaded.sequences()}
        assert sorted(len(s) for s in seqs.values()) == [70, 500]
        for s in seqs.values():
            k = next(k for k in ks if k.shape[1] == len(s))
            extra = _kv(5, 99)
            for t in range(5):
                for layer in range(L):
                    s.append(layer, extra[layer, t], extra[layer, t])
                s.commit()
            for layer in range(L):
                np.testing.assert_array_equal(s.keys(layer), np.concatenate([k[layer], extra[layer]]))
        step = _chunk(loaded, CAP)
        _, most = _bounds([70 + step, 500 + step])
        assert _held(loaded) <= most
    finally:
        loaded.close()


def test_the_chunk_is_a_few_cells_at_least_an_eighth_of_the_capacity_and_at_most_64_mib():
    assert chunk(100, 8, 2048) == 64  # a small range: 64 cells
    assert chunk(100, 256, 2048) == 256  # at least a page unit (int8 scales' pages)
    assert chunk(8192, 8, 2048) == 1024  # an eighth of the capacity ...
    llama = 32 * 2 * 8 * 128 * 2  # 128 KiB a token
    assert chunk(131072, 8, llama) == 512  # ... up to 64 MiB of pages at a time
    assert chunk(131072, 8, llama) * llama == 64 << 20
