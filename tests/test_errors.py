"""Bad input gets the right error class and a message that names it."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest

import shmkv
from shmkv._engine.table import header as _header
from shmkv._engine.memory import segment as _segment
from shmkv.testing import unique_name


def test_error_tree_mixes_in_builtins():
    pairs = [
        (shmkv.CacheFullError, MemoryError), (shmkv.LayoutMismatchError, ValueError),
        (shmkv.SnapshotError, ValueError), (shmkv.LockTimeout, TimeoutError),
        (shmkv.LeaseError, PermissionError), (shmkv.ReadOnlyError, PermissionError),
        (shmkv.SequenceNotFound, KeyError), (shmkv.StoreNotFound, FileNotFoundError),
        (shmkv.NotSupportedError, NotImplementedError), (shmkv.InvalidArgumentError, ValueError),
        (shmkv.CorruptStoreError, ValueError), (shmkv.StoreExistsError, FileExistsError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, shmkv.ShmkvError) and issubclass(cls, builtin)
        e = pickle.loads(pickle.dumps(cls("message 7")))
        assert type(e) is cls and str(e) == "message 7"
    # a refused shared-prefix mapping: an OSError with its errno, public so callers can catch it
    assert issubclass(shmkv.ShareError, shmkv.ShmkvError) and issubclass(shmkv.ShareError, OSError)
    from shmkv._engine.spans import mappings as share

    assert share.ShareError is shmkv.ShareError  # the class the engine raises
    e = pickle.loads(pickle.dumps(shmkv.ShareError(12, "cannot map")))
    assert type(e) is shmkv.ShareError and e.errno == 12 and e.strerror == "cannot map"


@pytest.mark.parametrize("name", ["", "a" * 25, "has space", "slash/x", "dot.x", None, 7, "ü"])
def test_bad_names(name):
    with pytest.raises(shmkv.InvalidArgumentError, match="store name"):
        shmkv.create(name, layers=1, kv_heads=1, head_dim=1)
    with pytest.raises(shmkv.InvalidArgumentError, match="store name"):
        shmkv.attach(name)


@pytest.mark.parametrize("kw, match", [
    ({"layers": 0}, "layers=0"), ({"kv_heads": -1}, "kv_heads=-1"), ({"head_dim": 2.5}, "head_dim=2.5"),
    ({"max_tokens": 0}, "max_tokens=0"), ({"max_seqs": True}, "max_seqs=True"),
    ({"dtype": "complex64"}, "complex64"), ({"dtype": "nonsense"}, "nonsense"),
    ({"layer_types": ["full"]}, "one kind per layer"), ({"layer_types": ["full", "dense"]}, "dense"),
])
def test_bad_layout(kw, match):
    params = dict(layers=2, kv_heads=1, head_dim=2)
    params.update(kw)
    with pytest.raises(shmkv.InvalidArgumentError, match=match):
        shmkv.create(unique_name(), **params)


def test_existing_and_missing_stores(store):
    with pytest.raises(shmkv.StoreExistsError, match=store.name):
        shmkv.create(store.name, layers=1, kv_heads=1, head_dim=1)
    missing = unique_name("nope")
    with pytest.raises(shmkv.StoreNotFound, match="shmkv ls"):
        shmkv.attach(missing)
    with pytest.raises(shmkv.StoreNotFound):
        shmkv.remove(missing)


def test_bad_append_arguments(store):
    seq = store.create_sequence(capacity=4)
    good = np.zeros((1, 2, 4), np.float32)
    cases = [
        ((0, np.zeros((1, 2, 5)), np.zeros((1, 2, 5))), "kv_heads=2, head_dim=4"),
        ((0, np.zeros((1, 2, 4)), np.zeros((2, 2, 4))), "must both be"),
        ((0, np.zeros((4,)), np.zeros((4,))), "must both be"),
        ((0, np.zeros((1, 1, 2, 4)), np.zeros((1, 1, 2, 4))), "must both be"),
        ((0, good.astype(np.complex64), good), "real numbers"),
        ((0, np.full((1, 2, 4), "x"), good), "real numbers"),
        ((2, good, good), "layer=2 is out of range"),
        ((-1, good, good), "layer=-1"),
        (("0", good, good), "must be an int"),
    ]
    for args, match in cases:
        with pytest.raises(shmkv.InvalidArgumentError, match=match):
            seq.append(*args)
    assert seq.pending == 0 and seq.length == 0  # nothing was written


def test_bad_counts_and_ids(store):
    seq = store.create_sequence(capacity=4)
    seq.extend(np.zeros((2, 3, 2, 4)), np.zeros((2, 3, 2, 4)))
    seq.truncate(4)  # beyond the length: clamped, a no-op (as Hugging Face's crop)
    assert seq.length == 3
    with pytest.raises(shmkv.InvalidArgumentError, match="n=-1"):
        seq.truncate(-1)
    with pytest.raises(shmkv.InvalidArgumentError, match="begin=2 end=1"):
        seq.remove(2, 1)
    with pytest.raises(shmkv.InvalidArgumentError, match="n=9"):
        seq.shift_left(9)
    with pytest.raises(shmkv.InvalidArgumentError, match="n=5 exceeds"):
        seq.fork(5)
    with pytest.raises(shmkv.SequenceNotFound, match="12345"):
        store.sequence(12345)
    with pytest.raises(shmkv.InvalidArgumentError, match="must be an int"):
        store.sequence("1")
    other = store.create_sequence(capacity=1)
    with pytest.raises(shmkv.InvalidArgumentError, match="n=4 exceeds"):
        store.copy_prefix(seq.id, other.id, 4)
    with pytest.raises(shmkv.InvalidArgumentError, match="both"):
        store.copy_prefix(seq.id, seq.id, 1)
    with pytest.raises(shmkv.InvalidArgumentError, match="capacity=0"):
        store.create_sequence(capacity=0)
    assert seq.length == 3


def test_bad_commit(store):
    seq = store.create_sequence(capacity=4)
    seq.append(0, np.zeros((2, 2, 4)), np.zeros((2, 2, 4)))
    with pytest.raises(shmkv.InvalidArgumentError, match=r"different pending token counts \[2, 0\]"):
        seq.commit()
    seq.append(1, np.zeros((2, 2, 4)), np.zeros((2, 2, 4)))
    with pytest.raises(shmkv.InvalidArgumentError, match="tokens must be 2 ints"):
        seq.commit(tokens=[1, 2, 3])
    with pytest.raises(shmkv.InvalidArgumentError, match="must increase"):
        seq.commit(positions=[5, 5])
    assert seq.length == 0
    assert seq.commit(positions=[3, 7]) == 2
    with pytest.raises(shmkv.InvalidArgumentError, match="after the last committed position 7"):
        seq.extend(np.zeros((2, 1, 2, 4)), np.zeros((2, 1, 2, 4)), positions=[7])
    assert seq.length == 2 and seq.pending == 0
    with pytest.raises(shmkv.InvalidArgumentError, match=r"\[layers=2, n, kv_heads=2, head_dim=4\]"):
        seq.extend(np.zeros((1, 1, 2, 4)), np.zeros((1, 1, 2, 4)))


def test_freed_sequence_and_closed_store(make_store):
    store = make_store()
    seq = store.create_sequence()
    reader = store.sequence(seq.id)
    seq.free()
    with pytest.raises(shmkv.SequenceNotFound, match="freed"):
        reader.keys(0)
    other = store.create_sequence()
    store.close()
    with pytest.raises(shmkv.StoreClosedError, match="attach again"):
        store.create_sequence()
    with pytest.raises(shmkv.StoreClosedError):
        other.keys(0)


def _forge(name: str, size: int, content: bytes) -> None:
    seg = _segment.Segment.create(_segment.header_name(name), size)
    assert seg.mm is not None
    seg.mm[: len(content)] = content
    seg.close()


@pytest.mark.parametrize("where", ["kv_heads", "layer kind"])
def test_a_header_damaged_after_an_attach_is_refused_at_the_next(make_store, where):
    """attach remembers the headers this process found intact (a forked worker inherits them):
    one changed since is read and checked again, and refused; put back, it attaches again."""
    store = make_store(layers=2)
    shmkv.attach(store.name).close()
    hdr = _segment.Segment.open(_segment.header_name(store.name), readonly=False)
    raw = np.frombuffer(hdr.mm, np.uint8)
    at = _header.W_KV_HEADS * 8 if where == "kv_heads" else _header.LAYER_KINDS_OFF + 1
    was = int(raw[at])
    raw[at] = was + 1
    try:
        with pytest.raises(shmkv.CorruptStoreError, match="damaged"):
            shmkv.attach(store.name)
    finally:
        raw[at] = was
        del raw
        hdr.close()
    again = shmkv.attach(store.name)
    assert again.layout == store.layout
    again.close()


@pytest.mark.parametrize("what", ["foreign", "tiny", "version", "checksum", "no-data"])
def test_foreign_or_damaged_header(make_store, what):
    if what in ("version", "checksum", "no-data"):
        store = make_store()
        name = store.name
        hdr = _segment.Segment.open(_segment.header_name(name), readonly=False)
        words = np.frombuffer(hdr.mm, np.int64, 64)
        if what == "version":
            words[_header.W_VERSION] = 99
        elif what == "checksum":
            words[_header.W_KV_HEADS] = 3
        else:
            _segment.unlink(_segment.data_name(name))
        del words
        hdr.close()
        expected = shmkv.StoreNotFound if what == "no-data" else shmkv.CorruptStoreError
        match = {"version": "version 99", "checksum": "damaged", "no-data": "no store named"}[what]
        with pytest.raises(expected, match=match):
            shmkv.attach(name)
        return
    name = unique_name("forged")
    try:
        if what == "foreign":
            _forge(name, 4096, b"not a shmkv header at all" * 10)
            match = "bad magic"
        else:
            _forge(name, 100, b"\x00" * 100)
            match = "too small"
        with pytest.raises(shmkv.CorruptStoreError, match=match):
            shmkv.attach(name, timeout=0.05)
    finally:
        _segment.unlink(_segment.header_name(name))


@pytest.mark.parametrize(("err", "expected"), [
    (28, shmkv.CacheFullError),  # ENOSPC
    (9, shmkv.StoreClosedError),  # EBADF
    (13, shmkv.AccessDeniedError),  # EACCES
    (5, shmkv.CorruptStoreError),  # EIO: nothing more fitting, never a raw OSError
])
@pytest.mark.parametrize("call", ["reserve", "write", "copy_in"])
def test_segment_io_errors_are_in_the_tree(make_store, monkeypatch, tmp_path, err, expected, call):  # noqa: PLR0917
    """Segment.reserve/write/copy_in turn an OSError that means neither full nor missing into an
    error of shmkv's tree, never a raw OSError."""
    import errno as _errno
    import os

    store = make_store()
    seg = store._engine._dseg
    src = tmp_path / "src"
    src.write_bytes(b"x" * 8192)

    def fail(*args, **kw):
        raise OSError(err, os.strerror(err))

    if call == "reserve":
        monkeypatch.setattr(_segment.os, "posix_fallocate", fail)
        run = lambda: seg.reserve([(0, 4096)], populate=False)
    elif call == "write":
        monkeypatch.setattr(_segment.os, "pwrite", fail)
        run = lambda: seg.write(0, memoryview(b"y" * 16))
    else:
        monkeypatch.setattr(_segment.os, "sendfile", fail)
        fd = os.open(src, os.O_RDONLY)
        run = lambda: seg.copy_in(fd, 0, 0, 4096)
    try:
        with pytest.raises(expected, match=seg.name if expected is not shmkv.CacheFullError else "dev/shm") as info:
            run()
    finally:
        if call == "copy_in":
            os.close(fd)
    assert not isinstance(info.value, OSError) or isinstance(info.value, shmkv.ShmkvError)
    assert err != _errno.EIO or "shmkv save" in str(info.value)


