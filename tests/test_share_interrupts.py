"""An exception between two arrays' mappings of a span (a Ctrl-C lands after any C call):
this process must not keep a half-made mapping recorded nowhere (review 33; the fix:
``Shares`` records a row's mapping change, ``unmapped`` and ``dirty``, before it asks the
kernel, so the rollback's or the next sync's ``apply`` puts the row's own pages back)."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv._engine.spans import mappings as share
from _maplimit_scenes import D, H, L, PROMPT, data_mappings, kv_content, lim_store, make_donor
from shmkv.store._store import engine_of


@pytest.mark.slow
@pytest.mark.parametrize("at_call", [2, 3])
def test_a_ctrl_c_inside_a_borrows_mapping_leaves_no_alias(make_store, monkeypatch, at_call):
    """A Ctrl-C (KeyboardInterrupt, raised between bytecodes: here right after the kernel mapped
    the span's first arrays) inside Sharing.borrow -> Shares.set -> remap, which is no critical
    code: the create rolls back. Then this process must not keep the new row's cells mapped on
    the donor's pages: the next sequence on those cells would read the donor's bytes as its own,
    and its appends would write into the donor's (and every borrower's) pages."""
    import gc

    st = lim_store(make_store)
    rng = np.random.default_rng(35)
    d, prompt = make_donor(st, rng)
    want_d = kv_content(d, PROMPT)
    gc.collect()
    maps0 = data_mappings(st.name)
    real, calls = share.libc_mmap, []

    def mmap(*args):
        calls.append(args)
        if len(calls) == at_call:
            raise KeyboardInterrupt  # (as a SIGINT lands at the eval breaker after a C call)
        return real(*args)

    monkeypatch.setattr(share, "libc_mmap", mmap)
    with pytest.raises(KeyboardInterrupt):
        st.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
    monkeypatch.undo()
    assert len(calls) >= at_call, "the interrupt did not land inside the borrow's mapping"
    assert {s.id for s in st.sequences()} == {d.id}  # rolled back
    gc.collect()
    leftover = data_mappings(st.name) - maps0
    g = st.create_sequence(capacity=1024, prefix=[999_999])  # (a miss on a page unit: the same cells)
    x = np.full((H, D), 3.0, np.float32)
    for _ in range(16):
        for layer in range(L):
            g.append(layer, x, x)
        g.commit()
    assert kv_content(d, PROMPT) == want_d, f"the donor's cells written through a stale alias ({leftover} mappings)"
    assert float(np.asarray(g.keys(0))[1:16].min()) == 3.0
    assert leftover == 0


def test_a_ctrl_c_inside_a_readers_sync_leaves_no_alias(make_store, monkeypatch):
    """The same in a reader: a Ctrl-C lands inside the sync that maps borrower B's span (a read of
    B in a read-only attachment, Shares.apply -> place -> remap, no critical code). B is freed
    and a new sequence G takes its cells; the reader must then read G's bytes, not the donor's
    (the half-made mapping was recorded nowhere, so no later apply undoes it)."""
    st = lim_store(make_store)
    rng = np.random.default_rng(36)
    d, prompt = make_donor(st, rng)
    ro = shmkv.attach(st.name, readonly=True)
    try:
        ro.sequence(d.id).keys(0)  # (synced: nothing to map yet)
        b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
        real, calls = share.libc_mmap, []

        def mmap(*args):
            calls.append(args)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*args)

        monkeypatch.setattr(share, "libc_mmap", mmap)
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


class _PopThenInterrupt(dict):
    """A Shares.cur whose pop is followed by a Ctrl-C: what a SIGINT pending at the eval breaker
    after that C call (dict.pop) raises."""

    def pop(self, *args):
        super().pop(*args)
        raise KeyboardInterrupt

    def __delitem__(self, key):  # (the same after a del: so the test holds whatever _unmap uses)
        super().__delitem__(key)
        raise KeyboardInterrupt


def test_a_ctrl_c_right_after_unmap_pops_the_span_leaves_no_alias(make_store):
    """A reader whose sync drops freed borrower B's mapping is interrupted right after B leaves
    ``cur`` (a SIGINT pending at the eval breaker after that C call): B is recorded ``unmapped``
    and ``dirty`` before, so the next sync puts its own pages back and the reader shows the next
    sequence on B's cells, not the donor's bytes (review 33 finding 1b: Shares._unmap popped it
    from ``cur`` first)."""
    st = lim_store(make_store)
    rng = np.random.default_rng(37)
    d, prompt = make_donor(st, rng)
    ro = shmkv.attach(st.name, readonly=True)
    sh = engine_of(ro).shares
    try:
        b = st.create_sequence(capacity=1024, prefix=np.r_[prompt, [1]])
        ro.sequence(b.id).keys(0)  # B mapped in the reader
        assert engine_of(st).slot_of(b.id) in sh.cur
        b.free()
        sh.cur = _PopThenInterrupt(sh.cur)
        try:
            with pytest.raises(KeyboardInterrupt):
                ro.sequence(d.id).keys(0)  # its sync drops B's mapping
        finally:
            sh.cur = dict(sh.cur)
        g = st.create_sequence(capacity=1024, prefix=[999_999])
        k = np.full((L, PROMPT, H, D), 3.0, np.float32)
        g.extend(k, k)
        got = np.asarray(ro.sequence(g.id).keys(0))
        assert float(got.min()) == float(got.max()) == 3.0, "the reader shows the donor's bytes as G's"
    finally:
        ro.close()
