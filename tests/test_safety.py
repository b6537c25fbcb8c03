"""Never touch what is not yours: store identity, permissions, hostile snapshots,
capacity on bounded-only stores, bad input refused with the store unchanged."""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import fcntl
import os
import pickle
import resource
import select
import stat
import subprocess
import sys
import zlib

import msgpack
import numpy as np
import pytest
from procs.store_ops import create_and_drop, create_and_exit, create_wait_exit
from conftest import START_METHODS

import shmkv
import shmkv.cli
from shmkv._engine.table import header as _header
from shmkv.store import _lifecycle
from shmkv._engine.memory import segment as _segment
from shmkv._snapshot import save as _save
from shmkv._snapshot import format as _snapshot_format
from shmkv.store import _removal
from shmkv.cli import verify
from shmkv.testing import run_in_process, start_in_process, unique_name

H, D = 2, 4
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="permission tests drop from root to an unprivileged uid")


def _kinds(kinds: list[str], **kw: int) -> dict:
    """layer_types plus the window/chunk they need."""
    out: dict = {"layer_types": kinds, **kw}
    if "sliding" in kinds:
        out["window"] = 4
    if "chunked" in kinds:
        out["chunk"] = 4
    return out


def _exists(name: str) -> bool:
    return os.path.exists(_segment.shm_path(_segment.header_name(name)))


def _kv(layers: int, n: int, value: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    return np.full((layers, n, H, D), value, np.float32), np.full((layers, n, H, D), -value, np.float32)


# -- capacity -----------------------------------------------------------------------


@pytest.mark.parametrize("kinds", [["sliding", "chunked"], ["sliding", "sliding"], ["full", "sliding"]])
def test_capacity_bounds_every_layer_kind(make_store, kinds):
    """8 tokens into a capacity-4 sequence never reach its neighbour."""
    store = make_store(layers=2, kv_heads=H, head_dim=D, max_tokens=64, **_kinds(kinds))
    seq = store.create_sequence(capacity=4)
    neighbour = store.create_sequence(capacity=4)
    neighbour.extend(*_kv(2, 3, 5.0), tokens=[7, 8, 9])
    seq.extend(*_kv(2, 8), tokens=list(range(100, 108)))
    assert neighbour.tokens.tolist() == [7, 8, 9] and neighbour.positions.tolist() == [0, 1, 2]
    assert seq.tokens.tolist() == list(range(100, 108)) and seq.positions.tolist() == list(range(8))
    assert seq.capacity >= 8 and seq.remaining_capacity >= 0
    for _ in range(5):  # one token at a time through the fast path too
        for layer in range(2):
            seq.append(layer, np.ones((H, D), np.float32), np.ones((H, D), np.float32))
        seq.commit(tokens=[1])
    assert seq.length == 13 and seq.capacity >= 13 and seq.remaining_capacity >= 0
    assert neighbour.tokens.tolist() == [7, 8, 9]
    assert verify(store) == []


@pytest.mark.parametrize("kinds", [["full", "full"], ["sliding", "chunked"]])
def test_extend_past_max_tokens_is_cache_full_and_changes_nothing(make_store, kinds):
    """A lone sequence extended past max_tokens: CacheFullError, and nothing changes."""
    bounded = kinds != ["full", "full"]
    extra = {"memory": 64} if bounded else {}
    store = make_store(layers=2, kv_heads=H, head_dim=D, max_tokens=16, **_kinds(kinds, **extra))
    seq = store.create_sequence(capacity=4)
    seq.extend(*_kv(2, 3), tokens=[1, 2, 3])
    free = store.stats().free_tokens
    with pytest.raises(shmkv.CacheFullError, match="max_tokens=16"):
        seq.extend(*_kv(2, 20))
    assert seq.length == 3 and seq.capacity == 4 and seq.pending == 0
    assert seq.tokens.tolist() == [1, 2, 3] and store.stats().free_tokens == free
    seq.extend(*_kv(2, 2))  # still usable
    assert seq.length == 5


def test_forward_refuses_pending_appends_and_keeps_them(make_store):
    store = make_store(layers=2, kv_heads=H, head_dim=D)
    seq = store.create_sequence(capacity=8)
    seq.extend(*_kv(2, 2))
    for layer in range(2):
        seq.append(layer, np.full((1, H, D), 9.0, np.float32), np.full((1, H, D), 9.0, np.float32))
    with pytest.raises(shmkv.InvalidArgumentError, match="uncommitted"):
        store.forward([seq.id], [2])
    assert seq.pending == 1
    assert seq.commit(tokens=[42]) == 3
    assert seq.tokens.tolist() == [-1, -1, 42] and seq.keys(1)[2].tolist() == [[9.0] * D] * H


# -- store identity and lifecycle ------------------------------------------------------


def test_close_and_unlink_spare_a_newer_store_of_the_same_name():
    """A's store is removed, B creates a new one of that name, A closes."""
    name = unique_name()
    a = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=16, max_seqs=2)
    reader = shmkv.attach(name)
    shmkv.remove(name)
    b = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=16, max_seqs=2, persistent=True)
    try:
        a.close()
        reader.unlink()  # an old handle's unlink: not the store it attached to
        assert _exists(name) and os.path.exists(_segment.lock_path(name))
        with shmkv.attach(name) as again:
            assert again.persistent
    finally:
        b.unlink()
    assert not _exists(name) and not os.path.exists(_segment.lock_path(name))


