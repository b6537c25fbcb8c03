"""Creation, attachment, persistence, removal and gc (docs/design.md §4)."""

from __future__ import annotations

import gc
import io
import mmap
import os
import stat
import types

import numpy as np
import pytest
from procs.store_ops import create_and_exit
from conftest import START_METHODS

import shmkv
from shmkv.store import _lifecycle
from shmkv._engine import attachment
from shmkv._engine.memory import segment as _segment
from shmkv.testing import ChildFailed, run_in_process, unique_name


def _gc_one(name: str) -> bool:
    """gc's judgement of one store (a test never runs a global gc: other programs' stores are not ours)."""
    return _lifecycle._collect(name, include_persistent=False, grace=30.0)


def _exists(name: str) -> bool:
    return os.path.exists(_segment.shm_path(_segment.header_name(name)))


def test_segments_are_private_and_listed(store):
    for seg in (_segment.header_name(store.name), _segment.data_name(store.name)):
        assert stat.S_IMODE(os.stat(_segment.shm_path(seg)).st_mode) == 0o600
    assert store.name in shmkv.list_stores()


def test_group_mode_on_request(make_store):
    s = make_store(mode=0o660)
    assert stat.S_IMODE(os.stat(_segment.shm_path(_segment.header_name(s.name))).st_mode) == 0o660


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_creator_exit(method, how):
    """A non-persistent store goes with its creator's exit; after a SIGKILL, gc removes it."""
    name = unique_name()
    if how == "kill":
        with pytest.raises(ChildFailed):
            run_in_process(create_and_exit, name, False, how, start_method=method, timeout=60)
        assert _exists(name)  # nobody ran the cleanup
        assert _gc_one(name)
    else:
        run_in_process(create_and_exit, name, False, how, start_method=method, timeout=60)
    assert not _exists(name)
    assert not os.path.exists(_segment.lock_path(name))


def test_persistent_store_outlives_creator_until_removed():
    name = unique_name()
    run_in_process(create_and_exit, name, True, "exit", start_method="spawn", timeout=60)
    try:
        assert not _gc_one(name)  # creator is dead but the store is persistent
        s = shmkv.attach(name)
        assert s.persistent and s.sequences()[0].length == 2
        s.close()
        assert _exists(name)
    finally:
        shmkv.remove(name)
    assert not _exists(name)


def test_gc_keeps_live_stores(store):
    assert not _gc_one(store.name)
    assert _exists(store.name)


def test_creator_close_removes_but_views_stay_valid(make_store):
    store = make_store()
    seq = store.create_sequence()
    seq.extend(np.full((2, 2, 2, 4), 3.0), np.full((2, 2, 2, 4), 4.0))
    keys = seq.keys(1)
    store.close()
    assert not _exists(store.name)
    # the view keeps its pages mapped: reading it is safe, not a segfault
    np.testing.assert_array_equal(keys, np.full((2, 2, 4), 3.0))
    with pytest.raises(shmkv.StoreClosedError):
        seq.keys(1)


def test_forked_child_does_not_remove_parent_store(store):
    seq = store.create_sequence()
    seq.extend(np.ones((2, 1, 2, 4)), np.ones((2, 1, 2, 4)))

    pid = os.fork()
    if pid == 0:  # child: use the inherited handle, then exit normally (atexit runs)
        code = 0
        try:
            try:
                seq.append(0, np.zeros((2, 4)), np.zeros((2, 4)))
                code = 3  # an inherited write handle must not write
            except shmkv.LeaseError:
                pass
            store.close()
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _exists(store.name)
    assert seq.length == 1


def test_store_pickles_by_name(store):
    seq = store.create_sequence()
    seq.extend(np.ones((2, 1, 2, 4)), np.ones((2, 1, 2, 4)))
    again = run_in_process(_length_via_pickle, store, seq.id, start_method="spawn", timeout=60)
    assert again == 1


def _length_via_pickle(store: shmkv.Store, seq_id: int) -> int:
    n = store.sequence(seq_id).length
    store.close()
    return n


