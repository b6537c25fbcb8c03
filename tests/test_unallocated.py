"""The room check's count of the pages a reservation still needs.

On tmpfs, SEEK_HOLE/SEEK_DATA report a page that was fallocated but never written as a hole
(as on Linux 6.18: the seek looks at whether the page is up to date). Such a page is in use
(tmpfs and memory count it), so ``Segment._unallocated`` counts with cachestat(2): a reservation
over pages already fallocated (by another process, or a reservation not yet written) needs
nothing, and is not refused on a nearly full /dev/shm."""

from __future__ import annotations

import json
import mmap
import os
import textwrap

import _namespaces
import pytest

from shmkv._engine.memory import cachestat as _cachestat
from shmkv._engine.memory import segment as _segment
from shmkv.testing import unique_name

PAGE = mmap.PAGESIZE
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture
def seg():
    """A 64-page data segment of this test's own (nothing allocated), removed after."""
    s = _segment.Segment.create(unique_name("unal"), 64 * PAGE)
    yield s
    s.close()
    s.unlink()


def _need_cachestat(seg) -> None:
    if _cachestat.pages(seg.fileno(), 0, PAGE) is None:
        pytest.skip("cachestat(2) is not available here (Linux 6.5+): the count falls back to SEEK_HOLE")


def test_fallocated_pages_never_written_are_allocated_in_the_count(seg):
    _need_cachestat(seg)
    seg.reserve([(8 * PAGE, 16 * PAGE)], populate=False)  # pages 8..24: fallocated, never written
    seg.write(30 * PAGE, memoryview(b"x"))  # page 30: written through the descriptor
    seg.array("u1", PAGE, 40 * PAGE)[0] = 1  # page 40: touched through the mapping
    assert seg._unallocated(0, 64 * PAGE) == (64 - 16 - 2) * PAGE
    assert seg._unallocated(8 * PAGE, 24 * PAGE) == 0
    assert seg._unallocated(4 * PAGE, 12 * PAGE) == 4 * PAGE
    assert seg._unallocated(29 * PAGE, 41 * PAGE) == 10 * PAGE
    # the hole walk (the fallback without cachestat) never counts fewer: a refusal from it may
    # come early, never late (here it counts the fallocated pages too)
    for b, e in ((0, 64), (8, 24), (4, 12), (29, 41)):
        assert seg._holes(b * PAGE, e * PAGE) >= seg._unallocated(b * PAGE, e * PAGE)
    seg.reserve([(0, 64 * PAGE)])  # every page now, pre-faulted
    assert seg._unallocated(0, 64 * PAGE) == 0


def test_a_reservation_over_fallocated_pages_fits_a_room_smaller_than_it(seg, monkeypatch):
    """check_room refuses only what the missing pages exceed: with room for 4 pages, 32 pages
    fallocated before (populate=False: allocated, never written) need none."""
    _need_cachestat(seg)
    room = [1 << 30]
    monkeypatch.setattr(_segment, "_room_bytes", lambda: room[0])
    monkeypatch.setattr(_segment, "ROOM", _segment.Room())
    seg.reserve([(0, 32 * PAGE)], populate=False)
    room[0] = 4 * PAGE  # /dev/shm nearly full meanwhile
    _segment.ROOM.read(None, 0)  # (no grant from the earlier reading)
    seg.check_room([(0, 32 * PAGE)])
    seg.check_room([(0, 36 * PAGE)])  # 4 pages missing: they fit
    seg.reserve([(0, 32 * PAGE)], populate=False)
    with pytest.raises(_segment.CacheFullError, match=rf"room for {4 * PAGE} more bytes.* needs {8 * PAGE}"):
        seg.check_room([(0, 40 * PAGE)])


CHILD = textwrap.dedent("""
    import json, os
    from shmkv._engine.memory import segment as _segment
    from shmkv._engine.memory import cachestat

    def free():
        st = os.statvfs("/dev/shm")
        return st.f_bavail * st.f_frsize

    out = {"free_before": free()}
    a = _segment.Segment.create("fill", 6 << 20)
    a.reserve([(0, 6 << 20)], populate=False)  # fallocated, never written: taken from the room
    out["free_after"] = free()
    out["cachestat"] = cachestat.pages(a.fileno(), 0, 6 << 20) is not None
    b = _segment.Segment.open("fill", readonly=False)  # another handle (as another process's)
    try:
        b.reserve([(0, 6 << 20)])  # needs no page: the room (about 2 MiB) is enough
        out["again"] = "ok"
    except _segment.CacheFullError as e:
        out["again"] = str(e)
    c = _segment.Segment.create("more", 6 << 20)
    try:
        c.reserve([(0, 6 << 20)])  # needs all of it: refused
        out["more"] = "ok"
    except _segment.CacheFullError as e:
        out["more"] = type(e).__name__
    print(json.dumps(out))
""")


def test_in_a_nearly_full_private_dev_shm_pages_fallocated_before_are_not_needed_again():
    """A real 8 MiB tmpfs: 6 MiB fallocated by one handle (tmpfs counts them as used), then the
    same 6 MiB reserved through another handle fits the 2 MiB left; 6 MiB of a new file do not."""
    why = _namespaces.available()
    if why is not None:
        if IN_CI:
            pytest.fail(f"CI must be able to make a private /dev/shm: {why}")
        pytest.skip(why)
    proc = _namespaces.in_private_shm([_namespaces.PY, "-c", CHILD], "8m", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["free_before"] - out["free_after"] == 6 << 20, out  # fallocated pages are used
    if not out["cachestat"]:
        pytest.skip("cachestat(2) is not available here (Linux 6.5+)")
    assert out["again"] == "ok", out
    assert out["more"] == "CacheFullError", out


def test_without_cachestat_the_count_walks_the_holes(seg, monkeypatch):
    """Before Linux 6.5, or where a seccomp profile refuses the call: the SEEK_HOLE walk, which
    counts fallocated, unwritten pages as missing (an early refusal at worst, never a late one)."""
    seg.reserve([(8 * PAGE, 16 * PAGE)], populate=False)
    seg.write(30 * PAGE, memoryview(b"x"))
    assert _cachestat.pages(-1, 0, PAGE) is None  # a failing call (EBADF): None for it alone
    assert _cachestat.pages(seg.fileno(), 8 * PAGE, 16 * PAGE) in (None, 16)  # (16 with cachestat)
    monkeypatch.setattr(_cachestat, "_CALL", [None])
    assert _cachestat.pages(seg.fileno(), 0, PAGE) is None
    assert seg._unallocated(0, 64 * PAGE) == seg._holes(0, 64 * PAGE) >= 63 * PAGE
    assert seg._unallocated(29 * PAGE, 31 * PAGE) == PAGE  # page 30 is data to the walk
