"""Snapshot files."""

from __future__ import annotations

import io
import itertools
import os
import random
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
from procs.store_ops import save_forever, save_past_a_file_size_limit, writer_loop

import shmkv
from shmkv.testing import ChildFailed, assert_store_state, run_in_process, start_in_process, unique_name


def _fill(store: shmkv.Store, rng: np.random.Generator, n_seqs: int = 5) -> dict[int, tuple]:
    lay = store.layout
    made = {}
    for i in range(n_seqs):
        n = int(rng.integers(0, 30)) if i else 0  # one empty sequence
        seq = store.create_sequence(capacity=max(1, n))
        k = rng.standard_normal((lay.layers, n, lay.kv_heads, lay.head_dim))
        v = rng.standard_normal((lay.layers, n, lay.kv_heads, lay.head_dim))
        toks = rng.integers(0, 50_000, n)
        pos = np.cumsum(rng.integers(1, 4, n)) if n else np.zeros(0, int)
        seq.extend(k, v, tokens=toks, positions=pos)
        seq.release()
        made[seq.id] = n
    return made


def _content(store: shmkv.Store) -> dict[int, tuple]:
    out = {}
    for info in store.sequences():
        s = store.sequence(info.id)
        layers = range(store.layout.layers)
        out[info.id] = (
            np.stack([s.keys(layer) for layer in layers]).tobytes(),
            np.stack([s.values(layer) for layer in layers]).tobytes(),
            s.tokens.tolist(),
            s.positions.tolist(),
            # the stored bytes themselves (int8 codes and scales, bfloat16 bits): never re-quantized
            b"".join(a.tobytes() for layer in layers for a in (*s.raw_keys(layer), *s.raw_values(layer))
                     if a is not None),
        )
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16", "int8"])
def test_round_trip_bit_for_bit(make_store, tmp_path, dtype):
    store = make_store(layers=3, kv_heads=2, head_dim=4, dtype=dtype, max_tokens=512, max_seqs=8)
    _fill(store, np.random.default_rng(1))
    before = _content(store)
    path = tmp_path / "snap.shmkv"
    seen = []
    nbytes = store.save(path, progress=lambda done, total: seen.append((done, total)))
    assert nbytes == path.stat().st_size
    assert seen[-1] == (nbytes, nbytes) and all(a <= b for (a, _), (b, _) in itertools.pairwise(seen))
    # any msgpack reader walks it: one header map, then bins
    with open(path, "rb") as f:
        objs = list(msgpack.Unpacker(f, raw=False))
    assert objs[0]["format"] == "shmkv-snapshot" and all(isinstance(o, bytes) for o in objs[1:])
    name = unique_name()
    loaded = shmkv.load(path, name=name)
    try:
        assert _content(loaded) == before
        assert loaded.layout.geometry == store.layout.geometry
    finally:
        loaded.close()
    # restore into the same store after damage to it
    for info in store.sequences():
        w = store.sequence(info.id, write=True)
        w.truncate(0)
        w.free()
    assert store.restore(path) == sorted(before)
    assert _content(store) == before


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_partial_save_and_partial_restore(make_store, tmp_path, dtype):
    store = make_store(max_tokens=512, dtype=dtype)
    _fill(store, np.random.default_rng(2))
    before = _content(store)
    ids = sorted(before)
    path = tmp_path / "part.shmkv"
    store.save(path, seq_ids=ids[1:3])
    assert shmkv.read_header(path).seq_ids == ids[1:3]
    other = make_store(max_tokens=300, max_seqs=3, dtype=dtype)  # other limits, same geometry
    assert other.restore(path, seq_ids=[ids[2]]) == [ids[2]]
    assert _content(other) == {ids[2]: before[ids[2]]}
    with pytest.raises(shmkv.SequenceNotFound, match=str(ids[0])):
        other.restore(path, seq_ids=[ids[0]])
    # restored ids are not handed out again
    assert other.create_sequence().id > ids[2]


