"""Views another process holds of a borrower's committed cells stay right across the
borrower's truncate inside its span (docs/stores.md, what invalidates a view; ``_engine/spans/lending.py``).

A borrower that truncates inside its span keeps the whole page units below its new length
shared and copies the rest it keeps to its own pages; an idle process still maps the span
there until its next read. The span's physical cells it no longer maps stay taken (the
borrower's ``SPAN_TAKEN``) until the borrower is freed or moved, so new sequences filling
every free cell never write under those views; a donor that writes there moves first."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from procs.span_views import check_views, hold_views, kv_of

import shmkv
from shmkv.cli import main
from shmkv.testing import start_in_process

L, H, D = 2, 4, 8  # float32: a page unit of 32 cells; int8: 256 (its scales fill a page slower)
PROMPT = 300
NEW_LEN = 40


def _junk(store: shmkv.Store, n: int, value: float) -> np.ndarray:
    return np.full((L, n, H, D), value, np.float32)


def _scene(store: shmkv.Store) -> tuple[shmkv.Sequence, shmkv.Sequence, np.ndarray]:
    """A finished donor of PROMPT tokens and a borrower reusing them all (tokens, K and V of
    ``kv_of``); returns (donor's write handle, borrower, the borrower's tokens)."""
    toks = np.arange(3000, 3000 + PROMPT + 1)
    d = store.create_sequence(capacity=PROMPT + 8, prefix=toks[:1])
    k, v = kv_of(toks[len(d) : PROMPT], L, H, D)
    d.extend(k, v, tokens=toks[len(d) : PROMPT])
    d.finish()
    b = store.create_sequence(capacity=PROMPT + 64, prefix=toks)
    assert len(b) == PROMPT
    return d, b, toks[:PROMPT]


def _fill(store: shmkv.Store) -> list[shmkv.Sequence]:
    """New sequences over every free cell, each cell written (K/V 1143.75, token id -7)."""
    out = []
    while room := store.stats().largest_free_range:
        s = store.create_sequence(capacity=room)
        s.extend(_junk(store, room, 1143.75), _junk(store, room, -1143.75), tokens=np.full(room, -7))
        out.append(s)
    return out


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("donor", ["freed", "writes"])
def test_held_views_of_a_borrower_survive_its_truncate_inside_the_span(make_store, dtype, method, donor):
    """Another process holds keys(), kv() and raw_keys()/raw_values() views of a borrower,
    idle; the borrower truncates inside its span, then its donor is gone (freed) or writes
    past its own new length, and new sequences fill every free cell. The held views of the
    committed cells [0, NEW_LEN) are what they were (copies taken then, and the reference K/V
    of the token ids); the borrower reads and writes right; the cells kept for those views show
    in stats().retained_cells until the borrower is freed."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=2048, max_seqs=64)
    u = store._engine.page_unit
    d, b, toks = _scene(store)
    span = PROMPT // u * u
    assert store.stats().shared_tokens == span > NEW_LEN  # the borrow this test is about
    ref_k, ref_v = kv_of(toks, L, H, D)
    if donor == "freed":
        d.free()
    ctx = mp.get_context(method)
    ready, go = ctx.Event(), ctx.Event()
    child = None
    try:
        if method == "fork":  # a reader handle of this process, inherited
            args = (None, store.sequence(b.id), NEW_LEN, (ref_k, ref_v), (ready, go))
        else:
            args = (store.name, b.id, NEW_LEN, (ref_k, ref_v), (ready, go))
        child = start_in_process(hold_views, *args, start_method=method, timeout=180)
        assert ready.wait(120), "the child never took its views"
        b.truncate(NEW_LEN)
        kept = NEW_LEN // u * u
        assert store.stats().shared_tokens == kept  # (int8: 0, the whole span is copied)
        if donor == "writes":  # the donor goes below what the borrower's views may still show, and writes
            before = next(s.start for s in store.sequences() if s.id == d.id)
            d = store.sequence(d.id, write=True)
            d.truncate(NEW_LEN - 5)
            d.extend(_junk(store, 20, 555.5), _junk(store, 20, -555.5), tokens=np.full(20, -5))
            assert next(s.start for s in store.sequences() if s.id == d.id) != before  # it moved first
        # the span's cells under [kept, NEW_LEN), whole page units: no live range holds them now
        retained = -(-NEW_LEN // u) * u - kept
        assert store.stats().retained_cells == retained
        fillers = _fill(store)
        assert fillers and store.stats().largest_free_range == 0
        go.set()
        bad = child.result()
        child = None
        assert bad == [], f"held views changed under the truncate: {bad}"
        # the borrower itself: its cells, then its appends (into its own cells)
        views = {f"raw_{x}{layer}": (b.raw_keys if x == "k" else b.raw_values)(layer)[0]
                 for layer in range(L) for x in "kv"}
        if dtype == "int8":
            views.update({f"scales_{x}{layer}": (b.raw_keys if x == "k" else b.raw_values)(layer)[1]
                          for layer in range(L) for x in "kv"})
        assert check_views(views, views, (ref_k, ref_v), NEW_LEN, int8=dtype == "int8") == []
        more = np.arange(7000, 7000 + 30)
        k, v = kv_of(more, L, H, D)
        b.extend(k, v, tokens=more)
        full_k, full_v = kv_of(np.concatenate([toks[:NEW_LEN], more]), L, H, D)
        views = {f"raw_{x}{layer}": (b.raw_keys if x == "k" else b.raw_values)(layer)[0]
                 for layer in range(L) for x in "kv"}
        if dtype == "int8":
            views.update({f"scales_{x}{layer}": (b.raw_keys if x == "k" else b.raw_values)(layer)[1]
                          for layer in range(L) for x in "kv"})
        assert check_views(views, views, (full_k, full_v), NEW_LEN + 30, int8=dtype == "int8") == []
        for f in fillers:  # and nobody wrote the fillers' cells
            codes, scales = f.raw_keys(0)
            got = codes.astype(np.float32) * (1 if scales is None else scales[:, :, None])
            np.testing.assert_allclose(got, 1143.75, rtol=1e-3)
        free = store.stats().free_tokens
        b.free()
        assert store.stats().retained_cells == 0
        assert store.stats().free_tokens >= free + PROMPT + 64 + retained
    finally:
        go.set()
        if child is not None:
            child.kill()  # (reaps it)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_retained_cells_are_bounded_and_given_back(make_store, capsys, dtype):
    """What a truncated borrower keeps taken: the span's whole page units under its new length,
    never more than it borrowed; a later truncate gives back those past its new length, a
    clear all of them; ``stats()`` and ``shmkv info`` show them."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=2048, max_seqs=64)
    u = store._engine.page_unit
    d, b, _ = _scene(store)
    d.free()
    span = PROMPT // u * u
    free0 = store.stats().free_tokens
    for n, more in ((PROMPT - 1, 0), (NEW_LEN, 0), (NEW_LEN + 100, 100)):
        # a truncate above the span's last unit keeps it mapped: nothing retained; a re-extend
        # past the new length retains nothing more
        b.truncate(n)
        if more:
            k, v = kv_of(np.arange(more), L, H, D)
            b.extend(k, v)
        ceil = -(-min(n, NEW_LEN) // u) * u
        want = max(0, min(span, ceil) - min(n, NEW_LEN) // u * u) if n < span else 0
        assert store.stats().retained_cells == want, (n, want)
        assert store.stats().retained_cells <= span
    # the cells past the span's kept units are free again, and never more than the span is held
    assert store.stats().free_tokens >= free0 + span - (-(-NEW_LEN // u) * u)
    b.truncate(u // 2 if u > 1 else 1)  # below the first unit: one unit kept for views of it
    assert store.stats().retained_cells == u
    assert main(["info", store.name]) == 0
    assert f"{u} span cells retained for views of truncated borrowers" in capsys.readouterr().out
    b.clear()  # no committed cells left to show: everything given back
    assert store.stats().retained_cells == 0 and store.stats().shared_tokens == 0
    assert store.stats().free_tokens == free0 + span


@pytest.mark.parametrize("op", ["remove", "shift_left", "free"])
def test_a_borrower_that_moves_gives_back_what_it_kept(make_store, op):
    """A borrower that truncated inside its span, then is moved (``remove``, ``shift_left``:
    a fresh range) or freed: its views are void (docs/stores.md), and the cells it kept are
    free again."""
    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float32", max_tokens=4096, max_seqs=64)
    d, b, _ = _scene(store)
    d.free()
    b.truncate(NEW_LEN)
    assert store.stats().retained_cells > 0
    if op == "remove":
        b.remove(10, 20)
    elif op == "shift_left":
        b.shift_left(5)
    else:
        b.free()
    st = store.stats()
    assert st.retained_cells == 0 and st.shared_tokens == 0
    assert st.free_tokens == store.layout.max_tokens - st.reserved_tokens


def test_an_interrupted_truncate_keeps_what_the_span_kept(make_store, monkeypatch):
    """A Ctrl-C inside a borrower's copy-on-write (crash point ``share.unshared``: its copies
    written, its span words not yet) rolls the truncate back with the words it keeps taken:
    the length, the mapped span and the retained cells are what they were, its cells too."""
    from shmkv._engine.locking import crash

    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float32", max_tokens=4096, max_seqs=64)
    u = store._engine.page_unit
    d, b, toks = _scene(store)
    d.free()
    b.truncate(NEW_LEN)
    before = store.stats()
    assert before.retained_cells == u and before.shared_tokens == NEW_LEN // u * u

    def interrupt(name: str) -> None:
        if name == "share.unshared":
            raise KeyboardInterrupt

    monkeypatch.setattr(crash, "point", interrupt)
    with pytest.raises(KeyboardInterrupt):
        b.truncate(10)
    monkeypatch.undo()
    after = store.stats()
    assert len(b) == NEW_LEN
    assert (after.retained_cells, after.shared_tokens, after.free_tokens) == (
        before.retained_cells, before.shared_tokens, before.free_tokens)
    ref_k, _ = kv_of(toks[:NEW_LEN], L, H, D)
    for layer in range(L):
        np.testing.assert_array_equal(b.keys(layer), ref_k[layer])
    b.truncate(10)  # and the next one goes through
    assert store.stats().retained_cells == u and store.stats().shared_tokens == 0
