"""Eviction frees exactly what an operation needs, and ``max_tokens`` tokens fit whatever the
page-unit alignment (docs/design.md §8, §11)."""

from __future__ import annotations

import numpy as np
import pytest
from procs.prefix import check, kv_for

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv._engine.table.header import CAPACITY, FINISHED, FLAGS, ID, LIVE, RECENCY, SPAN_CELLS, SPAN_PHYS, START, STATE
from shmkv.store._store import engine_of


def request(store: shmkv.Store, prompt: np.ndarray, capacity: int) -> tuple[shmkv.Sequence, int]:
    """Create over ``prompt`` (reusing what the store holds), compute the rest; (seq, reused)."""
    lay = store.layout
    seq = store.create_sequence(capacity=capacity, prefix=prompt)
    n = len(seq)
    k, v = kv_for(prompt, lay.layers, lay.kv_heads, lay.head_dim)
    seq.extend(k[:, n:], v[:, n:], tokens=prompt[n:])
    return seq, n


def ten_finished(store: shmkv.Store, rng: np.random.Generator) -> tuple[list[np.ndarray], list[int]]:
    """Ten finished requests of capacity 100 holding 90 tokens each, oldest use first."""
    prompts = [rng.integers(0, 30_000, 90).astype(np.int64) + 30_000 * i for i in range(10)]
    ids = []
    for p in prompts:
        s, n = request(store, p, 100)
        assert n == 0
        s.finish()
        ids.append(s.id)
    return prompts, ids


def test_the_least_recently_used_sequence_alone_makes_room(make_store):
    """Page unit 2: the eleventh request over the first one's prompt needs 100 cells; the least
    recently used sequence but its donor (the second) frees exactly 100: one eviction, that one."""
    store = make_store(layers=4, kv_heads=4, head_dim=128, dtype="float32", max_tokens=1050, max_seqs=64)
    assert engine_of(store).page_unit == 2
    rng = np.random.default_rng(1)
    prompts, ids = ten_finished(store, rng)
    assert store.stats().evictions == 0
    s, n = request(store, prompts[0], 100)
    assert n == 89  # the prefix is reused (at most len - 1 tokens)
    assert store.stats().evictions == 1
    live = {i.id for i in store.sequences()}
    assert live == (set(ids) - {ids[1]}) | {s.id}  # the least recently used but the donor: the second
    check(s, prompts[0], store.layout)
    for i in (0, 2, 9):
        check(store.sequence(ids[i]), prompts[i], store.layout)


def test_max_tokens_tokens_fit_whatever_the_page_unit(make_store):
    """Page unit 64 cells: ten aligned requests of capacity 100 leave 28 cells after each, and
    still all fit in max_tokens=1050 (the arena reserves what alignment leaves unused); the 50
    tokens max_tokens has left fit too, and one more cell evicts the least recently used."""
    store = make_store(layers=4, kv_heads=2, head_dim=8, dtype="float32", max_tokens=1050, max_seqs=64)
    e = engine_of(store)
    assert e.page_unit == 64
    rng = np.random.default_rng(2)
    prompts, ids = ten_finished(store, rng)
    assert store.stats().evictions == 0
    assert {i.id for i in store.sequences()} == set(ids)
    if share.ENABLED:  # the prompts' sequences start on a page unit: they can lend their pages
        assert all(i.start % 64 == 0 for i in store.sequences())
    st = store.stats()
    assert (st.reserved_tokens, st.free_tokens) == (1000, 50)
    extra = store.create_sequence(capacity=50)
    assert store.stats().evictions == 0 and store.stats().free_tokens == 0
    with pytest.raises(shmkv.CacheFullError):  # nothing evictable would make room: nothing evicted
        store.create_sequence(capacity=1001)
    assert store.stats().evictions == 0
    one = store.create_sequence(capacity=1)  # max_tokens is full: the least recently used goes, only it
    assert store.stats().evictions == 1
    assert {i.id for i in store.sequences()} == (set(ids) - {ids[0]}) | {extra.id, one.id}
    for i in range(1, 10):
        check(store.sequence(ids[i]), prompts[i], store.layout)