def _mapped(name: str) -> list[str]:
    """This process's mappings and descriptors of store ``name``'s segments and files."""
    pre = f"/dev/shm/{_segment.PREFIX}{name}."
    with open("/proc/self/maps") as f:
        out = [line.split(maxsplit=5)[-1].strip() for line in f if pre in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(pre):
            out.append(f"fd -> {target}")
    return out


@pytest.mark.parametrize("how", ["created", "attached", "readonly"])
def test_close_unmaps_and_closes_descriptors_while_the_store_object_lives(make_store, tmp_path, how):
    """close() releases both mappings and every descriptor at once, not at garbage collection,
    while the Store object lives on."""
    made = make_store()
    store = made if how == "created" else shmkv.attach(made.name, readonly=how == "readonly")
    writer = made if how == "readonly" else store
    # a tour of the structures: prefix reuse, fork, finish, snapshot, restore, reads
    seq = writer.create_sequence(capacity=32, prefix=np.arange(20))
    seq.extend(np.ones((2, 20, 2, 4)), np.ones((2, 20, 2, 4)), tokens=np.arange(20))
    seq.fork().release()
    seq.finish()
    writer.save(tmp_path / "s.shmkv")
    writer.restore(tmp_path / "s.shmkv")
    del seq
    for info in store.sequences():
        s = store.sequence(info.id)
        assert s.keys(0).shape[0] == len(s) and s.tokens.size == len(s)
        del s
    store.stats(), store.clients(), store.match_prefix(np.arange(30))
    if how == "readonly":
        store.save(tmp_path / "r.shmkv")
    keep = store.sequence(store.sequences()[0].id).keys(1)
    store.close()
    if made is not store:
        made.close()
    # a view that outlives close keeps its own data pages mapped, valid to read ...
    assert [m for m in _mapped(made.name) if not m.startswith("fd")] == [
        _segment.shm_path(_segment.data_name(made.name)) + " (deleted)"]
    assert bool((keep == 1).all())
    del keep
    assert _mapped(made.name) == []  # ... and nothing else is left: both mappings, every descriptor
    assert store.closed  # while the Store object lives on


@pytest.mark.parametrize("how", ["created", "attached", "persistent", "attached-persistent"])
def test_close_then_unlink_removes_the_store(make_store, how):
    """The multiprocessing.shared_memory idiom: close(), then unlink() by name."""
    made = make_store(persistent="persistent" in how)
    store = shmkv.attach(made.name) if how.startswith("attached") else made
    store.close()
    store.unlink()
    assert not _exists(made.name)
    assert not os.path.exists(_segment.lock_path(made.name))
    store.unlink()  # once removed, nothing more to do


def test_unlink_after_close_leaves_a_newer_store_of_the_same_name(make_store):
    old = make_store(persistent=True)
    name = old.name
    old.close()
    shmkv.remove(name)
    newer = make_store(name=name)
    old.unlink()  # not the store it attached to: left alone
    assert _exists(name) and newer.sequences() == []


@pytest.mark.parametrize(("what", "readonly"), [
    ("lock file is a symlink", False), ("lock file is a symlink", True),
    ("lock file is a directory", False),  # (read-only, a directory opens and takes shared flocks)
    ("liveness file gone", False), ("liveness file gone", True)])
def test_attach_failure_leaks_no_descriptor_and_raises_our_errors(make_store, readonly, what):
    """When the lock file cannot be opened, attach closes both segment descriptors and raises one
    of shmkv's errors, never a raw OSError."""
    store = make_store()
    name = store.name
    lock, live = _segment.lock_path(name), _segment.shm_path(f"{_segment.PREFIX}{name}.live")
    if what == "liveness file gone":
        os.unlink(live)
        expected: type[Exception] = shmkv.StoreNotFound
    else:
        os.unlink(lock)
        if what == "lock file is a symlink":
            os.symlink("/dev/null", lock)
            expected = shmkv.AccessDeniedError
        else:
            os.mkdir(lock)
            expected = shmkv.CorruptStoreError
    before = _mapped(name)
    try:
        with pytest.raises(expected, match=name):
            shmkv.attach(name, readonly=readonly)
        assert _mapped(name) == before  # nothing of the failed attach is left open or mapped
    finally:
        if os.path.isdir(lock) and not os.path.islink(lock):
            os.rmdir(lock)


class _Part:
    def __init__(self, **fields):
        self.__dict__.update(fields)

    def method(self):
        return None


def _holding(depth_of_view: int) -> object:
    """A value whose view sits ``depth_of_view`` containers down (0: the view itself)."""
    value: object = np.zeros(4)
    for i in range(depth_of_view):
        value = [value] if i % 3 == 0 else {"k": value} if i % 3 == 1 else _Part(a=value)
    return value


_WALKED = {  # a value (made fresh) -> whether it holds a view for close()
    "array": (lambda: np.zeros(2), True), "memoryview": (lambda: memoryview(b"x"), True),
    "in a list": (lambda: [1, "a", None, np.zeros(1)], True),
    "in a tuple in a tuple": (lambda: (0, (np.zeros(1),)), True),
    "a dict value": (lambda: {"a": 1, "b": memoryview(b"x")}, True),
    "an object's list": (lambda: _Part(x=1, y=[np.zeros(1)]), True),
    "two down": (lambda: _holding(2), True), "three down": (lambda: _holding(3), False),
    "three lists down": (lambda: [[[np.zeros(1)]]], False),
    "int": (lambda: 1, False), "float": (lambda: 2.5, False), "bool": (lambda: True, False),
    "str": (lambda: "s", False), "bytes": (lambda: b"b", False), "None": (lambda: None, False),
    "plain list": (lambda: [1, "a", None, (2, 3)], False),
    "empty dict": (lambda: {}, False), "plain object": (lambda: _Part(x=1, y="s"), False),
    "bound method": (lambda: _Part().method, False), "Closed": (lambda: attachment.Closed("n"), False),
    "Closed in a list": (lambda: [attachment.Closed("n")], False),
}


@pytest.mark.parametrize("what", list(_WALKED))
def test_the_close_walk_finds_a_view_at_most_two_containers_down(what):
    """close() replaces every attribute of the handle and its parts that is a view of a mapping, or
    holds one in a list, tuple, dict or object at most two levels down (what the parts keep)."""
    make, held = _WALKED[what]
    value = make()
    assert attachment._holds_views(value) is held
    part = _Part(v=value, n=3, s="s", none=None)
    attachment.release_views(part, "n")
    if held:
        assert isinstance(part.v, attachment.Closed) and part.v is not value
    else:
        assert part.v is value
    assert (part.n, part.s, part.none) == (3, "s", None)


def _reaches_a_view(obj: object) -> bool:
    """Whether any reference from ``obj``, followed to any depth (not into modules, classes,
    functions or code: shared by everything), leads to an array, memoryview or mmap."""
    seen, todo = {id(obj)}, [obj]
    while todo:
        for ref in gc.get_referents(todo.pop()):
            if isinstance(ref, (np.ndarray, memoryview, mmap.mmap)):
                return True
            if id(ref) in seen or isinstance(ref, (types.ModuleType, type, types.FunctionType, types.CodeType)):
                continue
            seen.add(id(ref))
            todo.append(ref)
        assert len(seen) < 100_000  # (a walk that escaped into the whole heap)
    return False


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_the_types_the_close_walk_skips_hold_no_view(make_store, dtype):
    """close() skips, without looking inside, the values of the exact types of attachment._LEAVES
    (what most of a handle's attributes are). On an attachment with every part built, none of
    them (the engine's and its parts' attributes, and what their lists, tuples and dicts hold)
    reaches a view through any reference, and every bound method among them is one of the
    engine's or a part's, which close() walks itself."""
    store = make_store(layers=2, kv_heads=2, head_dim=8, max_tokens=128, max_seqs=4, dtype=dtype)
    other = shmkv.attach(store.name)
    try:
        e = other._engine
        e.alloc  # noqa: B018  (every part built)
        owners = [e, *(vars(e)[a] for a in ("journal", "pages", "arena", "growth", "spans", "rows", "snapshot_rows"))]

        def values(v: object, depth: int):
            yield v
            if depth and isinstance(v, (list, tuple, dict)):
                for x in v.values() if isinstance(v, dict) else v:
                    yield from values(x, depth - 1)

        skipped = [x for o in owners for v in vars(o).values() for x in values(v, 2)
                   if type(x) in attachment._LEAVES]
        kinds = {type(x) for x in skipped}
        assert kinds >= attachment._LEAVES - {float, bytes, type(None), attachment.Closed}, kinds  # each one looked at
        for x in skipped:
            if type(x) is types.MethodType:
                assert any(x.__self__ is o for o in owners), x
            else:
                assert not _reaches_a_view(x), x
    finally:
        other.close()


_OUTLIVE = """
import sys
import numpy as np
import shmkv
name, dtype, kinds, how = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
bounded = {"window": 4} if "sliding" in kinds else {"chunk": 8} if "chunked" in kinds else {}
VIEWS = {  # one store a kind of view: any other view still alive could hold the mapping for it
    "keys": lambda store, a, b, layer: [a.keys(layer)],
    "values": lambda store, a, b, layer: [a.values(layer)],
    "kv": lambda store, a, b, layer: list(a.kv(layer)),
    "read handle": lambda store, a, b, layer: [store.sequence(a.id).keys(layer)],
    "batch_kv": lambda store, a, b, layer: list(store.batch_kv([a, b], layer)),
    "append": lambda store, a, b, layer: list(a.append(layer, np.ones((1, 2, 4)), np.ones((1, 2, 4)))),
}
WRITES = {"batch_kv", "append"}  # need write handles: not on a read-only attachment
for which, make in VIEWS.items():
    if how == "readonly" and which in WRITES:
        continue
    for layer in range(len(kinds)):
        store = shmkv.create(name, layers=len(kinds), kv_heads=2, head_dim=4, dtype=dtype, max_tokens=512,
                             max_seqs=8, layer_types=kinds, **bounded)
        a, b = store.create_sequence(capacity=32), store.create_sequence(capacity=32)
        for v in (1.0, 2.0):  # no name is left bound to a handle: a live handle holds the mapping
            (a if v == 1.0 else b).extend(np.full((len(kinds), 20, 2, 4), v), np.full((len(kinds), 20, 2, 4), -v),
                                          tokens=np.arange(20))
        if how == "created":
            views = make(store, a, b, layer)
        else:  # the views of another handle of the store, attached by name
            other = shmkv.attach(name, readonly=how == "readonly")
            ids = (a.id, b.id)
            a.release()
            b.release()
            oa, ob = (other.sequence(i, write=how != "readonly") for i in ids)
            views = make(other, oa, ob, layer)
            del oa, ob
            other.close()
        expect = [float(np.asarray(v, np.float64).sum()) for v in views]
        del a, b
        store.close()
        print(which, layer, flush=True)  # a segfault next: this view outlived its mapping
        got = [float(np.asarray(v, np.float64).sum()) for v in views]
        assert got == expect, (which, layer, got, expect)
        del views
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["created", "attached", "readonly"])
@pytest.mark.parametrize(("dtype", "kinds"), [  # int8 stores have full layers only
    *[(dt, kinds) for dt in ("float32", "float16") for kinds in ("full,full", "full,sliding", "chunked,full")],
    ("bfloat16", "full,full"), ("int8", "full,full")])
def test_a_view_outliving_close_reads_its_data(dtype, kinds, how):
    """Views returned before close() stay valid memory after it (docs/design.md §4): read in a child, where
    a view over an unmapped page would kill the process (SIGSEGV) instead of failing a test.
    Views of the creator's handle, of a read-write attachment and of a read-only one. An array
    built with np.ndarray over the mmap holds no export of it, so close() would unmap under it:
    every view must keep its pages mapped."""
    import subprocess
    import sys

    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    name = unique_name("outlive")
    try:
        r = subprocess.run([sys.executable, "-c", _OUTLIVE, name, dtype, kinds, how], capture_output=True, text=True,
                           timeout=120)
    finally:  # a child killed by a signal leaves its store: it was ours
        if name in shmkv.list_stores():
            shmkv.remove(name)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-300:], r.stderr[-2000:])


def test_a_header_is_decoded_once_and_every_other_header_on_its_own():
    """read_header_once answers an intact header it decoded before from what it found then, keeps at
    most READ_KEPT of them, and never answers another header, or a damaged copy of one it knows,
    from them: each gets its own layout, or CorruptStoreError."""
    from shmkv._engine.table import header as _header
    from shmkv.store import _store

    def header(identity: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
        layout = _header.make_layout(layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=max_tokens,
                                     max_seqs=4)
        off = _header.offsets(layout, 4)
        raw = np.zeros(off.header_bytes, np.uint8)
        words = raw[: _header.FIXED_BYTES].view(np.int64)
        _header.write(words, raw, layout, off, max_clients=4, creator_pid=1, creator_client=1, persistent=False,
                      identity=identity)
        return words, raw, off.header_bytes

    kept = _store.READ_KEPT
    for i in range(2 * kept + 3):
        words, raw, size = header(10_000 + i, 64 + 8 * (i % 5))
        layout, clients = _store.read_header_once(words, raw, size, "h")
        assert (layout.max_tokens, clients) == (64 + 8 * (i % 5), 4)
        again, _ = _store.read_header_once(words, raw, size, "h")
        assert again is layout  # decoded once: the same answer, not another decode
        assert 1 <= len(_store._READ) <= kept
    words[_header.W_MAX_TOKENS] += 8  # a known header, one word changed (its checksum not)
    with pytest.raises(shmkv.CorruptStoreError, match="checksum"):
        _store.read_header_once(words, raw, size, "h")


_O, _O4 = np.ones((1, 4)), np.ones((1, 1, 1, 4))
# Every public call that reads or changes the store, with arguments it takes on an open store.
# (Not here: what is the handle's own, with no shared word read: pending, pending_on, discard,
# release, writable; the layout's bytes_per_token.)
_ON_A_CLOSED_STORE = {
    "Store.batch_kv": lambda st, s, s2: st.batch_kv([s], 0),
    "Store.clients": lambda st, s, s2: st.clients(),
    "Store.copy_prefix": lambda st, s, s2: st.copy_prefix(s.id, s2.id, 1),
    "Store.create_sequence": lambda st, s, s2: st.create_sequence(capacity=4),
    "Store.create_sequence()": lambda st, s, s2: st.create_sequence(),  # (its default capacity exceeds max_tokens)
    "Store.create_sequences": lambda st, s, s2: st.create_sequences(2, 4),
    "Store.forward": lambda st, s, s2: st.forward([s], [1]),
    "Store.lease": lambda st, s, s2: st.lease([s.id]),
    "Store.match_prefix": lambda st, s, s2: st.match_prefix([1, 2]),
    "Store.regather": lambda st, s, s2: st.regather([s], [0]),
    "Store.restore": lambda st, s, s2: st.restore(io.BytesIO(b"SHMKV")),
    "Store.save": lambda st, s, s2: st.save(io.BytesIO()),
    "Store.sequence": lambda st, s, s2: st.sequence(s.id),
    "Store.sequences": lambda st, s, s2: st.sequences(),
    "Store.stats": lambda st, s, s2: st.stats(),
    "Store.transaction": lambda st, s, s2: st.transaction().__enter__(),
    "append": lambda st, s, s2: s.append(0, _O, _O),
    "can_resume": lambda st, s, s2: s.can_resume(2),
    "capacity": lambda st, s, s2: s.capacity,
    "clear": lambda st, s, s2: s.clear(),
    "commit": lambda st, s, s2: s.commit(),
    "encoder_kv": lambda st, s, s2: s.encoder_kv(0),
    "encoder_length": lambda st, s, s2: s.encoder_length,
    "extend": lambda st, s, s2: s.extend(_O4, _O4),
    "finish": lambda st, s, s2: s.finish(),
    "fork": lambda st, s, s2: s.fork(),
    "free": lambda st, s, s2: s2.free(),
    "head": lambda st, s, s2: s.head(0, 0),
    "held_positions": lambda st, s, s2: s.held_positions(0),
    "is_full": lambda st, s, s2: s.is_full,
    "iter_tokens": lambda st, s, s2: list(s.iter_tokens(0)),
    "keys": lambda st, s, s2: s.keys(0),
    "kv": lambda st, s, s2: s.kv(0),
    "lease_pid": lambda st, s, s2: s.lease_pid,
    "len": lambda st, s, s2: len(s),
    "mask": lambda st, s, s2: s.mask(0, [3]),
    "meta": lambda st, s, s2: s.meta,
    "meta=": lambda st, s, s2: setattr(s, "meta", {"a": 1}),
    "nbytes": lambda st, s, s2: s.nbytes,
    "positions": lambda st, s, s2: s.positions(),
    "raw_keys": lambda st, s, s2: s.raw_keys(0),
    "raw_values": lambda st, s, s2: s.raw_values(0),
    "read": lambda st, s, s2: s.read(0),
    "remaining_capacity": lambda st, s, s2: s.remaining_capacity,
    "remove": lambda st, s, s2: s.remove(0, 1),
    "set_encoder": lambda st, s, s2: s.set_encoder(_O4, _O4),
    "set_tokens": lambda st, s, s2: s.set_tokens([5]),
    "shift_left": lambda st, s, s2: s.shift_left(1),
    "tokens": lambda st, s, s2: s.tokens(),
    "truncate": lambda st, s, s2: s.truncate(1),
    "values": lambda st, s, s2: s.values(0),
    "wait": lambda st, s, s2: s.wait(10, timeout=0.1),
    "keys of a read handle": lambda st, s, s2: s.reader.keys(0),  # (made while open, below)
}


@pytest.mark.parametrize("call", sorted(_ON_A_CLOSED_STORE))
def test_every_call_on_a_closed_store_says_it_is_closed(make_store, call):
    """After close(), each public call that reads or changes the store raises StoreClosedError
    (not another error about its arguments, nor a value read from what close left behind)."""
    st = make_store(layers=1, kv_heads=1, head_dim=4, dtype="float32", max_tokens=64, max_seqs=4)
    s, s2 = st.create_sequence(capacity=8), st.create_sequence(capacity=8)
    for seq in (s, s2):
        seq.extend(np.ones((1, 3, 1, 4)), np.ones((1, 3, 1, 4)), tokens=[1, 2, 3])
    s.reader = st.sequence(s.id)
    st.close()
    with pytest.raises(shmkv.StoreClosedError):
        _ON_A_CLOSED_STORE[call](st, s, s2)
