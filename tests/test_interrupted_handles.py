"""Ctrl-C (KeyboardInterrupt, in a process that survives it) that lands after create_sequence or
a lease take-over has done its work but before the handle reaches the caller:
the caller never gets the handle, so nothing may be left behind: no live sequence nobody can
name (else every interrupt would leak a row, until the store filled up with them), no lease held
for a handle that does not exist (other processes would see it alive until we closed)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from _ctrl_c_points import descriptors

import shmkv
from shmkv._engine import engine as _engine
from shmkv._engine.memory import segment as _segment
from shmkv.store import _handles


def _interrupting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next write handle's construction raise KeyboardInterrupt (the store's work done)."""
    real, calls = _handles.Sequence, []

    def sequence(*args, **kwargs):
        if kwargs.get("write") and not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(_handles, "Sequence", sequence)
    return calls


@pytest.mark.parametrize("prefix", [None, [1, 2, 3, 4]])
def test_create_sequence_interrupted_before_it_returns_leaves_no_sequence(make_store, monkeypatch, prefix):
    store = make_store()
    donor = store.create_sequence(capacity=8)
    donor.extend(np.ones((2, 4, 2, 4)), np.ones((2, 4, 2, 4)), tokens=[1, 2, 3, 4])
    donor.finish()
    calls = _interrupting(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        store.create_sequence(capacity=8, prefix=prefix)
    assert calls == [1]
    assert [s.id for s in store.sequences()] == [donor.id]  # the interrupted one is gone
    seq = store.create_sequence(capacity=8, prefix=prefix)  # and the store carries on
    assert [s.id for s in store.sequences()] == [donor.id, seq.id]


def test_lease_take_over_interrupted_before_it_returns_holds_no_lease(make_store, monkeypatch, shmkv_child):
    store = make_store()
    seq = store.create_sequence(capacity=8)
    seq.extend(np.ones((2, 2, 2, 4)), np.ones((2, 2, 2, 4)))
    seq.release()
    _interrupting(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        store.sequence(seq.id, write=True)
    (info,) = store.sequences()
    assert not info.lease_alive and info.lease_pid == 0
    # another process may take it at once (no LeaseError while this attachment lives)
    assert shmkv_child.run(_take_and_release, store, seq.id, start_method="spawn") == 2


def _take_and_release(store: shmkv.Store, seq_id: int) -> int:
    seq = store.sequence(seq_id, write=True)
    n = len(seq)
    seq.release()
    return n


def _fds(name: str) -> list[str]:
    """This process's descriptors of store ``name``'s files (segments, lock, liveness), as they are:
    no collection first."""
    return descriptors(f"skv_{name}.", collect=False)


def test_attach_interrupted_while_the_handle_is_built_leaks_no_descriptor(make_store, monkeypatch):
    store = make_store()
    before = _fds(store.name)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_engine, "Journal", interrupted)  # the handle's construction's last step
    for readonly in (False, True):
        with pytest.raises(KeyboardInterrupt):
            shmkv.attach(store.name, readonly=readonly)
        gc.collect()
        assert _fds(store.name) == before  # (the lock and liveness descriptors stayed open)
    assert store.clients() == [os.getpid()]


def test_close_interrupted_half_way_is_finished_by_the_next_close(make_store, monkeypatch):
    store = make_store()
    before = _fds(store.name)
    handle = shmkv.attach(store.name)
    real, calls, own = _segment.Segment.close, [], handle._engine._hseg

    def interrupted(self):
        if self is own and not calls:  # the handle's header segment, half-way through its close
            calls.append(1)
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(_segment.Segment, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        handle.close()
    assert handle.closed
    handle.close()  # finishes what the interrupted one left (not a no-op: no descriptor kept for good)
    assert _fds(store.name) == before
    assert store.clients() == [os.getpid()]


def test_segment_close_interrupted_after_closing_never_closes_the_number_again(make_store, monkeypatch, tmp_path):
    store = make_store()
    seg = _segment.Segment.open(_segment.header_name(store.name), readonly=True)
    target, real_close = seg._fd, os.close

    def interrupted(fd: int) -> None:
        real_close(fd)
        if fd == target:
            raise KeyboardInterrupt  # after the descriptor is closed, before the segment forgets it

    monkeypatch.setattr(os, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        seg.close()
    monkeypatch.setattr(os, "close", real_close)
    other = os.open(tmp_path / "another file", os.O_CREAT | os.O_RDWR)  # takes the freed number
    try:
        assert other == target
        seg.close()  # (never closes `other`, someone else's descriptor)
        os.fstat(other)
    finally:
        os.close(other)


def test_attach_interrupted_after_opening_the_data_segment_leaks_no_descriptor(make_store, monkeypatch):
    store = make_store()
    before = _fds(store.name)
    real_open, calls = _segment.Segment.open, []

    def open_then_interrupt(name, readonly):
        seg = real_open(name, readonly)
        if name.endswith(".d") and not calls:
            calls.append(1)
            raise KeyboardInterrupt  # the data segment is open, attach has not stored it anywhere yet
        return seg

    monkeypatch.setattr(_segment.Segment, "open", staticmethod(open_then_interrupt))
    with pytest.raises(KeyboardInterrupt):
        shmkv.attach(store.name)
    gc.collect()
    assert calls == [1] and _fds(store.name) == before
