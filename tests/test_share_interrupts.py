"""An exception between two arrays' mappings of a span (a Ctrl-C lands after any C call):
this process must not keep a half-made mapping recorded nowhere (review 33; the fix:
``Shares`` records a row's mapping change, ``unmapped`` and ``dirty``, before it asks the
kernel, so the rollback's or the next sync's ``apply`` puts the row's own pages back)."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv._engine import share

L, H, D = 3, 4, 64
PROMPT = 300


def _store(make_store, dtype="float16"):
    return make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=32)


def _kv_bytes(seq, n):
    out = []
    for i in range(L):
        k, v = seq.kv(i)
        out += [np.asarray(k)[:n].tobytes(), np.asarray(v)[:n].tobytes()]
    return out


def _data_mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("skv_" + name + ".d"))


@pytest.mark.parametrize("at_call", [2, 3])
def test_a_ctrl_c_inside_a_borrows_mapping_leaves_no_alias(make_store, monkeypatch, at_call):
    """A Ctrl-C (KeyboardInterrupt, raised between bytecodes: here right after the kernel mapped
    the span's first arrays) inside Sharing.borrow -> Shares.set -> remap, which is no critical
    code: the create rolls back. Then this process must not keep the new row's cells mapped on
    the donor's pages: the next sequence on those cells would read the donor's bytes as its own,
    and its appends would write into the donor's (and every borrower's) pages."""
    import gc

    st = _store(make_store)
    rng = np.random.default_rng(35)
    prompt = np.arange(1000, 1000 + PROMPT)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    shape = (L, PROMPT, H, D)
    d.extend(rng.standard_normal(shape), rng.standard_normal(shape), tokens=prompt)
    d.finish()
    want_d = _kv_bytes(d, PROMPT)
    gc.collect()
    maps0 = _data_mappings(st.name)
    real, calls = share._mmap, []

    def mmap(*args):
        calls.append(args)
        if len(calls) == at_call:
            raise KeyboardInterrupt  # (as a SIGINT lands at the eval breaker after a C call)
        return real(*args)

    monkeypatch.setattr(share, "_mmap", mmap)
    with pytest.raises(KeyboardInterrupt):
        st.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
    monkeypatch.undo()
    assert len(calls) >= at_call, "the interrupt did not land inside the borrow's mapping"
    assert {s.id for s in st.sequences()} == {d.id}  # rolled back
    gc.collect()
    leftover = _data_mappings(st.name) - maps0
    g = st.create_sequence(capacity=1024, prefix=[999_999])  # (a miss on a page unit: the same cells)
    x = np.full((H, D), 3.0, np.float32)
    for _ in range(16):
        for layer in range(L):
            g.append(layer, x, x)
        g.commit()
    assert _kv_bytes(d, PROMPT) == want_d, f"the donor's cells written through a stale alias ({leftover} mappings)"
    assert float(np.asarray(g.keys(0))[1:16].min()) == 3.0
    assert leftover == 0


def test_a_ctrl_c_inside_a_readers_sync_leaves_no_alias(make_store, monkeypatch):
    """The same in a reader: a Ctrl-C lands inside the sync that maps borrower B's span (a read of
    B in a read-only attachment, Shares.apply -> place -> remap, no critical code). B is freed
    and a new sequence G takes its cells; the reader must then read G's bytes, not the donor's
    (the half-made mapping was recorded nowhere, so no later apply undoes it)."""
    st = _store(make_store)
    rng = np.random.default_rng(36)
    prompt = np.arange(1000, 1000 + PROMPT)
    d = st.create_sequence(capacity=1024, prefix=prompt)
    shape = (L, PROMPT, H, D)
    d.extend(rng.standard_normal(shape), rng.standard_normal(shape), tokens=prompt)
    d.finish()
    ro = shmkv.attach(st.name, readonly=True)
    try:
        ro.sequence(d.id).keys(0)  # (synced: nothing to map yet)
        b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
        real, calls = share._mmap, []

        def mmap(*args):
            calls.append(args)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*args)

        monkeypatch.setattr(share, "_mmap", mmap)
        with pytest.raises(KeyboardInterrupt):
            ro.sequence(b.id).keys(0)
        monkeypatch.undo()
        b.free()
        g = st.create_sequence(capacity=1024, prefix=[999_999])
        k = np.full((L, PROMPT, H, D), 3.0, np.float32)
        g.extend(k, k)
        assert float(np.asarray(g.keys(0)).min()) == 3.0  # the writer reads its own bytes
        got = np.asarray(ro.sequence(g.id).keys(0))
        assert float(got.min()) == float(got.max()) == 3.0, "the reader shows the donor's bytes as G's"
    finally:
        monkeypatch.undo()
        ro.close()