def test_streams_and_layout_mismatch(make_store):
    store = make_store()
    _fill(store, np.random.default_rng(3))
    r, w = os.pipe()
    with open(w, "wb") as wf, open(r, "rb") as rf:
        t = threading.Thread(target=store.save, args=(wf,))
        t.start()
        name = unique_name()
        loaded = shmkv.load(rf, name=name)
        t.join()
    try:
        assert _content(loaded) == _content(store)
    finally:
        loaded.close()
    buf = io.BytesIO()
    store.save(buf)
    for kw in ({"head_dim": 5}, {"dtype": "float16"}, {"layers": 3}):
        other = make_store(**kw)
        buf.seek(0)
        with pytest.raises(shmkv.LayoutMismatchError, match="geometry"):
            other.restore(buf)
        assert other.sequences() == []


@pytest.mark.parametrize("kind", ["fifo", "device", "socket"])
def test_a_save_to_a_path_that_is_no_regular_file_is_refused(make_store, tmp_path, kind):
    """A save to a path renames a new file into place: where the path is a device (/dev/null, as
    root), a FIFO or a socket, that would put a regular file in its place. It is refused, naming
    the kind and how to write into it, and the path stays what it was."""
    import socket
    import stat

    store = make_store(max_tokens=64)
    _fill(store, np.random.default_rng(1), n_seqs=1)
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    else:
        if os.geteuid() != 0:
            pytest.skip("a device node needs root (CI runs as root)")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a null device of our own
    before = os.lstat(path).st_mode
    with pytest.raises(shmkv.InvalidArgumentError, match=f"is a {'FIFO' if kind == 'fifo' else ''}.*not a regular"):
        store.save(path)
    assert os.lstat(path).st_mode == before
    assert not [p for p in os.listdir(tmp_path) if p != kind]  # (no temporary file left)


def test_a_save_through_a_symlink_replaces_the_file_it_names(make_store, tmp_path):
    """latest.shmkv -> snap-1.shmkv: the save replaces snap-1.shmkv; the link stays a link."""
    store = make_store(max_tokens=64)
    _fill(store, np.random.default_rng(2), n_seqs=1)
    target = tmp_path / "snap-1.shmkv"
    target.write_bytes(b"an older snapshot")
    link = tmp_path / "latest.shmkv"
    link.symlink_to(target.name)
    store.save(link)
    assert link.is_symlink() and os.readlink(link) == target.name
    loaded = shmkv.load(target, name=unique_name())
    try:
        assert _content(loaded) == _content(store)
    finally:
        loaded.close()


def test_save_to_a_file_object_at_an_offset(make_store, tmp_path):
    """The checksums go into the header after the arrays (written meanwhile): also
    into a buffered file that already holds other bytes, and the result reads back."""
    store = make_store(max_tokens=512)
    _fill(store, np.random.default_rng(5), n_seqs=2)  # small: it all stays in the file's buffer
    path = tmp_path / "inside.bin"
    prefix = b"not a snapshot: a header of someone else's"
    with open(path, "wb") as f:  # buffered, seekable: the checksums are patched in place
        f.write(prefix)
        n = store.save(f)
        f.write(b"tail")
    data = path.read_bytes()
    assert len(data) == len(prefix) + n + 4
    streamed = io.BytesIO()  # no descriptor: the checksums first (a reading pass), then everything in order
    store.save(streamed)
    assert data[len(prefix) : len(prefix) + n] == streamed.getvalue()
    loaded = shmkv.load(io.BytesIO(streamed.getvalue()), name=unique_name())
    try:
        assert _content(loaded) == _content(store)
    finally:
        loaded.close()


@pytest.mark.parametrize("buffering", [0, -1])
def test_save_to_a_file_opened_for_appending(make_store, tmp_path, buffering):
    """An append-mode file is seekable, but Linux's pwrite appends there whatever the offset:
    the checksums must not be patched in place (they would land after the end), and the
    snapshot must restore."""
    store = make_store(max_tokens=512)
    _fill(store, np.random.default_rng(6), n_seqs=2)
    path = tmp_path / "appended.shmkv"
    path.write_bytes(b"")
    with open(path, "ab", buffering=buffering) as f:
        n = store.save(f)
    assert path.stat().st_size == n
    streamed = io.BytesIO()
    store.save(streamed)
    assert path.read_bytes() == streamed.getvalue()
    loaded = shmkv.load(path, name=unique_name())
    try:
        assert _content(loaded) == _content(store)
    finally:
        loaded.close()