@pytest.mark.parametrize("method", START_METHODS)
def test_creator_exit_spares_a_newer_store_of_the_same_name(tmp_path, method):
    name = unique_name()
    ready, go = tmp_path / "ready", tmp_path / "go"
    child = start_in_process(create_wait_exit, name, str(ready), str(go), start_method=method, timeout=60)
    try:
        while not ready.exists():
            assert child.process.is_alive(), "the child died before creating its store"
            child.process.join(0.005)
        shmkv.remove(name)
        mine = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=16, max_seqs=2)
        go.touch()
        child.result()  # the child exits normally: its exit-time removal runs
        assert _exists(name)
        mine.close()
        assert not _exists(name)
    finally:
        go.touch()
        child.kill()


@pytest.mark.parametrize("method", START_METHODS)
def test_dropping_the_creators_handle_keeps_the_store_until_exit(method):
    """Only close() or the creator's exit removes the store, not GC."""
    name = unique_name()
    assert run_in_process(create_and_drop, name, start_method=method, timeout=60) is True
    assert not _exists(name) and not os.path.exists(_segment.lock_path(name))


def test_dropping_a_handle_in_process_keeps_the_store(make_store):
    store = make_store()
    name, identity = store.name, store._engine.identity
    seq = store.create_sequence(capacity=4)
    seq.extend(*_kv(2, 2), tokens=[4, 5])
    seq_id = seq.id
    del store, seq
    gc.collect()
    assert _exists(name)
    with shmkv.attach(name, readonly=True) as ro:
        assert ro.sequence(seq_id).tokens.tolist() == [4, 5]
    assert _removal.remove_if_same(name, identity)


def test_gc_never_judges_a_store_of_another_format_version():
    name = unique_name()
    run_in_process(create_and_exit, name, True, "exit", start_method="spawn", timeout=60)  # creator dead
    path = _segment.shm_path(_segment.header_name(name))
    try:
        with open(path, "r+b") as f:
            f.seek(8 * _header.W_VERSION)
            f.write((_header.FORMAT_VERSION + 1).to_bytes(8, "little"))
        assert not _lifecycle._collect(name, True, 0.0)  # unreadable tables: never removed by us
        assert _exists(name)
        with open(path, "r+b") as f:
            f.seek(8 * _header.W_VERSION)
            f.write(_header.FORMAT_VERSION.to_bytes(8, "little"))
        assert _lifecycle._collect(name, True, 0.0) and not _exists(name)
    finally:
        with contextlib.suppress(shmkv.StoreNotFound):
            shmkv.remove(name)


@pytest.mark.parametrize("how", ["creator", "persistent creator", "attached handle"])
def test_unlink_removes_the_lock_file(make_store, how):
    store = make_store(persistent=how == "persistent creator")
    name = store.name
    store.create_sequence(capacity=4)  # the lock was taken
    assert os.path.exists(_segment.lock_path(name))
    handle = shmkv.attach(name) if how == "attached handle" else store
    handle.unlink()
    assert not _exists(name) and not os.path.exists(_segment.lock_path(name))
    assert name not in shmkv.list_stores()
    store.close()  # the creator's close after the removal recreates nothing
    assert not os.path.exists(_segment.lock_path(name))


