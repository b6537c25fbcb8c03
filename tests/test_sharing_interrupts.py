"""A Ctrl-C (KeyboardInterrupt, in a process that survives it) or a SIGKILL inside a sharing
operation leaves the store as if the operation had not begun, and every process reads right.

A share.* unit interrupted or killed is rolled back (by the process itself, or by the next lock
holder; readers meanwhile read its rows as the rollback leaves them), and the same operation
then succeeds. A mapping change interrupted between two arrays leaves no alias: ``Shares``
records a row's mapping change (``unmapped``, ``dirty``) before it asks the kernel, so the
rollback's or the next sync's ``apply`` puts the row's own pages back, and the next sequence on
those cells reads its own bytes, never the donor's. A holder killed with the span epoch odd
and nothing to roll back is ended by the next lock entry. Writers killed at random while they
borrow and un-share leave every token's own K/V. A handle interrupted inside ``make_room``
keeps appending.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from _sharing_scenes import (D, H, L, PROMPT, data_mappings, holds_token_kv, kv_content, kv_of_tokens, make_donor,
                             sharing_store, token_donor)

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv._sequence import room
from shmkv.cli import verify
from shmkv.store._store import engine_of


# -- a share.* unit interrupted or killed ---------------------------------------------------------------


@pytest.mark.parametrize(("point", "op"), [("share.borrowed", "borrow"), ("share.unshared", "unshare"),
                                           ("share.released", "release"), ("share.moved", "move")])
def test_ctrl_c_inside_a_share_unit_rolls_it_back(make_store, point, op):
    """KeyboardInterrupt raised inside a share.* unit (as a Ctrl-C there would be): the unit is
    rolled back, every cell reads right here and in a read-only attachment, and the same
    operation then succeeds."""
    from shmkv._engine.locking import crash

    store = sharing_store(make_store)
    d, prompt = token_donor(store)
    f = store.create_sequence(capacity=512, prefix=np.r_[prompt[:250], [77]])
    k, v = kv_of_tokens([77])
    f.extend(k, v, tokens=[77])
    ro = shmkv.attach(store.name, readonly=True)
    dw = store.sequence(d.id, write=True)

    def run() -> None:
        if op == "borrow":
            toks = np.r_[prompt[:200], [4242]]
            g = store.create_sequence(capacity=512, prefix=toks)
            k, v = kv_of_tokens(toks[len(g):])
            g.extend(k, v, tokens=toks[len(g):])
        elif op == "unshare":
            f.truncate(101)
        elif op == "release":
            f.free()
        else:
            dw.truncate(20)

    try:
        for s in (store, ro):
            for info in s.sequences():
                assert holds_token_kv(s.sequence(info.id)) is True
        before = sorted(i.id for i in store.sequences())
        crash.arm(point, KeyboardInterrupt())
        try:
            with pytest.raises(KeyboardInterrupt):
                run()
        finally:
            crash.disarm()
        assert sorted(i.id for i in store.sequences()) == before  # rolled back
        for s in (store, ro):
            for info in s.sequences():
                assert holds_token_kv(s.sequence(info.id)) is True
        assert verify(store) == []
        run()  # and now it goes through
        for s in (store, ro):
            for info in s.sequences():
                assert holds_token_kv(s.sequence(info.id)) is True
    finally:
        ro.close()


@pytest.mark.slow
@pytest.mark.parametrize(("point", "op"), [("share.borrowed", "borrow"), ("share.unshared", "unshare"),
                                           ("share.released", "release"), ("share.moved", "move")])
def test_a_kill_inside_a_share_unit_leaves_every_read_right(make_store, point, op):
    """A child is SIGKILLed inside a share.* unit. A read-only attachment (which mapped the spans
    before) reads every sequence right both before anyone recovers (the dead unit read as rolled
    back) and after; this process then recovers, writes, borrows again, and reads right too."""
    store = sharing_store(make_store)
    d, prompt = token_donor(store)
    f = store.create_sequence(capacity=512, prefix=np.r_[prompt[:250], [77]])
    k, v = kv_of_tokens([77])
    f.extend(k, v, tokens=[77])
    f.release()
    assert store.stats().shared_tokens >= 240
    ro = shmkv.attach(store.name, readonly=True)
    try:
        def all_right(s) -> int:
            n = 0
            for info in s.sequences():
                assert holds_token_kv(s.sequence(info.id)) is True, info
                n += 1
            return n

        assert all_right(ro) == 2
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from procs.share_reads import crash_op; "
                "crash_op(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))")
        env = {**os.environ, "SHMKV_CRASH_AT": point}
        proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), store.name, op, str(d.id),
                               str(f.id)], env=env, capture_output=True, timeout=60)
        assert proc.returncode == -9, proc.stderr.decode()[-2000:]
        assert all_right(ro) == 2  # before recovery: the dead unit's rows as a rollback leaves them
        toks = np.r_[prompt[:200], [88, 89]]
        g = store.create_sequence(capacity=512, prefix=toks)  # recovers, borrows
        k, v = kv_of_tokens(toks[len(g):])
        g.extend(k, v, tokens=toks[len(g):])
        fw = store.sequence(f.id, write=True)
        fw.truncate(99)  # copy-on-write after the recovery
        k, v = kv_of_tokens(np.arange(3000, 3040))
        fw.extend(k, v, tokens=np.arange(3000, 3040))
        assert all_right(store) == 3 and all_right(ro) == 3
        assert verify(store) == []
    finally:
        ro.close()


def test_an_odd_span_epoch_with_an_empty_log_ends_at_the_next_lock(make_store):
    """A holder killed after its frees inside a larger transaction left the log (journal invariant
    6) leaves the span epoch odd with nothing to roll back: the next lock entry ends it, so every
    process re-maps and none waits for it forever."""
    from shmkv._engine.table import header as _header

    store = sharing_store(make_store)
    rng = np.random.default_rng(15)
    d, prompt = make_donor(store, rng)
    b = store.create_sequence(capacity=512, prefix=np.concatenate([prompt, [1]]))
    hdr = store._engine.hdr
    hdr[_header.W_SPANS] += 1  # as the dead holder left it
    assert hdr[_header.W_SPANS] & 1 and not hdr[_header.W_UNDO_COUNT]
    with store.transaction():
        pass
    assert not hdr[_header.W_SPANS] & 1
    b.truncate(5)  # the spans follow the table again
    assert store.stats().shared_tokens == 0 and np.array_equal(b.keys(0), d.keys(0)[:5])


@pytest.mark.slow
def test_writers_killed_at_random_while_sharing_leave_every_token_right(make_store, tmp_path):
    """Two writers doing mixed operations on shared prompts (procs.crash.stress: reuses
    borrow; truncates, removes, shift_lefts, forks, frees un-share or release), SIGKILLed at random
    and restarted, beside a verifying read-only reader and a snapshotter: zero wrong reads, and
    after it all the store and the last snapshot hold every token's own K/V."""
    import signal
    import time

    from procs.crash import layout_for, state, stress
    from procs.share import snapshotter, verifier

    from shmkv import cli
    from shmkv.testing import start_in_process, unique_name

    seconds = float(os.environ.get("SHMKV_CHAOS_SECONDS", "6"))
    store = make_store(**dict(layout_for("share"), max_tokens=1024, max_seqs=24))
    path = str(tmp_path / "chaos.shmkv")
    rng = np.random.default_rng(int(os.environ.get("SHMKV_CHAOS_SEED", "21")))
    reader = start_in_process(verifier, store.name, seconds, start_method="fork", timeout=seconds + 60)
    snap = start_in_process(snapshotter, store.name, path, seconds, start_method="fork", timeout=seconds + 60)
    seed = 1000
    writers = [start_in_process(stress, store.name, seed + i, start_method="fork", timeout=seconds + 60)
               for i in range(2)]
    shared = kills = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(float(rng.uniform(0.005, 0.08)))
            i = int(rng.integers(0, 2))
            writers[i].kill(signal.SIGKILL)
            kills += 1
            seed += 1
            writers[i] = start_in_process(stress, store.name, seed + 2, start_method="fork", timeout=seconds + 60)
            shared = max(shared, store.stats().shared_tokens)
    finally:
        for w in writers:
            w.kill(signal.SIGKILL)
    got = reader.result()
    saves = snap.result()
    print(f"{kills} kills, reads {got}, {saves} saves, at most {shared} tokens shared")
    assert got["reads"] > 0 and saves > 0 and shared > 0
    with store.transaction():  # the next lock holder recovers
        pass
    assert cli.verify(store) == []
    state(store)
    loaded = shmkv.load(path, name=unique_name("chaos"))
    try:
        state(loaded)
    finally:
        loaded.unlink()


