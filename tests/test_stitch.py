"""Stitched views (docs/design.md §11): one contiguous array over pages of a file taken
from several places, unmapped when its last array is gone."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from procs.stitch import read_inherited, read_stitched

import shmkv
from shmkv._engine.spans import stitch
from shmkv.testing import run_in_process

PAGE = stitch.PAGE


@pytest.fixture
def file(tmp_path):
    """A 16-page file, page i filled with byte i; (path, read-write descriptor)."""
    path = tmp_path / "pages"
    path.write_bytes(b"".join(bytes([i]) * PAGE for i in range(16)))
    fd = os.open(path, os.O_RDWR)
    yield str(path), fd
    os.close(fd)


def pages_of(a: np.ndarray) -> list[int]:
    return [int(x) for x in a.reshape(-1, PAGE)[:, 0]]


def test_pieces_in_order_read_and_write_through(file):
    path, fd = file
    s = stitch.Stitch(fd, [(3 * PAGE, 2 * PAGE), (10 * PAGE, PAGE), (0, 1)])
    a = s.array(np.uint8, (4 * PAGE,))
    assert pages_of(a) == [3, 4, 10, 0]
    assert a.flags.c_contiguous and a.flags.writeable
    a[PAGE * 2 : PAGE * 3] = 99  # page 10 of the file
    with open(path, "rb") as f:
        f.seek(10 * PAGE)
        assert f.read(PAGE) == bytes([99]) * PAGE
    os.pwrite(fd, bytes([7]) * PAGE, 3 * PAGE)  # a write to the file is seen through the stitch
    assert pages_of(a)[0] == 7
    v = s.array(np.float32, (2, PAGE // 4), offset=PAGE)  # other dtypes and shapes over it
    assert v.shape == (2, PAGE // 4) and v.view(np.uint8)[0, 0] == 4


@pytest.mark.slow
def test_the_mapping_lives_as_long_as_its_last_view(file):
    _, fd = file
    gc.collect()
    start = stitch.live()
    a = stitch.Stitch(fd, [(PAGE, PAGE), (5 * PAGE, PAGE)]).array(np.uint8, (2 * PAGE,))
    tail = a[PAGE:]  # a view of a view: it holds the mapping too
    assert stitch.live() == start + 1
    del a
    gc.collect()
    assert stitch.live() == start + 1 and pages_of(tail) == [5]
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(tail)
    del tail
    gc.collect()
    assert stitch.live() == start + 1 and int(t[0]) == 5
    del t
    gc.collect()
    assert stitch.live() == start
    many = [stitch.Stitch(fd, [(i % 16 * PAGE, PAGE)]).array(np.uint8, (PAGE,)) for i in range(50)]
    assert stitch.live() == start + 50 and [pages_of(m)[0] for m in many] == list(range(16)) * 3 + [0, 1]
    del many
    gc.collect()
    assert stitch.live() == start


def test_read_only_stitch(file):
    path, _ = file
    fd = os.open(path, os.O_RDONLY)
    try:
        a = stitch.Stitch(fd, [(2 * PAGE, PAGE)], writable=False).array(np.uint8, (PAGE,))
        assert not a.flags.writeable and pages_of(a) == [2]
        with pytest.raises(ValueError):
            a[0] = 1
    finally:
        os.close(fd)


@pytest.mark.parametrize("pieces", [[], [(100, PAGE)], [(0, PAGE + 1), (PAGE, PAGE)], [(0, 0)], [(-PAGE, PAGE)],
                                    [(16 * PAGE, 1)], [(15 * PAGE, PAGE + 1)]])
def test_bad_pieces(file, pieces):
    _, fd = file
    with pytest.raises(shmkv.InvalidArgumentError, match="piece"):
        stitch.Stitch(fd, pieces)


def test_a_view_past_the_stitch_is_refused(file):
    _, fd = file
    s = stitch.Stitch(fd, [(0, PAGE)])
    with pytest.raises(shmkv.InvalidArgumentError, match="do not fit"):
        s.array(np.uint8, (PAGE + 1,))


def test_kernel_refusal_is_a_stitch_error():
    with pytest.raises(stitch.StitchError) as e:
        stitch.Stitch(-1, [(0, PAGE)])  # no descriptor
    assert isinstance(e.value, shmkv.ShmkvError) and isinstance(e.value, OSError)


def test_another_process_reads_the_same_bytes(file):
    path, fd = file
    pieces = [(7 * PAGE, PAGE), (2 * PAGE, PAGE)]
    a = stitch.Stitch(fd, pieces).array(np.uint8, (2 * PAGE,))
    a[0] = 200
    want = a.tolist()
    assert run_in_process(read_stitched, path, pieces, 2 * PAGE, start_method="spawn", timeout=60) == want
    assert run_in_process(read_inherited, a, start_method="fork", timeout=60) == want


def test_over_a_store_layer(make_store):
    """The store's per-layer arrays start on pages: page_unit cells from a multiple of page_unit
    are whole pages, so a layer's cells from two places stitch into one array (docs/design.md §11)."""
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        st = make_store(layers=3, kv_heads=2, head_dim=8, dtype=dtype, max_tokens=4096, max_seqs=4)
        off, u = st._engine._off, st._engine._off.page_unit
        assert off.layer_stride % PAGE == 0 and off.scale_stride % PAGE == 0
        assert (u * off.cell_bytes) % PAGE == 0 and (u * 2 * 4 * (dtype == "int8")) % PAGE == 0
        rng = np.random.default_rng(0)
        K = st._engine.K
        raw = K.view(np.uint8) if K.dtype != np.uint8 else K
        raw[...] = rng.integers(0, 127, raw.shape, dtype=np.uint8)  # every cell of every layer
        fd = st._engine._dseg._fd
        for layer in range(3):
            base = off.k_off + layer * off.layer_stride
            pieces = [(base + 2 * u * off.cell_bytes, u * off.cell_bytes), (base + 0, 5 * off.cell_bytes)]
            a = stitch.Stitch(fd, pieces).array(K.dtype, (u + 5, 2, 8))
            np.testing.assert_array_equal(a, np.concatenate([K[layer, 2 * u : 3 * u], K[layer, :5]]))
        if dtype == "int8":
            base = off.ks_off + off.scale_stride
            s = stitch.Stitch(fd, [(base + u * 8, u * 8), (base, 8)]).array(np.float32, (u + 1, 2))
            np.testing.assert_array_equal(s, np.concatenate([st._engine.KS[1, u : 2 * u], st._engine.KS[1, :1]]))
        del a
        st.close()


@pytest.mark.slow
def test_cache_is_bounded_and_releases(file):
    _, fd = file
    gc.collect()
    start = stitch.live()
    cache = stitch.StitchCache(limit=4)
    built = []

    def build(i):
        def f():
            built.append(i)
            return stitch.Stitch(fd, [(i % 16 * PAGE, PAGE)]).array(np.uint8, (PAGE,))
        return f

    a = cache.get((1, 0, 0), build(1))
    assert cache.get((1, 0, 0), build(99)) is a and built == [1]  # cached: not built again
    held = cache.get((2, 0, 0), build(2))
    for i in range(3, 9):
        cache.get((i, 0, 0), build(i))
    gc.collect()
    assert len(cache) == 4 and stitch.live() == start + 4 + 2  # the cache's 4 + the two held here
    del a
    gc.collect()
    assert stitch.live() == start + 5 and pages_of(held) == [2]  # a dropped entry held by a caller stays
    cache.release(8)
    cache.release(7)
    gc.collect()
    assert len(cache) == 2 and stitch.live() == start + 3
    cache.clear()
    del held
    gc.collect()
    assert stitch.live() == start
    with pytest.raises(shmkv.InvalidArgumentError, match="limit"):
        stitch.StitchCache(limit=0)