def test_growth_stays_within_max_tokens(make_store):
    """A sequence growing past its capacity takes no cell of the arena's alignment slack for
    tokens: with 10 of max_tokens left, growing 40 cells to 60 evicts the least recently used
    finished sequence (its range is free then: the sequence moves) rather than growing in place
    into the free cells after it."""
    store = make_store(layers=4, kv_heads=2, head_dim=8, dtype="float32", max_tokens=1050, max_seqs=64)
    rng = np.random.default_rng(3)
    prompts, ids = ten_finished(store, rng)
    s = store.create_sequence(capacity=40)
    toks = rng.integers(0, 30_000, 60).astype(np.int64)
    k, v = kv_for(toks, 4, 2, 8)
    s.extend(k, v, tokens=toks)
    st = store.stats()
    assert st.evictions == 1 and st.reserved_tokens <= 1050
    assert {i.id for i in store.sequences()} == (set(ids) - {ids[0]}) | {s.id}
    check(s, toks, store.layout)
    for i in range(1, 10):
        check(store.sequence(ids[i]), prompts[i], store.layout)


# -- every create evicts the fewest least recently used sequences that make room ---------------

LAYOUTS = {  # page unit -> layout (float32: 4096, 2048 and 64 bytes a cell and layer)
    1: dict(layers=1, kv_heads=8, head_dim=128),
    2: dict(layers=2, kv_heads=4, head_dim=128),
    64: dict(layers=2, kv_heads=2, head_dim=8),
}


class Model:
    """What a create must evict, from the table alone: the free cells are those no row's range
    and no live span hold; room is a free table row, ``capacity`` free cells from a multiple of
    the alignment, and max_tokens not exceeded by what ranges and spans hold."""

    def __init__(self, store: shmkv.Store) -> None:
        self.store, self.e = store, engine_of(store)

    def holds(self, slots: list[int]) -> np.ndarray:
        t, taken = self.e.table_np, np.zeros(self.e.cells, bool)
        for i in slots:
            taken[t[i, START] : t[i, START] + t[i, CAPACITY]] = True
            if t[i, STATE] == LIVE and t[i, SPAN_CELLS]:
                taken[t[i, SPAN_PHYS] : t[i, SPAN_PHYS] + t[i, SPAN_CELLS]] = True
        return taken

    def fits(self, gone: list[int], capacity: int, align: int) -> bool:
        t = self.e.table_np
        used = [int(i) for i in np.flatnonzero(t[:, STATE] != 0) if i not in gone]
        if len(used) >= self.store.layout.max_seqs:
            return False
        taken = self.holds(used)
        if int(taken.sum()) + capacity > self.store.layout.max_tokens:
            return False
        free = np.concatenate([[0], np.cumsum(~taken)])  # free[b] - free[a]: free cells in [a, b)
        a = np.arange(0, self.e.cells - capacity + 1, align)
        return bool((free[a + capacity] - free[a] == capacity).any())

    def free_matches_the_engine(self) -> None:
        t = self.e.table_np
        taken = self.holds([int(i) for i in np.flatnonzero(t[:, STATE] != 0)])
        cells = np.zeros(self.e.cells, bool)
        with self.e.locked():
            for a, n in self.e.free_ranges():
                cells[a : a + n] = True
        np.testing.assert_array_equal(cells, ~taken)

    def lru(self, spare: int) -> list[int]:
        """Evictable rows (finished, no live lease), least recently used first, but ``spare``."""
        t = self.e.table_np
        rows = [int(i) for i in np.flatnonzero((t[:, STATE] == LIVE) & ((t[:, FLAGS] & FINISHED) != 0))]
        rows = [i for i in rows if i != spare]  # (a finished sequence of this test has no lease)
        return sorted(rows, key=lambda i: int(t[i, RECENCY]))

    def fewest(self, order: list[int], capacity: int, align: int) -> int | None:
        """The fewest of ``order``, taken from its start, whose eviction makes room."""
        return next((k for k in range(len(order) + 1) if self.fits(order[:k], capacity, align)), None)

    def expect(self, capacity: int, prompt: np.ndarray | None) -> tuple[list[int], bool]:
        """(the rows the create must evict, whether it reuses the prefix); CacheFullError: None."""
        e = self.e
        n, _, donor = e.index.match(prompt) if prompt is not None else (0, 0, -1)
        cap = max(capacity, n)
        align = e.page_unit if share.ENABLED and prompt is not None and cap >= e.page_unit else 1
        if align > 1 and not self.fits([], cap, align) and self.fits([], cap, 1):
            align = 1  # an unaligned range without evicting, rather than an eviction to share pages
        order = self.lru(donor if n else -1)
        k = self.fewest(order, cap, align)
        if k is not None:
            return order[:k], bool(n)
        if n:  # only the donor's eviction makes room: a miss, which may evict it
            order = self.lru(-1)
            k = self.fewest(order, capacity, align)
            if k is not None:
                return order[:k], False
        raise shmkv.CacheFullError("the model: no room")