def test_closed_store_raises_store_closed(make_store):
    store = make_store()
    seq = store.create_sequence(capacity=4)
    seq.set_encoder(*_kv(2, 2))
    store.close()
    k = np.zeros((H, D), np.float32)
    for call in (lambda: seq.append(0, k, k), lambda: seq.encoder_kv(0), lambda: seq.extend(*_kv(2, 1)),
                 seq.commit, lambda: store.sequence(seq.id)):
        with pytest.raises(shmkv.StoreClosedError):
            call()
    # (but close(); unlink() removes it by name: tests/test_lifecycle.py::test_close_then_unlink_removes_the_store)


# -- permissions --------------------------------------------------------------------


def _as_user(fn, *args, uid=NOBODY, gid=NOBODY, groups=(), timeout=60.0):
    """Run ``fn(*args)`` in a forked child at ``uid``; return ('ok', value) or ('error', class name, message)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = ("ok", fn(*args))
            except BaseException as e:
                out = ("error", type(e).__name__, str(e))
            data = pickle.dumps(out)
        except BaseException as e:
            data = pickle.dumps(("setup", repr(e)))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    try:
        chunks = []
        with os.fdopen(r, "rb") as f:
            while True:
                ready, _, _ = select.select([f], [], [], timeout)
                assert ready, f"child at uid {uid} did not answer within {timeout} s"
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        try:
            os.kill(pid, 9) if not chunks else None
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    out = pickle.loads(b"".join(chunks))
    assert out[0] != "setup", out
    return out


def _attach_and_read(name, readonly):
    with shmkv.attach(name, readonly=readonly) as s:
        return [i.id for i in s.sequences()]


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = shmkv.cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@root_only
def test_another_users_store_is_reported_never_a_crash(make_store):
    store = make_store()
    store.create_sequence(capacity=4)
    for readonly in (False, True):
        res = _as_user(_attach_and_read, store.name, readonly)
        assert res[:2] == ("error", "AccessDeniedError") and f"uid {NOBODY}" in res[2], res
    assert issubclass(shmkv.AccessDeniedError, shmkv.ShmkvError)
    assert issubclass(shmkv.AccessDeniedError, PermissionError)
    status, (code, out, err) = _as_user(_cli, "ls", "--json")
    assert status == "ok" and code == 0, err
    row = next(r for r in __import__("json").loads(out) if r["name"] == store.name)
    assert "not accessible" in row["error"]
    status, (code, out, err) = _as_user(_cli, "info", store.name)
    assert status == "ok" and code == 1 and "not accessible" in err and "Traceback" not in err
    # gc's judgement of that store: skipped, not read, not removed, no error
    assert _as_user(_lifecycle._collect, store.name, True, 0.0) == ("ok", False)
    assert _exists(store.name) and store.sequences()


def _write_as_group_member(name):
    with shmkv.attach(name) as s:
        seq = s.create_sequence(capacity=4)
        seq.extend(np.ones((2, 2, H, D)), np.ones((2, 2, H, D)), tokens=[5, 6])
        seq.release()
        return seq.id


@root_only
def test_group_mode_lets_a_group_member_write(make_store):
    store = make_store(mode=0o660)
    for path in (_segment.shm_path(_segment.header_name(store.name)), _segment.lock_path(store.name)):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660  # the lock file takes the segments' mode
    res = _as_user(_write_as_group_member, store.name, groups=(os.getgid(),))
    assert res[0] == "ok", res
    assert store.sequence(res[1]).tokens.tolist() == [5, 6]


@root_only
def test_a_lock_file_of_another_user_is_refused(tmp_path):
    name = unique_name()
    path = _segment.lock_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.close(fd)
    os.chown(path, NOBODY, NOBODY)
    try:
        with pytest.raises(shmkv.AccessDeniedError, match=f"uid {NOBODY}"):
            shmkv.create(name, layers=1, kv_heads=1, head_dim=2)
        assert not _exists(name)  # refused before any segment was made
        assert os.stat(path).st_uid == NOBODY  # and theirs is left alone
    finally:
        os.unlink(path)


def _open_until_refused(name):
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 9, hard))
    handles = []
    try:
        for _ in range(100):
            handles.append(shmkv.attach(name, readonly=True))
    except shmkv.CacheFullError as e:
        return "CacheFullError", str(e), len(handles)
    except OSError as e:
        return type(e).__name__, str(e), len(handles)
    return "none", "", len(handles)


def test_out_of_descriptors_is_a_clear_error(make_store):
    store = make_store()
    kind, msg, opened = run_in_process(_open_until_refused, store.name, start_method="fork", timeout=60)
    assert kind == "CacheFullError" and "ulimit" in msg and 0 < opened < 100


# -- snapshots ---------------------------------------------------------------------


def _crafted(src: str, dst: str, mutate) -> str:
    """Copy snapshot ``src`` to ``dst`` with its header changed by ``mutate`` (valid checksum)."""
    with open(src, "rb") as f:
        unp = msgpack.Unpacker(f, raw=False)
        head = unp.unpack()
        used = unp.tell()
        f.seek(used)
        rest = f.read()
    mutate(head)
    meta = {k: head[k] for k in ("format", "version", "layout", "sequences", "chunk")}
    head["meta_crc"] = zlib.crc32(msgpack.packb(meta))
    with open(dst, "wb") as f:
        f.write(msgpack.packb(head))
        f.write(rest)
    return dst


def _set_seq(key, value):
    def mutate(head):
        head["sequences"][0][key] = value
    return mutate


def _set_layout(key, value):
    def mutate(head):
        head["layout"][key] = value
    return mutate


def test_foreign_msgpack_is_refused_from_its_first_bytes(tmp_path):
    path = tmp_path / "foreign.msgpack"
    with open(path, "wb") as f:
        f.write(msgpack.packb({"data": [b"x" * (1 << 20)] * 16}))

    class Counting(io.FileIO):
        consumed = 0

        def read(self, n=-1):
            data = super().read(n)
            Counting.consumed += len(data)
            return data

        def read1(self, n=-1):
            return self.read(n)

    with Counting(path, "rb") as f, pytest.raises(shmkv.SnapshotError, match="not a shmkv snapshot"):
        shmkv.read_header(f)
    assert Counting.consumed <= 1 << 16


def test_header_larger_than_the_cap_is_refused(make_store, tmp_path, monkeypatch):
    store = make_store()
    seq = store.create_sequence(capacity=64)
    seq.extend(*_kv(2, 60))
    store.save(tmp_path / "big.shmkv")
    monkeypatch.setattr(_snapshot_format, "MAX_HEADER", 512)
    with pytest.raises(shmkv.SnapshotError, match="header larger than 512 bytes"):
        shmkv.read_header(tmp_path / "big.shmkv")


def test_full_snapshot_file_system_is_cache_full_and_keeps_the_old_file(make_store, tmp_path, monkeypatch):
    store = make_store()
    seq = store.create_sequence(capacity=4)
    seq.extend(*_kv(2, 2))
    path = tmp_path / "s.shmkv"
    store.save(path)
    old = path.read_bytes()
    seq.extend(*_kv(2, 1))

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_save.os, "fsync", no_space)
    with pytest.raises(shmkv.CacheFullError, match="previous snapshot"):
        store.save(path)
    assert path.read_bytes() == old and sorted(os.listdir(tmp_path)) == ["s.shmkv"]


def _dead_pid() -> tuple[int, int]:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    start = _save.process_start_time(p.pid)
    p.wait()
    return p.pid, start


def test_stale_temporary_files_are_removed_by_the_next_save_and_by_gc(make_store, tmp_path, monkeypatch):
    store = make_store()
    # gc judges only this test's store (a test never runs a global gc: it would remove the dead
    # stores of other tests and programs on the machine, a creator-killed store another test still reads)
    monkeypatch.setattr(_lifecycle, "list_stores", lambda: [store.name])
    store.create_sequence(capacity=4).extend(*_kv(2, 2))
    pid, start = _dead_pid()
    me, my_start = os.getpid(), _save.process_start_time(os.getpid())
    stale = [tmp_path / f".s.shmkv.tmp-{pid}-{start}-0badf00d", tmp_path / f".s.shmkv.tmp-{pid}-0badf00e"]
    live = tmp_path / f".s.shmkv.tmp-{me}-{my_start}-0badf00f"
    other = tmp_path / f".t.shmkv.tmp-{pid}-{start}-0badf010"
    for f in [*stale, live, other]:
        f.write_bytes(b"half a snapshot")
    # a live writer holds a flock on its file (the pid in a name means nothing in another PID
    # namespace, and gets reused: tests/test_snapshot_temps_liveness.py)
    writer = os.open(live, os.O_WRONLY)
    try:
        fcntl.flock(writer, fcntl.LOCK_EX)
        store.save(tmp_path / "s.shmkv")
        assert not any(f.exists() for f in stale)
        assert live.exists() and other.exists()  # a live writer's, and another target's (not this save's)
        shmkv.gc(snapshot_dirs=[tmp_path], grace=1e9)
        assert live.exists() and not other.exists()
    finally:
        os.close(writer)


# -- bad input: the error class, and the store unchanged -------------------------------


def _snapshot_file(store, tmp_path):
    path = str(tmp_path / "good.shmkv")
    store.save(path)
    return path


def _scribbled_client_table(store, tmp_path):
    row = store._engine.clients_np[-1]
    saved = row.copy()
    row[0] = 1 << 40
    try:
        shmkv.attach(store.name)
    finally:
        row[:] = saved


def _restore_crafted(mutate):
    def case(store, tmp_path):
        src = _snapshot_file(store, tmp_path)
        store.restore(_crafted(src, str(tmp_path / "crafted.shmkv"), mutate))
    return case


def _load_crafted(mutate):
    def case(store, tmp_path):
        src = _snapshot_file(store, tmp_path)
        name = unique_name()
        try:
            shmkv.load(_crafted(src, str(tmp_path / "crafted.shmkv"), mutate), name=name).unlink()
        finally:
            assert not _exists(name)
    return case


def _reversed_positions(head):
    pos = np.frombuffer(head["sequences"][0]["positions"], "<i8")[::-1]
    head["sequences"][0]["positions"] = pos.astype("<i8").tobytes()


def _int8_append(value):
    def case(store, tmp_path):
        seq = store.sequence(store.sequences()[0].id, write=True)
        k = np.zeros((1, H, D))
        k[0, 1, 2] = value
        seq.append(0, k, np.zeros((1, H, D)))
    return case


BAD_INPUT = {
    "create lock_timeout=-1": ("float32", shmkv.InvalidArgumentError,
                               lambda s, t: shmkv.create(unique_name(), layers=1, kv_heads=1, head_dim=1,
                                                         lock_timeout=-1)),
    "attach lock_timeout=-1": ("float32", shmkv.InvalidArgumentError,
                               lambda s, t: shmkv.attach(s.name, lock_timeout=-1)),
    "create dtype=None": ("float32", shmkv.InvalidArgumentError,
                          lambda s, t: shmkv.create(unique_name(), layers=1, kv_heads=1, head_dim=1, dtype=None)),
    "create mode=-1": ("float32", shmkv.InvalidArgumentError,
                       lambda s, t: shmkv.create(unique_name(), layers=1, kv_heads=1, head_dim=1, mode=-1)),
    "create mode=0o4777": ("float32", shmkv.InvalidArgumentError,
                           lambda s, t: shmkv.create(unique_name(), layers=1, kv_heads=1, head_dim=1, mode=0o4777)),
    "create mode=0o044": ("float32", shmkv.InvalidArgumentError,
                          lambda s, t: shmkv.create(unique_name(), layers=1, kv_heads=1, head_dim=1, mode=0o044)),
    "create absurd dimensions": ("float32", shmkv.InvalidArgumentError,
                                 lambda s, t: shmkv.create(unique_name(), layers=4096, kv_heads=1 << 20,
                                                           head_dim=1 << 20, max_tokens=1 << 40)),
    "save seq_ids=[1.7]": ("float32", shmkv.InvalidArgumentError,
                           lambda s, t: s.save(t / "x.shmkv", seq_ids=[1.7])),
    "save seq_ids=['a']": ("float32", shmkv.InvalidArgumentError,
                           lambda s, t: s.save(t / "x.shmkv", seq_ids=["a"])),
    "save seq_ids='1'": ("float32", shmkv.InvalidArgumentError, lambda s, t: s.save(t / "x.shmkv", seq_ids="1")),
    "restore seq_ids=[1.7]": ("float32", shmkv.InvalidArgumentError,
                              lambda s, t: s.restore(_snapshot_file(s, t), seq_ids=[1.7])),
    "restore a directory": ("float32", shmkv.SnapshotError, lambda s, t: s.restore(t)),
    "save to a directory": ("float32", shmkv.InvalidArgumentError, lambda s, t: s.save(t)),
    "restore id 2**63-1": ("float32", shmkv.SnapshotError, _restore_crafted(_set_seq("id", 2**63 - 1))),
    "restore id 0": ("float32", shmkv.SnapshotError, _restore_crafted(_set_seq("id", 0))),
    "restore decreasing positions": ("float32", shmkv.SnapshotError, _restore_crafted(_reversed_positions)),
    "restore huge encoder": ("float32", shmkv.SnapshotError, _restore_crafted(_set_seq("encoder_length", 1 << 32))),
    "restore max_tokens=2**40": ("float32", shmkv.SnapshotError, _restore_crafted(_set_layout("max_tokens", 1 << 40))),
    "load max_tokens=2**40": ("float32", shmkv.SnapshotError, _load_crafted(_set_layout("max_tokens", 1 << 40))),
    "load id 2**63-1": ("float32", shmkv.SnapshotError, _load_crafted(_set_seq("id", 2**63 - 1))),
    "scribbled client table": ("float32", shmkv.CorruptStoreError, _scribbled_client_table),
    "int8 value 1e39": ("int8", shmkv.InvalidArgumentError, _int8_append(1e39)),
    "int8 value -1e39": ("int8", shmkv.InvalidArgumentError, _int8_append(-1e39)),
    "int8 value nan": ("int8", shmkv.InvalidArgumentError, _int8_append(np.nan)),
    "extend past max_tokens": ("float32", shmkv.CacheFullError,
                               lambda s, t: s.sequence(s.sequences()[0].id, write=True).extend(*_kv(2, 300))),
}


def _state(store):
    out = [(i.id, i.length, i.capacity) for i in store.sequences()]
    for info in store.sequences():
        seq = store.sequence(info.id)
        out.append((seq.tokens.tolist(), seq.positions.tolist(), [seq.keys(i).tolist() for i in range(2)],
                     [seq.values(i).tolist() for i in range(2)]))
    out.append(store.stats().free_tokens)
    return out


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_and_changes_nothing(make_store, tmp_path, case):
    dtype, error, call = BAD_INPUT[case]
    store = make_store(layers=2, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=256)
    sentinel = store.create_sequence(capacity=8)
    sentinel.extend(np.arange(2 * 3 * H * D, dtype=np.float32).reshape(2, 3, H, D) / 7,
                    np.ones((2, 3, H, D)), tokens=[11, 12, 13], positions=[4, 5, 9])
    sentinel.release()
    before = _state(store)
    with pytest.raises(error) as info:
        call(store, tmp_path)
    assert isinstance(info.value, shmkv.ShmkvError)
    assert _state(store) == before


# -- the CLI ----------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["snapshot", "{name}", "--dir", "{dir}", "--keep", "0", "--count", "1"], "--keep: 0 must be at least 1"),
    (["snapshot", "{name}", "--dir", "{dir}", "--keep", "-1", "--count", "1"], "--keep: -1 must be at least 1"),
    (["watch", "{name}", "--interval", "-1", "--count", "2"], "--interval: -1 must be"),
    (["save", "{name}", "{dir}/x.shmkv", "--seq", "a,b"], "--seq: 'a,b' is not"),
])
def test_cli_bad_values_are_usage_errors(store, tmp_path, argv, says, capsys):
    store.create_sequence(capacity=4).extend(*_kv(2, 1))
    kept = tmp_path / f"{store.name}-20000101T000000000000Z.shmkv"
    store.save(kept)  # an older snapshot: --keep 0 must not delete it
    argv = [a.format(name=store.name, dir=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        shmkv.cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and "usage:" in err
    assert says in err
    assert sorted(os.listdir(tmp_path)) == [kept.name]
    with pytest.raises(shmkv.InvalidArgumentError, match="keep=0"):
        shmkv.cli.snapshot_loop(store.name, str(tmp_path), 1.0, 0, count=1)
    assert sorted(os.listdir(tmp_path)) == [kept.name]


def test_identity_is_in_the_header_and_differs_per_store(make_store):
    a, b = make_store(), make_store()
    assert a._engine.identity and b._engine.identity and a._engine.identity != b._engine.identity
    assert _removal.read_identity(a.name) == a._engine.identity
    words = np.frombuffer(a._engine._hseg.mm, np.int64, 64)
    assert int(words[_header.W_IDENTITY]) == a._engine.identity
    del words


def test_a_store_of_the_previous_format_version_is_refused_naming_both(make_store):
    """A store whose header says version 5 (a format without lazy pages, stand-ins, the page mark and
    lenders past their length) is never read by this shmkv: attach raises CorruptStoreError
    naming its version and ours, and the store is left as it was."""
    store = make_store()
    words = store._engine.hdr
    words[_header.W_VERSION] = 5
    try:
        ours = _header.FORMAT_VERSION
        with pytest.raises(shmkv.CorruptStoreError, match=rf"header version 5; this shmkv reads version {ours}: .*"
                           rf"\(shmkv rm {store.name}\)"):
            shmkv.attach(store.name)
    finally:
        words[_header.W_VERSION] = _header.FORMAT_VERSION
    with shmkv.attach(store.name) as again:
        assert again.stats().sequences == 0
