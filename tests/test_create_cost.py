"""What a create over a cached prefix does not do (the bench's prefix_request_vs_extend1 goal), and
that each shortcut gives what the long way gives: the stand-in scan asks only rows whose next
token fits; a borrow keeps this process's free ranges; the room of /dev/shm and memory is read
at most once per short while; /proc/meminfo is read through a descriptor kept open."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from procs.prefix import check, serve

import _namespaces
from shmkv._engine.table import header as _header
from shmkv._engine.memory import segment as _segment
from shmkv._engine.table.header import LENGTH, LIVE, RECENCY, SEQ_WORDS, START, STATE, ID
from shmkv._engine.prefixes.hashes import BLOCK, block_hashes
from shmkv._engine.prefixes.scan import copies, table_holders
from shmkv.store._store import engine_of
from shmkv.testing import unique_name

# float32, 2 KV heads x 128 dims: 1 KiB a cell, a page unit of 4 cells (reuses borrow pages)
LAYOUT = dict(layers=2, kv_heads=2, head_dim=128, dtype="float32", max_tokens=4096, max_seqs=32)


def P(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.int64)


def _copies_the_long_way(e, key: tuple[int, int], t: np.ndarray, n: int) -> list[tuple[int, int]]:
    """copies() the long way: every row asked for ``key``, then kept if its next token is ``t[n]``."""
    rows = np.frombuffer(e.index._rows, np.int64).reshape(-1, SEQ_WORDS)
    got = [s for _, s, _ in table_holders(rows, e._hashes, [key], -1, every=True)]
    got = [s for s in got if rows[s, LENGTH] > n and e.tokens[rows[s, START] + n] == t[n]]
    got.sort(key=lambda s: -rows[s, RECENCY])
    return [(int(rows[s, ID]), s) for s in got]


def test_the_stand_in_scan_finds_what_a_scan_of_every_row_finds(make_store):
    """Copies of a 48-token system prompt that went on with the same, other or no tokens, some
    freed, one holding the next token under another prefix: for every next token, copies()
    names exactly the rows, in the order, that asking every row for the block gives."""
    st = make_store(**LAYOUT)
    e = engine_of(st)
    system = P(1, 3 * BLOCK)
    d, _ = serve(st, system)
    d.finish()
    nexts = [7, 7, 9, 7, 11, 9]  # several copies with the same next token: most recent first
    seqs = []
    for i, tok in enumerate(nexts):
        s, n = serve(st, np.concatenate([system, [tok], P(20 + i, 5) + 30_000]))
        assert n == len(system) + (tok in nexts[:i])  # (found through the stand-in scan)
        seqs.append(s)
    seqs[3].free()  # a freed row keeps its cells' token ids: never a copy
    other = P(99, 3 * BLOCK)
    o, _ = serve(st, np.concatenate([other, [7, 8]]))  # token 7 at cell 48, another prefix
    assert st.match_prefix(np.concatenate([system, [7, 1, 2]])) == len(system) + 1
    hs = block_hashes(system)
    key = (int(hs[-1]), len(hs) - 1)
    for tok in (7, 9, 11, 12):
        t = np.concatenate([system, [tok, 5]])
        want = _copies_the_long_way(e, key, t, len(system))
        got = copies(e.index._rows, e._hashes, e.tokens, key, t=t, n=len(system))
        assert got == want
        assert len(got) == {7: 2, 9: 2, 11: 1, 12: 0}[tok]
        assert o.id not in [i for i, _ in got]
    assert copies(e.index._rows, e._hashes, e.tokens, key, t=system, n=len(system)) == []  # nothing after it


def _gaps_current(e) -> bool:
    return e.arena._free.tag == e.hdr[_header.W_ALLOCS]


def _check_gaps(st) -> None:
    e = engine_of(st)
    with st.transaction():
        assert e.free_ranges() == e.arena._derive_free_ranges()


def test_a_borrow_keeps_the_free_ranges_and_they_stay_right(make_store):
    """A create that borrows its donor's pages leaves this process's free ranges current (no
    derivation from the table at the next create), and they equal the table's through frees
    of donors and borrowers, a donor's truncate into lent cells (it moves), a borrower's
    copy-on-write, eviction and a crash-free rollback."""
    st = make_store(**LAYOUT)
    e = engine_of(st)
    system = P(1, 4 * BLOCK)
    d, _ = serve(st, system)
    d.finish()
    reqs = []
    for i in range(4):
        _check_gaps(st)  # (derived, current)
        assert _gaps_current(e)
        s, n = serve(st, np.concatenate([system, P(10 + i, 9) + 30_000]))
        assert n == len(system) and s._row[_header.SPAN_CELLS] > 0  # it borrowed
        assert _gaps_current(e)  # ... and the gaps were not made stale by the borrow
        _check_gaps(st)
        reqs.append(s)
    derived = []
    real = e.arena._derive_free_ranges

    def counting(*a, **k):
        derived.append(1)
        return real(*a, **k)

    e.arena._derive_free_ranges = counting
    try:
        s, n = serve(st, np.concatenate([system, P(50, 9) + 30_000]))
        assert n == len(system) and s._row[_header.SPAN_CELLS] > 0
        assert derived == []  # the whole create went by the kept gaps
    finally:
        del e.arena._derive_free_ranges
    reqs.append(s)
    reqs[0].truncate(BLOCK)  # a borrower into its span: copy-on-write
    _check_gaps(st)
    reqs[1].free()
    _check_gaps(st)
    d2 = st.sequence(d.id, write=True)  # the donor taken back and cut into what it lent: it moves
    d2.truncate(BLOCK + 3)
    _check_gaps(st)
    d2.free()
    _check_gaps(st)
    check(reqs[0], system[:BLOCK], st.layout)
    reqs[0].finish()
    for s in reqs[2:]:
        check(s, np.concatenate([system, s.tokens[len(system):]]), st.layout)
        s.finish()
    # eviction of borrowers and the span freed with its last borrower
    big = st.create_sequence(capacity=st.layout.max_tokens - 3 * len(system))
    _check_gaps(st)
    assert big.capacity == st.layout.max_tokens - 3 * len(system)
    assert not (e.table_np[:, _header.SPAN_CELLS][e.table_np[:, STATE] == LIVE]).any()


def test_a_rolled_back_borrow_leaves_free_ranges_that_are_right(make_store, monkeypatch):
    """An exception after the borrow (inside the create's transaction) rolls it back: the gaps are
    derived again, and equal the table's."""
    from shmkv._engine.locking import crash as _crash

    st = make_store(**LAYOUT)
    system = P(1, 4 * BLOCK)
    d, _ = serve(st, system)
    d.finish()
    serve(st, np.concatenate([system, [1, 2, 3]]))
    _check_gaps(st)

    class Boom(Exception):
        pass

    def point(name: str) -> None:
        if name == "create.copied":
            raise Boom

    monkeypatch.setattr(_crash, "point", point)
    with pytest.raises(Boom):
        st.create_sequence(capacity=200, prefix=np.concatenate([system, [4, 5, 6]]))
    monkeypatch.undo()
    _check_gaps(st)
    s, n = serve(st, np.concatenate([system, [4, 5, 6]]))
    assert n == len(system)
    _check_gaps(st)
    check(s, np.concatenate([system, [4, 5, 6]]), st.layout)


def test_the_room_is_granted_from_a_recent_reading_only_while_half_of_it_is_left(monkeypatch):
    # a reading is "recent" for an hour here: at the real 50 ms TTL a process descheduled between
    # a reading and its grant (a loaded machine) would see the grant refused for its age instead
    monkeypatch.setattr(_segment.Room, "TTL", 3600.0)
    r = _segment.Room()
    assert not r.grant(1)  # never read
    r.read(1000, 100)
    assert r.grant(300)  # 100 + 300 spent: at most half of 1000
    assert r.grant(100)
    assert not r.grant(1)  # 501 > 500: read again
    r.read(1000, 0)
    r.at -= r.TTL * 2  # an old reading: read again, whatever it says
    assert not r.grant(1)
    r.read(None, 0)  # the room unknown: never granted from
    assert not r.grant(0) and not r.grant(1)
    r.read(1 << 40, 0)  # a large room: still at most CAP granted from one reading (several
    assert r.grant(r.CAP)  # processes granting half of it each would eat the memory margin)
    assert not r.grant(1)


def test_a_request_the_reading_cannot_grant_reads_the_room_again(monkeypatch):
    """check_room reads the room when the last reading cannot grant, and refuses what the new
    reading does not hold (the room fell meanwhile: another process filled /dev/shm)."""
    reads = []
    room = [1 << 30]

    def fake() -> int:
        reads.append(1)
        return room[0]

    monkeypatch.setattr(_segment, "_room_bytes", fake)
    monkeypatch.setattr(_segment, "ROOM", _segment.Room())
    monkeypatch.setattr(_segment.Room, "TTL", 3600.0)  # (the second check's grant: not refused for age under load)
    seg = _segment.Segment.create(unique_name("room"), 1 << 30)  # (sparse: nothing allocated)
    try:
        page = _segment.mmap.PAGESIZE
        seg.check_room([(0, 10 * page)])
        assert len(reads) == 1
        seg.check_room([(0, 10 * page)])
        assert len(reads) == 1  # granted from the reading
        room[0] = 5 * page  # /dev/shm filled meanwhile
        with pytest.raises(_segment.CacheFullError, match="room for"):
            seg.check_room([(0, 1 << 29)])  # more than half of the reading: read again
        assert len(reads) == 2
        with pytest.raises(_segment.CacheFullError):
            seg.check_room([(0, 10 * page)])  # the new reading grants nothing it does not hold
        assert len(reads) == 3
        seg.check_room([(0, 2 * page)])
    finally:
        seg.close()
        seg.unlink()


CHILD = str(Path(__file__).parent / "procs" / "room_cache.py")


def test_a_dev_shm_filled_right_after_a_reading_refuses_cleanly():
    """In a 16 MiB private /dev/shm: right after a reading of the room (an extend), another file
    fills /dev/shm; with the reading trusted for an hour, the next extend and create over a
    prefix are CacheFullError (the allocation refuses: no SIGBUS, the child exits 0), nothing
    committed changes, and with room again both work."""
    why = _namespaces.available()
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must be able to make a private /dev/shm: {why}")
        pytest.skip(why)
    proc = _namespaces.in_private_shm([_namespaces.PY, CHILD], "16m", timeout=240)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["granted_stale"], out  # the full /dev/shm was not read before the refusals
    assert out["extend_error"] == "CacheFullError", out
    assert out["create_error"] == "CacheFullError", out
    assert out["kept"] and out["after"], out


def test_meminfo_is_read_again_through_a_new_descriptor_when_its_own_is_gone():
    """The kept descriptor of /proc/meminfo closed behind shmkv's back, and its number reused by
    another file: the room is still MemAvailable, the other file is neither read as it nor closed."""
    first = _segment.mem_available()
    assert first is not None and first > 0
    fd = _segment.MEMINFO[0]
    os.close(fd)
    r, w = os.pipe()  # takes the lowest free number: most likely fd
    try:
        os.write(w, b"MemTotal: 1 kB\nMemAvailable: 1 kB\n")  # would read as 1 KiB (a pipe: no pread)
        again = _segment.mem_available()
        assert again is not None and again > 1024
        assert _segment.MEMINFO[0] not in (-1, r, w)
        assert os.read(r, 8) == b"MemTotal"  # still open, unread
    finally:
        os.close(r)
        os.close(w)
    with open("/proc/meminfo", "rb") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith(b"MemAvailable:"))
    assert abs(_segment.mem_available() - avail) < 1 << 30  # (the machine's memory moves a little)