@pytest.mark.slow
@pytest.mark.parametrize("unit", sorted(LAYOUTS))
@pytest.mark.parametrize("mix", ["varied", "uniform"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_create_evicts_the_fewest_least_recently_used(make_store, unit, mix, seed):
    """Creates with and without prompts (sharing system prompts: donors, borrowers, spans left by
    evicted donors), finishes, uses of finished ones, frees; capacities of any size ("varied") or
    all one size ("uniform": an evicted range is often exactly the room asked for)."""
    max_tokens = 16 * max(unit, 40)
    uniform = 100 if unit < 64 else 128
    store = make_store(**LAYOUTS[unit], dtype="float32", max_tokens=max_tokens, max_seqs=14)
    e = engine_of(store)
    assert e.page_unit == unit
    model = Model(store)
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 30_000, int(rng.integers(unit, 3 * max(unit, 40)))).astype(np.int64)
               for _ in range(3)]
    prompts: dict[int, np.ndarray] = {}  # id -> its tokens
    held: list[shmkv.Sequence] = []  # leased, unfinished
    released: list[int] = []  # released, unfinished: never evictable
    evictions = checked = 0
    for _ in range(80):
        op = rng.random()
        if op < 0.1 and held:  # free a leased one
            s = held.pop(int(rng.integers(len(held))))
            prompts.pop(s.id, None)
            s.free()
            continue
        if op < 0.2 and released:  # free a released one
            sid = released.pop(int(rng.integers(len(released))))
            prompts.pop(sid)
            store.sequence(sid, write=True).free()
            continue
        done = sorted(set(prompts) - set(released) - {s.id for s in held})
        if op < 0.3 and done:  # take a finished one back and finish it again: a use
            store.sequence(int(rng.choice(done)), write=True).finish()
            continue
        if op < 0.4:  # no prompt: never aligned, never a donor
            prompt, capacity = None, int(rng.integers(1, 2 * max(unit, 40)))
        else:  # a shared system prompt (or a part of one) and a suffix of its own
            sys_ = systems[int(rng.integers(len(systems)))]
            cut = int(rng.integers(1, len(sys_) + 1))
            prompt = np.concatenate([sys_[:cut], rng.integers(0, 30_000, int(rng.integers(1, 40))) + 30_000])
            capacity = len(prompt) + int(rng.integers(0, 2 * max(unit, 40)))
        if mix == "uniform":
            prompt = None if prompt is None else prompt[: uniform - 10]
            capacity = uniform
        model.free_matches_the_engine()
        with e.locked():
            try:
                want, reuse = model.expect(capacity, prompt)
            except shmkv.CacheFullError:
                want, reuse = None, False
        t = e.table_np
        want_ids = None if want is None else {int(t[i, ID]) for i in want}
        before = {i.id for i in store.sequences()}
        if want is None:
            with pytest.raises(shmkv.CacheFullError):
                store.create_sequence(capacity=capacity, prefix=prompt)
            assert {i.id for i in store.sequences()} == before  # nothing evicted
            continue
        seq = store.create_sequence(capacity=capacity, prefix=prompt)
        checked += 1
        gone = before - {i.id for i in store.sequences()}
        assert gone == want_ids, (gone, want_ids)
        evictions += len(gone)
        assert store.stats().evictions == evictions
        for sid in gone:
            prompts.pop(sid, None)
        if prompt is None:
            seq.free() if rng.random() < 0.5 else held.append(seq)
            continue
        assert (len(seq) > 0) == reuse
        lay = store.layout
        n = len(seq)
        k, v = kv_for(prompt, lay.layers, lay.kv_heads, lay.head_dim)
        seq.extend(k[:, n:], v[:, n:], tokens=prompt[n:])
        prompts[seq.id] = prompt
        r = rng.random()
        if r < 0.8:
            seq.finish()
        elif r < 0.9 and len(held) < 3:
            held.append(seq)
        else:
            seq.release()  # released, not finished: never evictable
            released.append(seq.id)
    assert checked > 25
    if unit > 1 and share.ENABLED:
        assert evictions > 0  # the mix did fill the store
    for sid, p in prompts.items():  # every surviving request still holds its tokens
        check(store.sequence(sid), p, store.layout)
