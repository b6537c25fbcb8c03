"""close() while other threads of the process use the same handle:
they get StoreClosedError (or finish first), never a raw TypeError, AttributeError, ValueError or
OSError from a torn-down handle, and close never pulls the store lock from under a thread that
holds it (a structural operation in progress completes, the store stays consistent)."""

from __future__ import annotations

import threading

import numpy as np

import shmkv
from shmkv.cli import verify


def _kv(store: shmkv.Store, n: int) -> tuple[np.ndarray, np.ndarray]:
    lay = store.layout
    k = np.arange(lay.layers * n * lay.kv_heads * lay.head_dim, dtype=np.float32)
    k = k.reshape(lay.layers, n, lay.kv_heads, lay.head_dim)
    return k, -k


def test_close_in_another_thread_waits_for_the_structural_operation_in_progress(make_store):
    store = make_store()
    handle = shmkv.attach(store.name)
    seen: list[BaseException] = []
    closer = threading.Thread(target=handle.close)
    with handle.transaction():
        closer.start()
        # close() waits for this thread's hold of the store lock; the operations here complete
        closer.join(timeout=1.0)
        assert closer.is_alive()
        try:
            seq = handle.create_sequence(capacity=4)
            seq.extend(*_kv(handle, 2), tokens=[5, 6])
            seq.truncate(1)
            kept = seq.id
        except BaseException as e:  # what must not come: a TypeError from the torn-down handle
            seen.append(e)
    closer.join(timeout=60)
    assert not closer.is_alive() and handle.closed
    assert seen == []
    info = {s.id: s.length for s in store.sequences()}
    assert info == {kept: 1}
    assert verify(store) == []


def test_operations_racing_close_in_another_thread_raise_only_store_closed(make_store):
    store = make_store(max_tokens=512, max_seqs=8)
    donor = store.create_sequence(capacity=8)
    donor.extend(*_kv(store, 4), tokens=[1, 2, 3, 4])
    donor.finish()
    raw: list[str] = []
    closed_seen = 0

    def structural(h: shmkv.Store, started: threading.Event) -> None:
        started.set()
        for _ in range(100_000):
            seq = h.create_sequence(capacity=4, prefix=[1, 2, 3, 9])
            seq.extend(*_kv(h, 2))
            seq.truncate(1)
            seq.free()

    def reading(h: shmkv.Store, started: threading.Event) -> None:
        started.set()
        for _ in range(100_000):
            h.clients()
            h.sequences()
            h.stats()
            h.match_prefix([1, 2, 3])
            h.sequence(donor.id).keys(1)

    def run(fn, h: shmkv.Store, started: threading.Event) -> None:
        nonlocal closed_seen
        try:
            fn(h, started)
        except shmkv.StoreClosedError:
            closed_seen += 1
        except BaseException as e:  # anything else is the bug
            raw.append(f"{type(e).__name__}: {e}")

    for trial in range(24):
        h = shmkv.attach(store.name)
        events = [threading.Event(), threading.Event()]
        pairs = zip((structural, reading), events, strict=True)
        threads = [threading.Thread(target=run, args=(fn, h, ev)) for fn, ev in pairs]
        for t in threads:
            t.start()
        for ev in events:
            assert ev.wait(60)
        if trial % 2:
            h.sequences()  # a little later, now and then
        h.close()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
        assert raw == [], f"trial {trial}: {raw}"
        # whatever was in progress finished or stopped cleanly: the store is consistent and usable
        assert verify(store) == []
        for s in store.sequences():
            if s.id != donor.id:
                store.sequence(s.id, write=True).free()  # (a create that the close interrupted)
    assert closed_seen == 48


def test_close_twice_from_two_threads_at_once(make_store):
    store = make_store()
    for _ in range(20):
        h = shmkv.attach(store.name)
        errors: list[BaseException] = []
        go = threading.Barrier(2)

        def close(h: shmkv.Store = h, go: threading.Barrier = go, errors: list[BaseException] = errors) -> None:
            go.wait(60)
            try:
                h.close()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=close) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == [] and h.closed
    assert store.clients() == [store.clients()[0]]


def test_a_liveness_question_racing_close_keeps_its_descriptor(make_store, monkeypatch):
    """``clients()``/``sequences()`` ask the liveness file without the store lock: a close() in
    another thread waits for a question in progress (its descriptor stays open: a closed number could
    be reused by another file, which would answer for the wrong store), and a question after the close
    raises StoreClosedError, not a ValueError from descriptor -1."""
    from shmkv._engine.clients import liveness

    store = make_store()
    lv = liveness.Liveness(store.name, False)
    key = liveness.new_key(3)  # a slot nobody holds: not alive
    entered, go = threading.Event(), threading.Event()
    answers: list[object] = []
    real = liveness.byte_held

    def held_slowly(fd: int, slot: int) -> bool:
        entered.set()
        assert go.wait(60)
        return real(fd, slot)  # raises if close() took the descriptor meanwhile

    def ask() -> None:
        try:
            answers.append(lv.alive(key, key))
        except BaseException as e:
            answers.append(e)

    monkeypatch.setattr(liveness, "byte_held", held_slowly)
    asker = threading.Thread(target=ask)
    asker.start()
    assert entered.wait(60)
    closer = threading.Thread(target=lv.close)
    closer.start()
    closer.join(timeout=0.2)
    still_waiting = closer.is_alive()
    go.set()
    asker.join(timeout=60)
    closer.join(timeout=60)
    assert not asker.is_alive() and not closer.is_alive()
    assert still_waiting, "close() took the descriptor from under a question in progress"
    assert answers == [False]
    monkeypatch.setattr(liveness, "byte_held", real)
    try:
        lv.alive(key, key)
    except shmkv.StoreClosedError:
        pass
    else:
        raise AssertionError("a question after close() did not raise StoreClosedError")
