"""Ctrl-C (KeyboardInterrupt, in a process that survives it) that lands after create_sequence or
a lease take-over has done its work but before the handle reaches the caller (issue 22 part B):
the caller never gets the handle, so nothing may be left behind: no live sequence nobody can
name (before: one leaked row per interrupt, until the store filled up with them), no lease held
for a handle that does not exist (before: other processes saw it alive until we closed)."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv.store import _store


def _interrupting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next write handle's construction raise KeyboardInterrupt (the store's work done)."""
    real, calls = _store.Sequence, []

    def sequence(*args, **kwargs):
        if kwargs.get("write") and not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(_store, "Sequence", sequence)
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
    # another process may take it at once (before: LeaseError while this attachment lived)
    assert shmkv_child.run(_take_and_release, store, seq.id, start_method="spawn") == 2


def _take_and_release(store: shmkv.Store, seq_id: int) -> int:
    seq = store.sequence(seq_id, write=True)
    n = len(seq)
    seq.release()
    return n