# -- a mapping change interrupted between two arrays leaves no alias ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("at_call", [2, 3])
def test_a_ctrl_c_inside_a_borrows_mapping_leaves_no_alias(make_store, monkeypatch, at_call):
    """A Ctrl-C (KeyboardInterrupt, raised between bytecodes: here right after the kernel mapped
    the span's first arrays) inside Sharing.borrow -> Shares.set -> remap, which is no critical
    code: the create rolls back. Then this process must not keep the new row's cells mapped on
    the donor's pages: the next sequence on those cells would read the donor's bytes as its own,
    and its appends would write into the donor's (and every borrower's) pages."""
    import gc

    st = sharing_store(make_store)
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
    st = sharing_store(make_store)
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
    sequence on B's cells, not the donor's bytes."""
    st = sharing_store(make_store)
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


# -- a handle interrupted inside make_room -------------------------------------------------------------


ROOM_H = 2  # (the store of the make_room test has 2 kv heads)


def _room_kv(tokens):
    t = np.asarray(tokens, dtype=np.float32)
    k = np.empty((L, len(t), ROOM_H, D), np.float32)
    for layer in range(L):
        k[layer] = (4 * t + layer)[:, None, None]
    return k, -k


def test_a_ctrl_c_after_make_room_reserved_leaves_the_handle_able_to_append(make_store, monkeypatch):
    """A Ctrl-C inside ``make_room`` (where tools/sigint_storm.py lands one: after it reserved,
    before it set the handle's limits) leaves the handle appending: its next appends reserve room
    again, never take the full layer 0 for a sliding window's buffer (CacheFullError 'new tokens
    on sliding/chunked layer 0 exceed the 0 a window buffer takes between commits', on a store
    with no sliding layer)."""
    st = make_store(layers=L, kv_heads=ROOM_H, head_dim=D, dtype="float32", max_tokens=16384, max_seqs=8)
    s = st.create_sequence(capacity=4096)
    real, calls = room.limits, []

    def limits(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt  # (a SIGINT lands at the eval breaker of this call)
        return real(*args)

    first = list(range(1, 3001))  # (past the pages reserved at create: make_room reserves more)
    k, v = _room_kv(first)
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
    s.extend(*_room_kv(more), tokens=more)
    assert [int(x) for x in np.asarray(s.tokens)] == first + more
    for layer in range(L):
        assert np.array_equal(np.asarray(s.keys(layer)), _room_kv(first + more)[0][layer])
