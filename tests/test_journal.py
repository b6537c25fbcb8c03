"""The journal: recovery on every way into the store lock, rollback on exceptions,
Ctrl-C on the lock path, ids never reused.

The crash matrix: a child is SIGKILLed at every crash point (shmkv._engine.locking.crash.POINTS);
the killed store's segments are copied once (its image), and each first lock holder runs
on a fresh copy of that image: the store equals the state before the operation or after
it (every cell the K/V of its token id: procs.crash.state), generations are even,
`verify` is clean, and later appends and commits are seen. The same scenarios as
tests/test_crash.py, plus a sequence X that this process leases (so that a truncate or a
copy_prefix can be the first holder) and leaves out of the comparison.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _ctrl_c_points import CLEAN, Points, lock_path_state, reset_lock_path
from procs.crash import LAYOUT, base, fill, layout_for, op, prepare, state

import shmkv
from shmkv import cli
from shmkv._engine.locking import crash as _crash
from shmkv._engine.table import header as _header
from shmkv._engine.memory import segment as _segment
from shmkv.store import _lifecycle
from shmkv.testing import unique_name

HERE = os.path.dirname(__file__)
POINTS = _crash.POINTS  # every one: procs.crash.op runs an operation through each
HOLDERS = ("transaction", "create_sequence", "create_sequence_prefix", "truncate", "copy_prefix", "restore",
           "save", "save_readonly", "read_readonly", "lease_takeover", "attach_verify", "verify_repair", "gc")


def _layout(point: str) -> dict:
    return layout_for(point)


def _scenario(store: shmkv.Store, point: str, snap: str, xsnap: str | None) -> tuple[dict, shmkv.Sequence]:
    """X (leased here, first: the scenarios' placements stay as tests/test_crash.py has them),
    then base + prepare (+ the restore points' snapshot, without X, and changes)."""
    x = store.create_sequence(capacity=4)
    fill(x, [900, 901, 902])
    if xsnap is not None:
        store.save(xsnap, seq_ids=[x.id])
    ids = base(store)
    prepare(store, point, ids)
    if point.startswith("restore"):
        if xsnap is None:
            store.save(snap, seq_ids=[i.id for i in store.sequences() if i.id != x.id])
        store.sequence(ids["b"], write=True).truncate(3)
        store.sequence(ids["c"], write=True).free()
    return ids, x


def _without(st: list, x: int) -> list:
    return [s for s in st if s[0] != x]


def _before_or_after(point: str, got: list, before: list, after: list, ids: dict) -> None:
    if point.startswith("compact"):
        # token by token commits (each complete) until one compacts: B holds before's tokens and
        # some of the new ones (as tests/test_crash.py says)
        assert [g[:1] for g in got] == [a[:1] for a in after]
        b_got = next(g for g in got if g[0] == ids["b"])
        b_after = next(a for a in after if a[0] == ids["b"])
        assert b_after[1][: len(b_got[1])] == b_got[1] and len(b_got[1]) <= len(b_after[1])
    else:
        assert got in (before, after), f"{point}: neither before nor after\n{got}\n{before}\n{after}"


def _image(name: str) -> dict[str, bytes]:
    out = {}
    for seg in (_segment.header_name(name), _segment.data_name(name)):
        with open(_segment.shm_path(seg), "rb") as f:
            out[seg] = f.read()
    return out


def _put_image(img: dict[str, bytes]) -> None:
    for seg, data in img.items():
        fd = os.open(_segment.shm_path(seg), os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)


def _loaded_state(path: str, x: int) -> list:
    loaded = shmkv.load(path, name=unique_name("jl"))
    try:
        return _without(state(loaded), x)
    finally:
        loaded.unlink()


def _first_holder(holder: str, store: shmkv.Store, ids: dict, x: shmkv.Sequence, *, xsnap: str,
                  tmp_path) -> list | None:
    """Run ``holder`` as the first lock holder after the crash; a state it captured, if any."""
    name = store.name
    if holder == "transaction":
        with store.transaction():
            pass
    elif holder == "create_sequence":
        store.create_sequence(capacity=4).free()
    elif holder == "create_sequence_prefix":
        s = store.create_sequence(capacity=64, prefix=np.arange(100, 120))
        assert len(s) == (0 if store.layout.bounded else 19)  # a sliding layer cannot resume at 19
        s.free()
    elif holder == "truncate":
        x.truncate(2)
    elif holder == "copy_prefix":
        store.copy_prefix(ids["a"], x.id, 40)  # all of A: sliding layers hold only its last tokens
        assert store.sequence(x.id).tokens.tolist() == list(range(100, 140))
    elif holder == "restore":
        assert store.restore(xsnap) == [x.id]
    elif holder in ("save", "save_readonly"):
        path = str(tmp_path / f"{holder}.shmkv")
        if holder == "save":
            store.save(path)
        else:
            with shmkv.attach(name, readonly=True) as ro:
                ro.save(path)
        return _loaded_state(path, x.id)
    elif holder == "read_readonly":
        with shmkv.attach(name, readonly=True) as ro:
            return _without(state(ro), x.id)
    elif holder == "lease_takeover":
        for sid in (ids["c"], ids["b"]):
            try:
                store.sequence(sid, write=True).release()
                break
            except shmkv.SequenceNotFound:
                continue
    elif holder == "attach_verify":
        with shmkv.attach(name) as other:
            assert cli.verify(other) == []
    elif holder == "verify_repair":
        assert cli.main(["verify", "--repair", name]) == 0
    elif holder == "gc":
        assert not _lifecycle._collect(name, False, 30.0)  # its creator (this process) lives: kept
    else:
        raise ValueError(holder)
    return None


def _check_after(store: shmkv.Store, ids: dict) -> None:
    """Generations even, verify clean, ids unique, later appends and commits seen."""
    gens = store._engine.table_np[:, _header.GEN]
    assert not (gens & 1).any(), gens
    assert cli.verify(store) == []
    got_ids = [i.id for i in store.sequences()]
    assert len(got_ids) == len(set(got_ids))
    for sid in (ids["b"], ids["c"]):  # the dead writer's sequence too: its lease is taken over
        try:
            w = store.sequence(sid, write=True)
        except shmkv.SequenceNotFound:
            continue
        n = len(w)
        last = int(w.tokens[-1]) + 1 if n else 9000
        fill(w, [last, last + 1])
        assert store.sequence(sid).tokens[n:].tolist() == [last, last + 1]
        w.release()
    fresh = store.create_sequence(capacity=8)
    fill(fresh, [1, 2, 3])
    assert store.sequence(fresh.id).tokens.tolist() == [1, 2, 3]
    fresh.free()


@pytest.mark.slow
def test_crash_matrix(make_store, tmp_path):
    """Every crash point x every first lock holder."""
    t0 = time.monotonic()
    cells = 0
    for point in POINTS:
        snap, xsnap = str(tmp_path / "snap.shmkv"), str(tmp_path / "x.shmkv")
        ref = make_store(**_layout(point))
        ids, xr = _scenario(ref, point, snap, None)
        before = _without(state(ref), xr.id)
        op(ref, point, ids, snap)
        after = _without(state(ref), xr.id)
        ref.unlink()

        store = make_store(**_layout(point))
        got_ids, x = _scenario(store, point, snap, xsnap)
        assert got_ids == ids and x.id == xr.id
        assert _without(state(store), x.id) == before
        env = {**os.environ, "SHMKV_CRASH_AT": point,
               "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
        r = subprocess.run([sys.executable, os.path.join(HERE, "procs", "crash.py"), store.name, point,
                            json.dumps(ids), snap], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == -signal.SIGKILL, f"{point} was not reached: exit {r.returncode}\n{r.stderr[-3000:]}"
        img = _image(store.name)
        for holder in HOLDERS:
            _put_image(img)
            try:
                captured = _first_holder(holder, store, ids, x, xsnap=xsnap, tmp_path=tmp_path)
                if captured is not None:
                    _before_or_after(point, captured, before, after, ids)
                _before_or_after(point, _without(state(store), x.id), before, after, ids)
                _check_after(store, ids)
            except BaseException as e:
                raise AssertionError(f"crash point {point}, first holder {holder}: {e!r}") from e
            cells += 1
        store.unlink()
    print(f"{cells} cells in {time.monotonic() - t0:.1f} s")
    assert cells == len(POINTS) * len(HOLDERS)


@pytest.mark.slow
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), shmkv.CacheFullError("armed: the store is full")],
                         ids=["KeyboardInterrupt", "CacheFullError"])
def test_an_exception_at_every_crash_point_rolls_back(make_store, tmp_path, exc):
    """The crash points armed to raise: the store equals the state before, the exception
    reaches the caller."""
    for point in POINTS:
        snap = str(tmp_path / "snap.shmkv")
        store = make_store(**_layout(point))
        ids, x = _scenario(store, point, snap, None)
        before = _without(state(store), x.id)
        _crash.arm(point, exc)
        try:
            with pytest.raises(type(exc)) as got:
                op(store, point, ids, snap)
            assert got.value is exc, point
        finally:
            _crash.disarm()
        exc.__traceback__ = None  # its frames hold the operation's write handle (and lease)
        del got
        gc.collect()
        assert store._engine.hdr[_header.W_UNDO_COUNT] == 0 and store._engine.journal.depth == 0, point
        now = _without(state(store), x.id)
        if point.startswith("compact"):  # commits before the one that compacts are complete
            b_now = next(g for g in now if g[0] == ids["b"])
            b_before = next(a for a in before if a[0] == ids["b"])
            assert b_now[1][: len(b_before[1])] == b_before[1], point
            assert [g for g in now if g[0] != ids["b"]] == [a for a in before if a[0] != ids["b"]]
        else:
            assert now == before, point
        _check_after(store, ids)
        store.unlink()


def test_restore_is_all_or_nothing_when_its_publish_raises(make_store, tmp_path):
    """A CacheFullError inside restore's publish rolls the whole restore back: never one of two
    sequences restored."""
    store = make_store(**LAYOUT)
    a = store.create_sequence(capacity=16)
    fill(a, [1, 2, 3])
    b = store.create_sequence(capacity=16)
    fill(b, [4, 5, 6])
    path = str(tmp_path / "two.shmkv")
    store.save(path)
    a.truncate(1)
    b.truncate(1)
    before = state(store)
    _crash.arm("restore.published", shmkv.CacheFullError("armed"))
    try:
        with pytest.raises(shmkv.CacheFullError):
            store.restore(path)
    finally:
        _crash.disarm()
    assert state(store) == before
    assert store.restore(path) == [a.id, b.id]
    assert [len(store.sequence(i)) for i in (a.id, b.id)] == [3, 3]


def test_a_read_handle_on_a_freed_sequence_stays_dead_after_a_restore(make_store, tmp_path):
    """A restore re-creates id 1; the stale handle raises, never reads it."""
    store = make_store(**LAYOUT)
    s = store.create_sequence(capacity=8)
    fill(s, [70, 71, 72])
    path = str(tmp_path / "one.shmkv")
    store.save(path)
    stale = store.sequence(s.id)
    stale_w = s
    assert stale.tokens.tolist() == [70, 71, 72]
    s.free()
    assert store.restore(path) == [stale.id]  # the snapshot's id, alive again
    assert store.sequence(stale.id).tokens.tolist() == [70, 71, 72]
    with pytest.raises(shmkv.SequenceNotFound):
        _ = stale.tokens
    with pytest.raises(shmkv.SequenceNotFound):
        stale.read(0)
    with pytest.raises(shmkv.SequenceNotFound):
        _ = stale_w.tokens  # the write handle that freed it
    with pytest.raises((shmkv.SequenceNotFound, shmkv.ReadOnlyError)):  # its lease went with free()
        stale_w.truncate(1)
    ro = shmkv.attach(store.name, readonly=True)
    try:
        assert ro.sequence(stale.id).tokens.tolist() == [70, 71, 72]
    finally:
        ro.close()


def test_a_read_only_save_after_a_crash_records_the_rolled_back_state(make_store, tmp_path):
    """A writer died inside truncate: a read-only save succeeds and records the state before."""
    store = make_store(**LAYOUT)
    ids = base(store)
    before = state(store)
    env = {**os.environ, "SHMKV_CRASH_AT": "truncate.row",
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, os.path.join(HERE, "procs", "crash.py"), store.name, "truncate.row",
                        json.dumps(ids), str(tmp_path / "x")], env=env, capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL
    path = str(tmp_path / "ro.shmkv")
    with shmkv.attach(store.name, readonly=True) as ro:
        ro.save(path)
        assert state(ro) == before  # read-only readers see it rolled back too
        assert ro.sequence(ids["b"]).meta == {}  # its meta record as well (never a LockTimeout)
    assert store._engine.hdr[_header.W_UNDO_COUNT] == 1  # nobody rolled it back: the reader could not
    loaded = shmkv.load(path, name=unique_name("jl"))
    try:
        assert state(loaded) == before
    finally:
        loaded.unlink()


def test_sigints_never_leave_the_lock_held(make_store):
    """500 SIGINTs into a process that catches KeyboardInterrupt (keeping the
    traceback) between lock-heavy operations: after each one it holds no lock and no
    transaction, and this process can take the lock."""
    store = make_store(**dict(LAYOUT, max_seqs=64))
    n = int(os.environ.get("SHMKV_SIGINTS", "500"))
    rng = np.random.default_rng(int(os.environ.get("SHMKV_SIGINT_SEED", "22")))
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "procs", "journal.py"), "sigint", store.name],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    held = []

    def line(timeout: float = 30.0) -> str:
        ready, _, _ = select.select([child.stdout], [], [], timeout)
        assert ready, "the child stopped answering"
        out = child.stdout.readline()
        if not out:  # (its stderr: where the interrupt that killed it came out)
            code = child.wait(5)
            raise AssertionError(f"the child died: exit {code}; its stderr ends: {child.stderr.read()[-3000:]}")
        return out.strip()

    try:
        assert line(60) == "ready"
        for i in range(n):
            time.sleep(float(rng.uniform(0, 0.003)))  # lands anywhere in the loop
            child.send_signal(signal.SIGINT)
            out = line()
            assert out.startswith("caught"), out
            if out != "caught 0 0":
                held.append((i, out))
            if i % 50 == 49:  # and the store lock is really free for others (the child paused)
                child.stdin.write("pause\n")
                child.stdin.flush()
                while not (out := line()).startswith("paused"):
                    assert out.startswith("caught"), out
                if out != "paused 0 0":
                    held.append((i, out))
                store._engine._lock.acquire(10.0)
                store._engine._lock.release()
                child.stdin.write("go\n")
                child.stdin.flush()
        child.stdin.close()
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        err = child.stderr.read()
        for f in (child.stdin, child.stdout, child.stderr):
            f.close()
    assert held == [], err[-6000:]  # the first one's traceback
    assert cli.verify(store) == []


