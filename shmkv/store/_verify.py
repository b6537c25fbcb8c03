"""``shmkv verify``'s checks of a store's header invariants, read through the engine's ``rows``
part: the problems found, as sentences (an empty list: all good)."""

from __future__ import annotations

import itertools

from shmkv.store._store import Store, engine_of

__all__ = ["verify"]


def verify(store: Store) -> list[str]:
    """Check the header's invariants; return the problems found (empty: all good)."""
    problems = []
    lay = store.layout
    engine = engine_of(store)
    pending, pid = engine.rows.undo_log()
    if pending:
        problems.append(f"a structural operation of pid {pid} left {pending} row(s) to roll back (it died, or is "
                        "running now): `shmkv verify --repair NAME` (or any structural operation) rolls it back")
    table, span_problems = engine.rows.table_rows(engine.cells)  # one copy of the table
    live = [r for r in table if r.kind == "live"]
    if any(r.kind == "unknown" for r in table):
        problems.append("a sequence slot has an unknown state")
    # encoder caches own ranges of cells too
    ranges = [(r.start, r.capacity, f"encoder of {r.id}") for r in table if r.kind == "encoder"]
    next_id = engine.rows.next_id()
    for row in live:
        sid, start, cap, length, gen = row.id, row.start, row.capacity, row.length, row.generation
        if start < 0 or start + cap > engine.cells:
            problems.append(f"sequence {sid}: range [{start}, {start + cap}) outside the arena's "
                            f"{engine.cells} cells (max_tokens={lay.max_tokens} and alignment slack)")
        if not 0 <= length <= cap:
            problems.append(f"sequence {sid}: length {length} outside capacity {cap}")
        woff = row.window_offset
        if lay.bounded and not (0 <= woff <= length and length - woff <= lay.window_cells):
            problems.append(f"sequence {sid}: sliding/chunked layers hold tokens {woff}..{length}, "
                            f"more than their {lay.window_cells} cells or out of order")
        if gen & 1:
            problems.append(f"sequence {sid}: generation {gen} is odd (a structural change is running or died)")
        if sid >= next_id or sid < 1:
            problems.append(f"sequence {sid}: id not below next id {next_id}")
        ranges.append((start, cap, f"sequence {sid}"))
    problems += span_problems
    ids = [r.id for r in live]
    if len(set(ids)) != len(ids):
        problems.append("sequence ids repeat")
    ranges.sort()
    for (s1, c1, i1), (s2, _, i2) in itertools.pairwise(ranges):
        if s1 + c1 > s2:
            problems.append(f"{i1} and {i2} overlap at cell {s2}")
    return problems