def test_the_checksum_is_zlibs_crc32_whichever_computes_it(make_store, tmp_path, monkeypatch):
    """With the "fast" extra, ISA-L computes the checksums: the same CRC-32 as zlib's, so
    a snapshot written with one loads with the other."""
    import zlib

    from shmkv._snapshot import save as _save
    from shmkv._snapshot import format as _snapshot_format

    rng = np.random.default_rng(6)
    for n in (0, 1, 7, 4096, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _snapshot_format.crc32(data) == zlib.crc32(data)
        assert _snapshot_format.crc32(data, 12345) == zlib.crc32(data, 12345)
    store = make_store(max_tokens=512)
    _fill(store, rng)
    before = _content(store)
    fast, plain = tmp_path / "fast.shmkv", tmp_path / "plain.shmkv"
    store.save(fast)
    for module in (_save, _snapshot_format):
        monkeypatch.setattr(module, "crc32", zlib.crc32)
    store.save(plain)
    assert fast.read_bytes() == plain.read_bytes()
    loaded = shmkv.load(fast, name=unique_name())
    try:
        assert _content(loaded) == before
    finally:
        loaded.close()


class _Trickle(io.RawIOBase):
    """A raw stream that takes at most 777 bytes of each write, as a raw file may."""

    def __init__(self) -> None:
        self.got = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:
        return self.got.write(memoryview(b)[:777])


def test_a_stream_that_takes_part_of_each_write_gets_all_of_it(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=256, max_seqs=4)
    _fill(store, np.random.default_rng(5), n_seqs=3)
    want = _content(store)
    out = _Trickle()
    assert store.save(out) == len(out.got.getvalue())
    again = shmkv.load(io.BytesIO(out.got.getvalue()), unique_name("trk"))
    try:
        assert _content(again) == want
    finally:
        again.close()


def test_an_object_with_only_a_write_method_takes_a_snapshot(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=256, max_seqs=4)
    _fill(store, np.random.default_rng(6), n_seqs=2)
    got = io.BytesIO()

    class Sink:
        write = got.write  # (no writable(), no seek: a duck-typed stream)

    assert store.save(Sink()) == len(got.getvalue())
    again = shmkv.load(io.BytesIO(got.getvalue()), unique_name("snk"))
    try:
        assert _content(again) == _content(store)
    finally:
        again.close()


def test_a_save_that_runs_out_of_room_keeps_the_snapshot_before(make_store, tmp_path):
    """A file system that fills up during the last array takes part of a write and reports
    nothing: the save writes the rest (which fails) and raises, the snapshot already at the
    path stays, and no temporary file is left."""
    store = make_store(layers=2, kv_heads=4, head_dim=64, dtype="float32", max_tokens=4096, max_seqs=4)
    seq = store.create_sequence(capacity=600)
    seq.extend(np.ones((2, 10, 4, 64)), np.ones((2, 10, 4, 64)))
    path = tmp_path / "cache.shmkv"
    store.save(path)
    good = path.read_bytes()
    rng = np.random.default_rng(0)
    seq.extend(rng.standard_normal((2, 590, 4, 64)), rng.standard_normal((2, 590, 4, 64)))  # about 2.4 MB now
    seq.release()
    for limit in (2_000_000, len(good) + 7):  # inside the last array's bytes; inside the header's
        raised = run_in_process(save_past_a_file_size_limit, store.name, str(path), limit)
        assert raised, f"the save past {limit} bytes returned"
        assert path.read_bytes() == good, (limit, raised)
        assert sorted(os.listdir(tmp_path)) == ["cache.shmkv"]


def _damaged_variants(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    out = [("empty", b""), ("random", bytes(rng.getrandbits(8) for _ in range(5000))),
           ("foreign msgpack", msgpack.packb({"hello": [1, 2, 3]})),
           ("foreign format", msgpack.packb({"format": "npy", "version": 1})),
           ("trailing garbage", data + b"\x00\x01")]
    for cut in sorted({1, 2, 10, 50, len(data) // 3, len(data) // 2, len(data) - 5, len(data) - 1}
                      | {rng.randrange(1, len(data)) for _ in range(25)}):
        out.append((f"truncated at {cut}", data[:cut]))
    for _ in range(60):
        at = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        out.append((f"bit flipped at {at}", bytes(flipped)))
    # a header that declares absurd sizes (consistent meta_crc, lying lengths)
    head = next(iter(msgpack.Unpacker(io.BytesIO(data), raw=False)))
    meta = {k: head[k] for k in ["format", "version", "layout", "sequences", "chunk"]}
    meta["sequences"][1]["length"] = 1 << 40
    meta["layout"]["max_tokens"] = 1 << 45
    import zlib

    meta["meta_crc"] = zlib.crc32(msgpack.packb({k: meta[k] for k in list(meta)[:5]}))
    meta["checksums"] = head["checksums"]
    out.append(("absurd sizes", msgpack.packb(meta)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_damaged_files_are_refused_and_store_untouched(make_store, tmp_path, dtype):
    seed = 20261122
    print(f"seed={seed}")
    rng = random.Random(seed)
    src = make_store(max_tokens=512, dtype=dtype)
    _fill(src, np.random.default_rng(4))
    good = io.BytesIO()
    src.save(good)
    data = good.getvalue()
    target = make_store(max_tokens=512, dtype=dtype)
    _fill(target, np.random.default_rng(5), n_seqs=3)
    before = _content(target)
    path = tmp_path / "bad.shmkv"
    for what, blob in _damaged_variants(data, rng):
        path.write_bytes(blob)
        with pytest.raises(shmkv.SnapshotError) as info:
            target.restore(path)
        assert str(path) in str(info.value), what
        with pytest.raises(shmkv.SnapshotError):
            shmkv.load(path, name=unique_name())
        assert _content(target) == before, what
    assert len(target.sequences()) == 3


@pytest.mark.slow
def test_killing_the_saver_never_damages_the_target(make_store, tmp_path):
    store = make_store(layers=4, kv_heads=4, head_dim=64, max_tokens=8192, max_seqs=4)
    rng = np.random.default_rng(6)
    for _ in range(3):
        s = store.create_sequence(capacity=2000)
        s.extend(rng.standard_normal((4, 2000, 4, 64)), rng.standard_normal((4, 2000, 4, 64)))
    path = tmp_path / "target.shmkv"
    store.save(path)
    want = _content(store)
    seed = 7
    print(f"seed={seed}")
    r = random.Random(seed)
    for i in range(6):
        ready = tmp_path / f"ready{i}"
        child = start_in_process(save_forever, store.name, str(path), str(ready), start_method="fork", timeout=60)
        t_end = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < t_end
            time.sleep(0.005)
        time.sleep(r.uniform(0, 0.05))
        child.kill(signal.SIGKILL)
        with pytest.raises(ChildFailed, match="signal 9"):
            child.result()
        name = unique_name()
        loaded = shmkv.load(path, name=name)  # SnapshotError here would be a damaged target
        try:
            assert _content(loaded) == want
        finally:
            loaded.close()
    for f in tmp_path.iterdir():  # leftovers are temporary files only, never the target
        assert f.name == "target.shmkv" or f.name.startswith((".target.shmkv.tmp-", "ready"))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_save_while_two_writers_append(make_store, tmp_path, method):
    store = make_store(layers=3, kv_heads=2, head_dim=4, max_tokens=8192, max_seqs=4)
    ids = []
    for _ in range(2):
        s = store.create_sequence(capacity=16)
        ids.append(s.id)
        s.release()
    n = 600
    writers = [start_in_process(writer_loop, store.name, i, n, 0, start_method=method, timeout=120) for i in ids]
    paths = []
    while any(w.process.is_alive() for w in writers) and len(paths) < 40:
        p = tmp_path / f"s{len(paths)}.shmkv"
        store.save(p)
        paths.append(p)
    assert [w.result() for w in writers] == [n, n]
    paths.append(tmp_path / "final.shmkv")
    store.save(paths[-1])
    lengths = []
    for p in paths:
        name = unique_name()
        loaded = shmkv.load(p, name=name)
        try:
            for i in ids:
                s = loaded.sequence(i)
                length = s.length
                lengths.append(length)
                pos = np.arange(length)
                for layer in range(3):
                    want = i * 100_000 + pos * 16 + layer * 2
                    assert np.array_equal(s.keys(layer).reshape(length, 8), np.repeat(want[:, None], 8, 1))
                    assert np.array_equal(s.values(layer).reshape(length, 8), np.repeat(want[:, None] + 1, 8, 1))
                assert s.tokens.tolist() == list(range(length))
        finally:
            loaded.close()
    assert lengths[-2:] == [n, n]


def _hold_lease(store: shmkv.Store, seq_id: int, held, done) -> None:
    """In a child: hold the write lease on ``seq_id`` until ``done`` is set."""
    seq = store.sequence(seq_id, write=True)
    held.set()
    assert done.wait(60)
    seq.release()


def test_restore_refuses_a_sequence_a_live_process_leases_and_changes_nothing(make_store, tmp_path, shmkv_child):
    """A restore replaces the store's sequences of the snapshot's ids; while another live process
    holds the write lease on one of them it raises LeaseError naming that process and changes
    nothing (all or nothing); once the lease is given up, the same restore goes through. (A
    snapshotter restoring beside writers that take leases on any live sequence meets this.)"""
    import multiprocessing as mp

    store = make_store()
    rng = np.random.default_rng(5)
    ids = sorted(_fill(store, rng, n_seqs=3))
    path = tmp_path / "before.shmkv"
    store.save(path)
    more = store.sequence(ids[1], write=True)  # changed after the save: a restore would take it back
    lay = store.layout
    more.extend(np.ones((lay.layers, 3, lay.kv_heads, lay.head_dim)), np.ones((lay.layers, 3, lay.kv_heads,
                                                                                  lay.head_dim)))
    more.release()
    after = _content(store)
    ctx = mp.get_context("fork")
    held, done = ctx.Event(), ctx.Event()
    child = shmkv_child.start(_hold_lease, store, ids[2], held, done, start_method="fork")
    assert held.wait(60)
    with pytest.raises(shmkv.LeaseError, match=f"sequence {ids[2]} .* leased by live process {child.pid}"):
        store.restore(path)
    assert _content(store) == after  # nothing restored, not even the sequences nobody leases
    done.set()
    child.result(60)
    assert store.restore(path) == ids
    assert len(store.sequence(ids[1])) == len(after[ids[1]][2]) - 3


def _windowed(make_store, **kw) -> shmkv.Store:
    return make_store(layers=2, kv_heads=1, head_dim=4, dtype="float32", max_tokens=2048, max_seqs=6,
                      layer_types=["full", "sliding"], **kw)


def _fill_windows(store: shmkv.Store, n: int, seqs: int = 3) -> None:
    for i in range(seqs):
        s = store.create_sequence(capacity=n + 8)
        k = np.arange(2 * n * 4, dtype=np.float32).reshape(2, n, 1, 4) + 1000 * i
        s.extend(k, -k, tokens=np.arange(n) + i)
        s.release()


@pytest.mark.parametrize(("saved", "into", "n"), [
    ({"window": 200}, {"window": 8}, 330),  # kept tokens past the target's buffers (the next slot's data)
    ({"window": 4}, {"window": 64}, 60),  # too few kept for the target's window
    ({"window": 8, "memory": 500}, {"window": 8}, 450),  # the same window, kept past the target's memory
])
def test_a_snapshot_whose_sliding_layers_keep_other_tokens_is_refused(make_store, tmp_path, saved, into, n):
    """Sliding layers keep a window of tokens in a slot's buffer: a snapshot of another window,
    or one keeping more than the target's buffers hold (its memory), is a LayoutMismatchError,
    every sequence of the target as it was."""
    src, dst = _windowed(make_store, **saved), _windowed(make_store, **into)
    _fill_windows(src, n)
    _fill_windows(dst, 5)
    before = _content(dst)
    path = tmp_path / "w.shmkv"
    src.save(path)
    with pytest.raises(shmkv.LayoutMismatchError, match="sliding"):
        dst.restore(path)
    assert _content(dst) == before
    assert_store_state(dst)


def test_a_snapshot_of_the_same_window_and_a_smaller_memory_restores(make_store, tmp_path):
    src, dst = _windowed(make_store, window=8), _windowed(make_store, window=8, memory=500)
    _fill_windows(src, 40)
    want = _content(src)
    src.save(tmp_path / "w.shmkv")
    dst.restore(tmp_path / "w.shmkv")
    assert _content(dst) == want
