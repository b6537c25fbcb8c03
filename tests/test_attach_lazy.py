"""An attach builds what joining the store needs and no more (docs/design.md §7: under a
millisecond): what a reader reads through (the data views, the prefix index, the rows part) is
built at the first use of any of it, the engine's other parts but the journal at the first use
of any of them, and what they show then is what an eager build shows."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from procs.prefix import check, serve, serve_and_finish

import shmkv
from shmkv._engine.memory import segment as _segment
from shmkv._engine.engine import _LAZY, _READER
from shmkv.testing import run_in_process, unique_name

VIEWS = ("K", "V", "tokens", "positions", "_hashes", "meta", "Kl", "Vl", "KS", "VS", "KSl", "VSl")


def _offsets(engine: object, attr: str) -> list[tuple[int, tuple[int, ...], tuple[int, ...], str]]:
    """Each array of a view attribute: where it starts in its mapping (the meta records: from
    the table's start), its shape, strides and dtype."""
    value = getattr(engine, attr)
    arrays = [] if value is None else value if isinstance(value, list) else [value]
    origin = (engine.table_np if attr == "meta" else engine.shares.anchor).ctypes.data
    return [(a.ctypes.data - origin, a.shape, a.strides, a.dtype.str) for a in arrays]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sliding", "int8"])
def test_an_attach_builds_only_the_journal_and_a_first_use_builds_the_rest(make_store, kind):
    shape = {"layer_types": ["full", "sliding", "full"], "window": 32} if kind == "sliding" else {"dtype": "int8"}
    store = make_store(layers=3, kv_heads=2, head_dim=8, max_tokens=512, max_seqs=8, **shape)
    eager = store._engine
    assert set(vars(eager)) >= _LAZY  # the creator built its parts at create: its first create_sequence does not
    assert eager.arena.journal is eager.journal
    other = shmkv.attach(store.name)
    try:
        e = other._engine
        assert "journal" in vars(e) and not set(vars(e)) & _LAZY
        attached = set(vars(e))
        assert e.rows is not None  # the first use of a reader's name builds the reader's, no more
        assert set(vars(e)) - attached == _READER
        assert e.alloc is not None  # the first use of another part builds the rest: exactly the names
        assert set(vars(e)) - attached == _LAZY  # __getattr__ answers for
        assert e.alloc.__self__ is e.arena and e.spans.alloc.__self__ is e.arena  # one build: one set of parts
        assert e.arena.journal is e.journal is e.spans.journal and e.arena.index is e.index
        assert e.pages.Kl is e.Kl and e.rows.clients_np is e.clients_np
        for attr in VIEWS:  # the same arrays over the same bytes as the creator's
            assert _offsets(e, attr) == _offsets(eager, attr), attr
        seq = store.create_sequence(capacity=64)
        k = np.arange(3 * 5 * 2 * 8).reshape(3, 5, 2, 8) % 7
        seq.extend(k.astype(np.float32), -k.astype(np.float32), tokens=np.arange(5))
        seen = other.sequence(seq.id)
        np.testing.assert_array_equal(seen.tokens, np.arange(5))
        for layer in range(3):
            np.testing.assert_array_equal(seen.keys(layer), seq.keys(layer))
    finally:
        other.close()


def test_a_read_handle_builds_only_what_a_reader_reads_through(make_store):
    """A process that only reads (a read-only attach, a read handle, its views, tokens and
    positions, len) builds the data views and the rows part, not the writer's parts; what it
    reads is what the writer wrote."""
    store = make_store(layers=2, kv_heads=2, head_dim=8, max_tokens=128, max_seqs=4)
    seq = store.create_sequence(capacity=16)
    k = np.arange(2 * 5 * 2 * 8, dtype=np.float32).reshape(2, 5, 2, 8)
    seq.extend(k, -k, tokens=np.arange(10, 15))
    for readonly in (True, False):
        other = shmkv.attach(store.name, readonly=readonly)
        try:
            seen = other.sequence(seq.id)
            got = [seen.kv(layer) for layer in range(2)]
            assert len(seen) == 5 and seen.lease_pid == os.getpid()
            np.testing.assert_array_equal(seen.tokens, np.arange(10, 15))
            np.testing.assert_array_equal(seen.positions, np.arange(5))
            for layer in range(2):
                np.testing.assert_array_equal(got[layer][0], k[layer])
                np.testing.assert_array_equal(got[layer][1], -k[layer])
            assert set(vars(other._engine)) & _LAZY == _READER
        finally:
            other.close()


def test_a_prefix_lookup_after_a_lazy_attach_finds_what_another_process_cached(make_store):
    store = make_store(layers=2, kv_heads=2, head_dim=4, max_tokens=2048, max_seqs=8)
    prompt = np.random.default_rng(34).integers(0, 30_000, 100).astype(np.int64)
    run_in_process(serve_and_finish, store.name, prompt.tolist())  # a spawned process caches it
    for readonly in (False, True):
        other = shmkv.attach(store.name, readonly=readonly)
        try:
            assert "index" not in vars(other._engine)
            assert other.match_prefix(prompt) == len(prompt) - 1 == store.match_prefix(prompt)
            if not readonly:
                seq, reused = serve(other, prompt)
                assert reused == len(prompt) - 1
                check(seq, prompt, other.layout)  # reused K/V, ids and positions equal a recompute
                seq.finish()
        finally:
            other.close()


def test_threads_that_first_use_an_attachment_at_once_read_the_same(make_store):
    store = make_store(layers=2, kv_heads=1, head_dim=8, max_tokens=256, max_seqs=4)
    seq = store.create_sequence(capacity=32)
    k = np.arange(2 * 6 * 8, dtype=np.float32).reshape(2, 6, 1, 8)
    seq.extend(k, k + 1, tokens=np.arange(6))
    other = shmkv.attach(store.name)
    go, got = threading.Barrier(4), []

    def first_use() -> None:
        go.wait(timeout=30)
        s = other.sequence(seq.id)
        got.append((s.tokens.tolist(), [s.values(layer).tolist() for layer in range(2)],
                    other.match_prefix(np.arange(6)), other.stats().sequences))

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        want = (list(range(6)), [(k[layer] + 1).tolist() for layer in range(2)], store.match_prefix(np.arange(6)), 1)
        assert got == [want] * 4
    finally:
        other.close()


def test_a_closed_attachment_that_built_nothing_says_closed(make_store):
    store = make_store(layers=1, kv_heads=1, head_dim=8, max_tokens=64, max_seqs=4)
    other = shmkv.attach(store.name)
    e = other._engine
    other.close()
    assert not set(vars(e)) & _LAZY  # closing built nothing either
    for attr in ("alloc", "K", "index", "rows"):
        with pytest.raises(shmkv.StoreClosedError):
            getattr(e, attr)(0) if attr in ("alloc", "rows") else getattr(e, attr)[0]
    with pytest.raises(AttributeError):
        e.no_such_attribute  # noqa: B018 (an attribute of no part stays an AttributeError)


def test_an_empty_header_segment_is_no_store(tmp_path):
    """Segment.open maps the whole segment at once (its size from mmap): an empty one, a store
    being created or a leftover, is StoreNotFound, its descriptor closed."""
    name = unique_name("empty")
    path = os.path.join(_segment.SHM_DIR, _segment.header_name(name))
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(shmkv.StoreNotFound, match="no store named"):
            shmkv.attach(name)
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        os.unlink(path)


# A Ctrl-C that lands in a finalizer (a segment an earlier interrupted trial dropped, collected
# during a later one) is printed and ignored by Python, as a real one is.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_at_any_point_of_the_first_use_leaves_every_part_or_none(make_store):
    """The first use builds what a reader reads through, then the other parts, each into locals
    set in one statement: a KeyboardInterrupt at any point of those builds (tests/_ctrl_c_points.py)
    leaves each group all set or not at all (the next use builds what is missing), and the
    attachment then reads what the creator wrote."""
    from _ctrl_c_points import Points

    store = make_store(layers=2, kv_heads=2, head_dim=8, max_tokens=256, max_seqs=4)
    seq = store.create_sequence(capacity=32)
    k = np.arange(2 * 6 * 2 * 8, dtype=np.float32).reshape(2, 6, 2, 8)
    seq.extend(k, -k, tokens=np.arange(6))

    def first_use(tr: Points) -> tuple[bool, set[str], int]:
        other = shmkv.attach(store.name)
        try:
            raised = tr.run(lambda: other._engine.alloc)  # (the first use: the reader's, then the other parts)
            built = set(vars(other._engine)) & _LAZY
            np.testing.assert_array_equal(other.sequence(seq.id).keys(1), k[1])  # built (again) if need be
            return raised, built, tr.count
        finally:
            other.close()

    counter = Points()
    first_use(counter)
    n = counter.count
    assert n > 5, n
    fired = 0
    for point in range(1, n + 1):
        raised, built, _ = first_use(Points(point))
        fired += raised
        assert built in (set(), set(_READER), set(_LAZY)), (point, sorted(set(_LAZY) - built))
        assert raised or built == set(_LAZY)
    assert fired >= n // 2, (fired, n)