def test_copy_in_from_a_file_that_ends_early_is_a_snapshot_error(make_store, monkeypatch, tmp_path):
    import os

    store = make_store()
    src = tmp_path / "short"
    src.write_bytes(b"x" * 100)
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(shmkv.SnapshotError, match="ended 3996 bytes early"):
            store._engine._dseg.copy_in(fd, 0, 0, 4096)
        monkeypatch.setattr(_segment.os, "sendfile", lambda *a: (_ for _ in ()).throw(OSError(22, "EINVAL")))
        with pytest.raises(shmkv.SnapshotError, match="ended 3996 bytes early"):  # the slow path says the same
            store._engine._dseg.copy_in(fd, 0, 0, 4096)
    finally:
        os.close(fd)


def test_ids_and_positions_that_an_int64_cannot_hold_are_refused(store):
    """A commit and an extend refuse token ids and positions that would be stored as other
    numbers (past an int64's largest: wrapped negative, or -1, "no id"), naming the value given;
    a commit's pending tokens stay."""
    seq = store.create_sequence(capacity=8)
    one = np.zeros((1, 2, 4))
    for kw, match in [({"tokens": [2**63]}, f"holds {2**63}, more than an int64"),
                      ({"tokens": np.array([2**64 - 1], np.uint64)}, f"holds {2**64 - 1}"),
                      ({"positions": [2**63]}, f"holds {2**63}")]:
        for layer in range(2):
            seq.append(layer, one, one)
        with pytest.raises(shmkv.InvalidArgumentError, match=match):
            seq.commit(**kw)
        assert seq.pending == 1 and len(seq) == 0
        seq.release()  # (drops the pending token)
        seq = store.sequence(seq.id, write=True)
        with pytest.raises(shmkv.InvalidArgumentError, match=match):
            seq.extend(np.zeros((2, 1, 2, 4)), np.zeros((2, 1, 2, 4)), **kw)
        assert seq.pending == 0 and len(seq) == 0
    top = 2**63 - 1
    seq.extend(np.zeros((2, 1, 2, 4)), np.zeros((2, 1, 2, 4)), tokens=[7], positions=[top])  # the largest: taken
    with pytest.raises(shmkv.InvalidArgumentError, match=f"would be {2**63}, past .* continues after {top}"):
        seq.extend(np.zeros((2, 1, 2, 4)), np.zeros((2, 1, 2, 4)))  # (the default position: top + 1)
    assert seq.positions.tolist() == [top] and seq.tokens.tolist() == [7] and seq.pending == 0


