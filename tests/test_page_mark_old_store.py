"""A store written by an older shmkv has no page mark (header word ``W_PAGE_MARK`` was
reserved: 0). Its first read-write attach sets it from the table and the pages the data
segment holds (review finding 1f of issue 23; ``_engine/page_mark.py``), so that a borrow over
cells that held pages punches them, as in a store this shmkv made."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _prefix_children import check, serve

import shmkv
from shmkv._engine import header as _header
from shmkv._engine import page_mark
from shmkv._engine.header import SPAN_CELLS, START
from shmkv._engine.prefix_hash import BLOCK
from shmkv.store._store import engine_of

# float32, 2 KV heads x 128 dims: 1 KiB a cell, a page unit of 4 cells (as tests/test_create_cost.py)
LAYOUT = dict(layers=2, kv_heads=2, head_dim=128, dtype="float32", max_tokens=4096, max_seqs=32)
PER_CELL = 2 * LAYOUT["layers"] * LAYOUT["kv_heads"] * LAYOUT["head_dim"] * 4  # K and V bytes


def P(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.int64)


def _held(st: shmkv.Store) -> int:
    """Bytes of memory the data segment holds (allocated pages)."""
    return os.fstat(engine_of(st)._dseg.fileno()).st_blocks * 512


def _counting_punches(monkeypatch) -> list[int]:
    from shmkv._engine import share

    calls: list[int] = []
    real = share._fallocate

    def counted(fd, mode, off, n):
        calls.append(n)
        return real(fd, mode, off, n)

    monkeypatch.setattr(share, "_fallocate", counted)
    return calls


def _as_an_older_shmkv_left_it(st: shmkv.Store) -> None:
    """Zero the page mark, as in a store an older shmkv wrote (the word was reserved)."""
    with st.transaction():
        engine_of(st).hdr[_header.W_PAGE_MARK] = 0


def _freed_pages_then_a_donor(st: shmkv.Store, system: np.ndarray) -> None:
    """Cells [0, 200) written then freed (pages stay), then a finished donor of ``system``
    (first fit: in the freed cells, so the table's highest range ends below the freed pages)."""
    old = st.create_sequence(capacity=200)
    k = np.ones((2, 150, 2, 128), np.float32)
    old.extend(k, k)
    old.free()
    d, _ = serve(st, system, capacity=len(system))
    d.finish()
    t = engine_of(st).table_np
    assert int((t[:, START] + t[:, _header.CAPACITY])[t[:, _header.STATE] != 0].max()) < 150


def test_an_attach_marks_the_pages_of_freed_cells_and_the_next_borrow_there_punches_them(make_store, monkeypatch):
    st = make_store(**LAYOUT)
    system = P(1, 4 * BLOCK)
    _freed_pages_then_a_donor(st, system)
    _as_an_older_shmkv_left_it(st)
    again = shmkv.attach(st.name)
    try:
        e = engine_of(again)
        # the freed sequence's 150 written cells: pages of 4 cells, so up to cell 152
        assert e.hdr[_header.W_PAGE_MARK] == 152
        punches = _counting_punches(monkeypatch)
        held = _held(again)
        s, n = serve(again, np.concatenate([system, [1, 2, 3]]))
        assert n == len(system) and s._row[SPAN_CELLS] == len(system)
        assert s._row[START] < 150  # in the freed cells, which hold pages
        assert len(punches) == len(e.shares.pieces)  # the span's own pages given back
        assert _held(again) <= held - (len(system) - 8) * PER_CELL
        check(s, np.concatenate([system, [1, 2, 3]]), again.layout)
    finally:
        again.close()


def test_pages_allocated_and_never_written_count(make_store):
    """fallocate'd pages that nothing wrote (a reservation ahead of a copy through the
    descriptor) are memory too: the mark covers them (SEEK_DATA would not see them)."""
    st = make_store(**LAYOUT)
    e = engine_of(st)
    a = st.create_sequence(capacity=16)
    a.extend(np.ones((2, 16, 2, 128), np.float32), np.ones((2, 16, 2, 128), np.float32))
    off, cb = e.shares.pieces[-1]  # the last array a span covers (V of the last layer)
    e._dseg.reserve([(off + 1000 * cb, 8 * cb)], populate=False)  # cells [1000, 1008), untouched
    _as_an_older_shmkv_left_it(st)
    again = shmkv.attach(st.name)
    try:
        assert engine_of(again).hdr[_header.W_PAGE_MARK] == 1008
    finally:
        again.close()


def test_where_the_kernel_cannot_tell_the_mark_is_the_whole_arena(make_store, monkeypatch):
    st = make_store(**LAYOUT)
    a = st.create_sequence(capacity=40)
    a.extend(np.ones((2, 20, 2, 128), np.float32), np.ones((2, 20, 2, 128), np.float32))
    _as_an_older_shmkv_left_it(st)

    def refused(fd: int, off: int, n: int) -> int:
        raise OSError(1, "cachestat: EPERM (a seccomp filter)")

    monkeypatch.setattr(page_mark, "pages_in", refused)
    again = shmkv.attach(st.name)
    try:
        assert engine_of(again).hdr[_header.W_PAGE_MARK] == LAYOUT["max_tokens"]
    finally:
        again.close()


def test_only_the_table_has_pages_the_mark_is_its_highest_end(make_store):
    """No pages beyond the live rows: the mark is the end of the highest range or span."""
    st = make_store(**LAYOUT)
    a = st.create_sequence(capacity=100)
    a.extend(np.ones((2, 10, 2, 128), np.float32), np.ones((2, 10, 2, 128), np.float32))
    end = int(a._row[START]) + 100
    _as_an_older_shmkv_left_it(st)
    again = shmkv.attach(st.name)
    try:
        assert engine_of(again).hdr[_header.W_PAGE_MARK] == end
    finally:
        again.close()


@pytest.mark.parametrize("history", [False, True])
def test_an_attach_leaves_a_set_mark_and_a_store_with_no_history_alone(make_store, history):
    st = make_store(**LAYOUT)
    e = engine_of(st)
    if history:
        st.create_sequence(capacity=64)
        mark = e.hdr[_header.W_PAGE_MARK]
        assert mark >= 64
    else:
        mark = 0  # no row was ever live: no pages, 0 is right
    again = shmkv.attach(st.name)
    try:
        assert engine_of(again).hdr[_header.W_PAGE_MARK] == mark
    finally:
        again.close()


def test_pages_in_counts_allocated_written_and_punched_pages(tmp_path):
    """The kernel's count the mark relies on (cachestat): fallocate'd pages count, holes do not."""
    import mmap

    from shmkv._engine import share
    from shmkv.testing import unique_name

    path = f"/dev/shm/{unique_name('pm')}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        try:
            assert page_mark.pages_in(fd, 0, 1 << 20) == 0
        except OSError as err:  # pragma: no cover  (a kernel before 6.5: the whole arena is the mark)
            pytest.skip(f"cachestat unavailable here: {err}")
        os.posix_fallocate(fd, 65536, 8192)
        os.pwrite(fd, b"x", 200_000)
        with mmap.mmap(fd, 1 << 20) as m:
            m[300_000] = 1
        assert page_mark.pages_in(fd, 0, 1 << 20) == 4
        assert page_mark.pages_in(fd, 65536 + 4096, 4096) == 1
        assert page_mark.pages_in(fd, 73728, 196_608 - 73728) == 0  # up to the page of byte 200,000
        assert page_mark.pages_in(fd, 299_999, 2) == 1
        assert share._fallocate(fd, share._PUNCH, 65536, 8192) == 0
        assert page_mark.pages_in(fd, 0, 1 << 20) == 2
    finally:
        os.close(fd)
        os.unlink(path)