def test_only_the_journal_takes_the_store_lock():
    """One way in: outside _engine/locking/journal.py (and the lock itself) no code acquires the store
    lock or holds it directly; everything goes through Journal.locked / reading."""
    import pathlib
    import re

    pkg = pathlib.Path(shmkv.__file__).parent
    direct = re.compile(r"_lock\.(acquire|held|release)\(|StoreLock\(")
    found = []
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg).as_posix()
        if rel in ("_engine/locking/journal.py", "_engine/locking/lock.py"):
            continue
        for n, text in enumerate(f.read_text().splitlines(), 1):
            if direct.search(text) and not (rel == "_engine/attachment.py" and "StoreLock(" in text):
                found.append(f"{rel}:{n}: {text.strip()}")
    assert found == []


def test_a_ctrl_c_on_the_lock_path_is_raised_once_the_lock_is_given_up(make_store):
    """A SIGINT that lands in lock-path code (here a stand-in marked critical) is deferred, then
    raised by the release: the lock is free when the KeyboardInterrupt reaches the caller."""
    from shmkv._engine.locking import interrupts as _interrupts

    store = make_store(**LAYOUT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # no lock held: Python's own
    lands_on_the_lock_path = _interrupts.critical(lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt), store.transaction():
        assert signal.getsignal(signal.SIGINT) is _interrupts._on_sigint  # in front of it while held
        lands_on_the_lock_path()
        assert _interrupts.deferred == [signal.SIGINT] and store._engine._lock.is_held  # noted, not raised
    assert not store._engine._lock.is_held and _interrupts.deferred == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # back once the lock is free
    with pytest.raises(KeyboardInterrupt):  # elsewhere it is raised at once, as always
        signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("rows", [1, 7, 1024, 1025, 5000])
def test_the_scan_for_odd_generations_finds_exactly_the_odd_rows(rows: int) -> None:
    """Recovery's scan (``seqlock.odd_rows``: Python up to 1,024 rows, numpy beyond) finds the
    rows whose generation is odd, incarnation bits included, as a plain numpy reference does."""
    from shmkv._engine.table.seqlock import odd_rows

    rng = np.random.default_rng(rows)
    gens = rng.integers(0, 1 << 50, rows, dtype=np.int64)
    gens[rng.random(rows) < 0.9] &= ~1  # most even, as in a live store
    table = np.zeros((rows, 4), np.int64)
    table[:, 2] = gens
    assert odd_rows(table[:, 2]) == np.flatnonzero(gens % 2 == 1).tolist()


_LOCK_FILES = tuple(os.path.join(*p) for p in (("locking", "interrupts.py"), ("locking", "lock.py"),
                                                ("locking", "journal.py"), ("_sequence", "structural.py")))


@pytest.mark.parametrize("what", ["transaction", "truncate", "create_free"])
def test_a_ctrl_c_at_every_point_of_the_lock_path_leaves_no_hold_behind(make_store, what):
    """A SIGINT at any point where the interpreter would run its handler in the lock's code
    (taking it, installing the deferring handler, the journal, a structural bracket, giving them
    up): it is raised exactly once, by the operation, and afterwards this process holds no lock,
    counts no hold, has Python's own handler back and nothing deferred, and the store is whole."""

    store = make_store(**LAYOUT)
    seq = store.create_sequence(capacity=16)
    k = np.ones((LAYOUT["layers"], 8, LAYOUT["kv_heads"], LAYOUT["head_dim"]), np.float32)
    seq.extend(k, -k)

    def op() -> None:
        if what == "transaction":
            with store.transaction():
                pass
        elif what == "truncate":
            seq.truncate(6)
            seq.extend(k[:, :2], -k[:, :2])
        else:
            store.create_sequence(capacity=4).free()

    points = 0
    try:
        while True:
            tr = Points(points + 1, lambda path: path.endswith(_LOCK_FILES))
            raised = tr.run(op)
            if not tr.fired:  # past the last point: every one was tried
                break
            assert raised, f"point {points}: the Ctrl-C was lost"
            assert not store._engine._lock.is_held, f"point {points}: the lock is still held"
            assert lock_path_state() == CLEAN, f"point {points}: a hold, our handler or a Ctrl-C left behind"
            if what == "truncate":  # the sequence is whole, at one of the two lengths
                assert len(seq) in (6, 8), f"point {points}: length {len(seq)}"
                if len(seq) == 6:
                    seq.extend(k[:, :2], -k[:, :2])
            for info in store.sequences():  # a create that committed before the Ctrl-C: no handle came back
                if info.id != seq.id:
                    assert what == "create_free" and not info.lease_alive, f"point {points}: {info}"
                    store.sequence(info.id).free()
            points += 1
    finally:  # (what a failure left in this process's lock path must not fail the next test)
        if lock_path_state() != CLEAN:
            reset_lock_path()
    assert points > 10  # the lock's code ran under the tracer
    assert cli.verify(store) == []
    assert [i.id for i in store.sequences()] == [seq.id]  # nothing created was left behind


def test_a_second_ctrl_c_raised_before_the_first_is_delivered_leaves_none_for_later(make_store):
    """The first Ctrl-C is noted in lock-path code; a second one comes as the release has put Python's
    handler back, before it raises the first: the second is raised, and the first never comes out of
    a later operation that nobody interrupted."""
    import inspect

    from shmkv._engine.locking import interrupts as _interrupts
    from shmkv._engine.locking.lock import StoreLock

    store = make_store(**LAYOUT)
    lines, first = inspect.getsourcelines(StoreLock.release)
    at = first + next(i for i, text in enumerate(lines) if text.strip() == "if deferred:")
    lands_on_the_lock_path = _interrupts.critical(lambda: signal.raise_signal(signal.SIGINT))

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == at:
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            signal.default_int_handler(signal.SIGINT, frame)  # the second Ctrl-C, raised at once
        return local

    def trace(frame, event, arg):
        return local if frame.f_code is StoreLock.release.__code__ else None

    with pytest.raises(KeyboardInterrupt):
        sys.settrace(trace)
        try:
            with store.transaction():
                lands_on_the_lock_path()  # the first: noted
        finally:
            sys.settrace(None)
    try:
        with store.transaction():  # nobody pressed anything: nothing comes out
            pass
    except KeyboardInterrupt:
        pytest.fail("the first Ctrl-C came out of a later operation that nobody interrupted")
    assert _interrupts.deferred == [] and not store._engine._lock.is_held