def test_a_meta_no_reader_could_unpack_is_refused(store):
    """meta is unpacked by every reader (and a snapshot's load) with str keys only: a dict with
    another key, at any depth, is refused as it is set, and the meta before it stays."""
    seq = store.create_sequence()
    seq.meta = {"request": 17}
    for bad in ({1: "x"}, {"a": {(1, 2): "y"}}, {"a": [{None: 1}]}):
        with pytest.raises(shmkv.InvalidArgumentError, match="must be str"):
            seq.meta = bad
        assert store.sequence(seq.id).meta == {"request": 17}


def _extended(store: shmkv.Store) -> shmkv.Sequence:
    seq = store.create_sequence()
    seq.extend(np.zeros((2, 3, 2, 4)), np.zeros((2, 3, 2, 4)))
    return seq


def _restored_twice(store: shmkv.Store) -> None:
    seq = _extended(store)
    saved = io.BytesIO()
    store.save(saved)
    saved.seek(0)
    store.restore(saved, seq_ids=[seq.id, seq.id])


@pytest.mark.parametrize(("call", "match"), [
    (lambda s: shmkv.attach(s.name, lock_timeout=float("inf")), "lock_timeout=inf must be a finite"),
    (lambda s: shmkv.attach(s.name, lock_timeout=1e12), "at most 9223372036"),
    (lambda s: shmkv.attach(s.name, timeout=None), "timeout=None must be a finite"),
    (lambda s: shmkv.attach(s.name, timeout=float("nan")), "timeout=nan"),
    (lambda s: shmkv.create(unique_name("rfs"), layers=1, kv_heads=1, head_dim=2, lock_timeout=float("inf")),
     "lock_timeout=inf"),
    (lambda s: shmkv.create(unique_name("rfs"), layers=1, kv_heads=1, head_dim=2, persistent="no"),
     "persistent='no' must be True or False"),
    (lambda s: shmkv.create(unique_name("rfs"), layers=1, kv_heads=1, head_dim=2, persistent=None), "persistent=None"),
    (lambda s: s.sequence(None), "sequence id None must be an int"),
    (lambda s: s.sequence([1]), r"sequence id \[1\] must be an int"),
    (lambda s: s.save(""), "names no file"),
    (lambda s: s.save("/tmp/"), "names no file"),
    (lambda s: s.save(os.devnull + ".x", progress=5), "progress=5 must be a callable"),
    (lambda s: s.restore(io.BytesIO(b""), progress=5), "progress=5 must be a callable"),
    (lambda s: shmkv.load(io.BytesIO(b""), unique_name("rfs"), dtype="float32"), "dtype= comes from the snapshot"),
    (lambda s: s.create_sequence().mask(0, [-1]), r"query_positions \[-1\] must be positions >= 0"),
    (lambda s: s.save(io.StringIO()), "open it with 'wb'"),
    (lambda s: s.save(io.BufferedReader(io.BytesIO(b""))), "open it with 'wb'"),  # (read-only)
    (lambda s: s.restore(io.StringIO("x")), "open it with 'rb'"),
    (lambda s: s.batch_kv([1, 2], 0), "seqs holds 1, not a Sequence handle"),
    (lambda s: s.batch_kv(None, 0), "seqs=None must be a list of Sequence handles"),
    (lambda s: s.regather(None, [0]), "seqs=None must be a list"),
    (lambda s: s.regather([1, 2], [0]), "seqs holds 1, not a Sequence"),
    (lambda s: _extended(s).remove(0, 1, shift=5), "shift=5 must be a function"),
    (lambda s: s.save(io.BytesIO(), seq_ids=[_extended(s).id] * 2), "names a sequence twice; name each once"),
    (_restored_twice, "names a sequence twice; name each once"),
    (lambda s: s.create_sequence().append(0, [[[1, 2, 3, 4], [1, 2]]], np.zeros((1, 2, 4))),
     "append: k cannot be read as an array .*one shape"),
])
def test_arguments_refused_before_anything_is_made(store, call, match):
    """Each of these is an InvalidArgumentError naming the value (no raw TypeError or OverflowError
    later), and no store of its own is left (its names: "rfs..."; other tests make stores meanwhile)."""
    with pytest.raises(shmkv.InvalidArgumentError, match=match):
        call(store)
    assert [n for n in shmkv.list_stores() if n.startswith("rfs")] == []