def test_a_create_that_borrows_all_it_reuses_checks_the_room_once_and_copies_no_kv(make_store, monkeypatch):
    """A create over a cached prefix that borrows every K/V cell it reuses: one room check, no
    reservation (no fallocate: copy_prefix_rows does not reserve what new_row did, and the token
    ids, positions and hashes are written through the descriptor, which allocates their pages),
    no write of K/V (nothing of it is copied); its content is the donor's."""
    from shmkv._engine.memory.pages import Pages

    st = make_store(**LAYOUT)
    system = P(1, 4 * BLOCK)  # a multiple of the page unit: all of it borrowed
    d, _ = serve(st, system)
    d.finish()
    calls = {"check_room": 0, "reserve": 0, "put": 0}
    kv_puts = []
    for cls, name in ((_segment.Segment, "check_room"), (_segment.Segment, "reserve"), (Pages, "put")):
        real = getattr(cls, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            if _name == "put" and a[1].ndim > 1:
                kv_puts.append(a[1].shape)
            return _real(*a, **k)

        monkeypatch.setattr(cls, name, counted)
    p = np.concatenate([system, [1, 2, 3]])
    s = st.create_sequence(capacity=200, prefix=p)
    assert len(s) == len(system) and s._row[_header.SPAN_CELLS] == len(system)
    # (token ids, positions and hashes written through the descriptor: that allocates their pages)
    assert calls == {"check_room": 1, "reserve": 0, "put": 3} and kv_puts == [], (calls, kv_puts)
    monkeypatch.undo()
    k, v = np.ones((2, 2, 3, 2, 128), np.float32)
    s.extend(k, v, tokens=[1, 2, 3])
    d_read = st.sequence(d.id)
    for layer in range(2):
        np.testing.assert_array_equal(s.keys(layer)[: len(system)], d_read.keys(layer))
    np.testing.assert_array_equal(s.tokens, p)
    np.testing.assert_array_equal(s.positions, np.arange(len(p)))


def test_the_match_steps_down_from_the_whole_prompt(make_store, monkeypatch):
    """The longest held block count is found by probes down from the whole prompt, then a binary
    search: a request one or two blocks past a cached prompt costs at most 3 probes of the index,
    and every cut of a prompt matches exactly what the cached rows hold (as the binary search
    found it), from none to all of it."""
    from shmkv._engine.prefixes.index import PrefixIndex

    st = make_store(**LAYOUT)
    e = engine_of(st)
    system = P(1, 40 * BLOCK)
    d, _ = serve(st, system)
    d.finish()
    short, _ = serve(st, system[: 3 * BLOCK + 5])  # a second, shorter holder
    short.finish()
    probes = []
    real = PrefixIndex.holders

    def counted(self, h):
        probes.append(h)
        return real(self, h)

    monkeypatch.setattr(PrefixIndex, "holders", counted)
    for extra in (1, BLOCK, 2 * BLOCK):
        probes.clear()
        assert e.index.match(np.concatenate([system, P(7, extra) + 30_000]))[0] == len(system)
        assert len(probes) <= 3, (extra, len(probes))
    rng = np.random.default_rng(3)
    for cut in [0, 1, 5, BLOCK, BLOCK + 3, 3 * BLOCK + 5, 3 * BLOCK + 6, 17 * BLOCK, 39 * BLOCK + 15, 40 * BLOCK]:
        p = np.concatenate([system[:cut], rng.integers(30_000, 40_000, int(rng.integers(1, 5 * BLOCK)))])
        assert st.match_prefix(p) == cut, cut


# -- the page mark: a borrow over cells that never were in a range punches nothing ----------------

def _held(st) -> int:
    """Bytes of memory the data segment holds (allocated pages)."""
    return os.fstat(engine_of(st)._dseg.fileno()).st_blocks * 512


def _counting_punches(monkeypatch) -> list[int]:
    from shmkv._engine.spans import mappings as share

    calls: list[int] = []
    real = share._fallocate

    def counted(fd, mode, off, n):
        calls.append(n)
        return real(fd, mode, off, n)

    monkeypatch.setattr(share, "_fallocate", counted)
    return calls


def test_a_borrow_over_cells_never_in_a_range_punches_nothing(make_store, monkeypatch):
    """Requests over a cached prompt in a fresh store land above every range there was: their
    spans have no pages of their own, so the borrow makes no punch (16 fallocate calls a create
    in an 8-layer store), and the memory held is the same as with the punches."""
    st = make_store(**LAYOUT)
    e = engine_of(st)
    system = P(1, 4 * BLOCK)
    d, _ = serve(st, system)
    d.finish()
    punches = _counting_punches(monkeypatch)
    before = _held(st)
    for i in range(3):
        mark = e.hdr[_header.W_PAGE_MARK]
        s, n = serve(st, np.concatenate([system, P(10 + i, 7) + 30_000]))
        assert n == len(system) and s._row[_header.SPAN_CELLS] == len(system)
        assert s._row[START] >= mark  # (above every range there was)
        assert e.hdr[_header.W_PAGE_MARK] >= s._row[START] + s.capacity  # its own range is marked now
        check(s, np.concatenate([system, s.tokens[len(system):]]), st.layout)
    assert punches == []
    per_token = 2 * LAYOUT["layers"] * LAYOUT["kv_heads"] * LAYOUT["head_dim"] * 4
    assert _held(st) - before < 3 * (7 + 4 * BLOCK // 2) * per_token  # no span's cells held twice


def test_a_borrow_over_cells_that_held_pages_punches_them(make_store, monkeypatch):
    """A borrower placed in cells a freed sequence wrote (below the mark) gives their pages back:
    its span holds no memory of its own."""
    st = make_store(**LAYOUT)
    e = engine_of(st)
    system = P(1, 4 * BLOCK)
    old = st.create_sequence(capacity=200)  # cells [0, 200): written, then freed (pages stay)
    k = np.ones((2, 150, 2, 128), np.float32)
    old.extend(k, k)
    old.free()
    d, _ = serve(st, system, capacity=len(system))  # (first fit: right after the freed range's start)
    d.finish()
    assert e.hdr[_header.W_PAGE_MARK] >= 200
    punches = _counting_punches(monkeypatch)
    held = _held(st)
    s, n = serve(st, np.concatenate([system, [1, 2, 3]]))
    assert n == len(system) and s._row[START] < 200  # in the freed cells
    assert len(punches) == len(e.shares.pieces)
    per_cell = 2 * LAYOUT["layers"] * LAYOUT["kv_heads"] * LAYOUT["head_dim"] * 4
    assert _held(st) <= held - (len(system) - 8) * per_cell  # the span's own pages given back
    check(s, np.concatenate([system, [1, 2, 3]]), st.layout)


def _alloc_in_child(name: str, cells: int) -> int:
    import shmkv

    store = shmkv.attach(name)
    try:
        s = store.create_sequence(capacity=cells)
        k = np.ones((2, cells, 2, 128), np.float32)
        s.extend(k, k)
        start = int(engine_of(store).table_np[s._slot, START])
        s.free()
        return start
    finally:
        store.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_another_processs_ranges_raise_the_mark(make_store, monkeypatch, method):
    """A range another process wrote and freed is marked in the header: this process's next
    borrow there punches its pages."""
    from shmkv.testing import run_in_process

    st = make_store(**LAYOUT)
    e = engine_of(st)
    system = P(1, 4 * BLOCK)
    d, _ = serve(st, system, capacity=len(system))
    d.finish()
    start = run_in_process(_alloc_in_child, st.name, 300, start_method=method, timeout=120)
    assert start >= len(system) and e.hdr[_header.W_PAGE_MARK] >= start + 300
    punches = _counting_punches(monkeypatch)
    held = _held(st)
    s, n = serve(st, np.concatenate([system, [4, 5]]))
    assert n == len(system) and s._row[START] == start  # where the child's cells were
    assert len(punches) == len(e.shares.pieces)
    per_cell = 2 * LAYOUT["layers"] * LAYOUT["kv_heads"] * LAYOUT["head_dim"] * 4
    assert _held(st) <= held - (len(system) - 8) * per_cell


def test_a_crash_after_a_create_reserved_pages_leaves_them_marked(make_store):
    """A child killed inside a create over a prefix (create.row: its range's pages for the copied
    tail reserved, the row not yet written) leaves the mark above them: after recovery, a
    borrow in those cells punches what the child allocated."""
    st = make_store(**LAYOUT)
    e = engine_of(st)
    system = P(1, 4 * BLOCK + 2)  # 2 cells past the last whole page unit: copied, their pages reserved
    d, _ = serve(st, system, capacity=len(system))
    d.finish()
    mark = e.hdr[_header.W_PAGE_MARK]
    code = ("import sys, numpy as np, shmkv; s = shmkv.attach(sys.argv[1]); "
            "s.create_sequence(capacity=300, prefix=np.array(sys.argv[2].split(','), np.int64))")
    env = {**os.environ, "SHMKV_CRASH_AT": "create.row"}
    p = np.concatenate([system, [9, 9]])
    r = subprocess.run([sys.executable, "-c", code, st.name, ",".join(map(str, p))], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    with st.transaction():  # recovery
        pass
    after = e.hdr[_header.W_PAGE_MARK]
    assert (e.table_np[:, STATE] == LIVE).sum() == 1  # only the donor is live
    s, n = serve(st, p)  # first fit: the cells the child had
    assert n == len(system)
    # the child's reservation (pages for the 2 copied cells after its span) raised the mark before it died
    assert mark < s._row[START] + len(system) <= after
    check(s, p, st.layout)


def test_a_forked_child_reads_the_room_itself(monkeypatch):
    """The reading of the room is this process's: a forked child starts without one (it would
    spend what the parent was granted a second time). (The reading's life is made an hour: a
    fork on a loaded machine took longer than its 50 ms, and the parent's last grant failed.)"""
    from shmkv.testing import run_in_process

    monkeypatch.setattr(type(_segment.ROOM), "TTL", 3600.0)
    _segment.ROOM.read(1 << 40, 0)
    assert _segment.ROOM.grant(1)
    assert run_in_process(_grant_one, start_method="fork", timeout=60) is False
    assert _segment.ROOM.grant(1)


def _grant_one() -> bool:
    return _segment.ROOM.grant(1)
