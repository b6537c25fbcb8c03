"""Real Ctrl-Cs a process survives, on shared prefix pages (issue: helper sigint33).

tools/sigint_storm.py sends SIGINT every 0.2-3 ms to a child that creates, reads, extends,
truncates, forks, copies and frees borrowers of a cached prefix, catching KeyboardInterrupt
around every step. Its findings are timing-dependent; each is pinned here at the exact spot
the storm's Ctrl-C landed (a KeyboardInterrupt raised from the call made there), so the test
is deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from shmkv._sequence import room

L, H, D = 3, 2, 64


def _kv(tokens):
    t = np.asarray(tokens, dtype=np.float32)
    k = np.empty((L, len(t), H, D), np.float32)
    for layer in range(L):
        k[layer] = (4 * t + layer)[:, None, None]
    return k, -k


def test_a_ctrl_c_after_make_room_reserved_leaves_the_handle_able_to_append(make_store, monkeypatch):
    """Storm finding (fork seed 101): ``make_room`` sets ``w.room`` and only then ``w.lim``; a
    Ctrl-C between them left ``lim`` below ``room``, so every later append of that handle skipped
    make_room and fell into ``compact`` as if the full layer 0 were a sliding window: CacheFullError
    'new tokens on sliding/chunked layer 0 exceed the 0 a window buffer takes between commits', on
    a store with no sliding layer, for good."""
    st = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float32", max_tokens=16384, max_seqs=8)
    s = st.create_sequence(capacity=4096)
    real, calls = room.limits, []

    def limits(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt  # (a SIGINT lands at the eval breaker of this call)
        return real(*args)

    first = list(range(1, 3001))  # (past the pages reserved at create: make_room reserves more)
    k, v = _kv(first)
    monkeypatch.setattr(room, "limits", limits)
    with pytest.raises(KeyboardInterrupt):
        s.append(0, k[0], v[0])
    monkeypatch.undo()
    assert calls, "the interrupt did not land in make_room"
    assert len(s) == 0  # nothing committed
    for layer in range(L):  # the same handle goes on
        s.append(layer, k[layer], v[layer])
    s.commit(tokens=first)
    more = list(range(3001, 3500))
    s.extend(*_kv(more), tokens=more)
    assert [int(x) for x in np.asarray(s.tokens)] == first + more
    for layer in range(L):
        assert np.array_equal(np.asarray(s.keys(layer)), _kv(first + more)[0][layer])
