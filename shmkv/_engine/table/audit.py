"""What the span words of the sequence table promise at rest (no transaction open), as problems
a check reports: ``shmkv verify`` and the tests' ``shmkv.testing.assert_store_state``.

At rest, for every live row that borrows (``_engine/spans/lending.py``, ``_engine/spans/mappings.py``):

* its span is whole page units: ``SPAN_CELLS <= SPAN_TAKEN``, both multiples of the page unit,
  and ``SPAN_PHYS`` is 0 when nothing is taken;
* it maps no more shared cells than it holds tokens (``SPAN_CELLS <= LENGTH``: a truncate
  below the span copied the rest on write);
* the cells it keeps taken, ``[SPAN_PHYS, SPAN_PHYS + SPAN_TAKEN)``, lie inside the arena, outside
  its own range, and inside no other row's range but its owner's: the live row whose range
  starts at ``SPAN_PHYS``, which is flagged ``LENT`` and whose range holds the whole span. With
  no owner there (the donor was freed or moved), the cells belong to no range at all.

The span epoch is even: a transaction that changes spans makes it odd and even again at its
end, its rollback, or the recovery after its process died.
"""

from __future__ import annotations

import bisect

from shmkv._engine.table.header import (CAPACITY, ENCODER, FLAGS, ID, LENGTH, LENT, LIVE, SPAN_CELLS, SPAN_PHYS,
                                        SPAN_TAKEN, START, STATE)

__all__ = ["span_problems"]


def span_problems(rows: list[list[int]], span_epoch: int, page_unit: int, cells: int) -> list[str]:
    """The problems of ``rows`` (the sequence table's words, copied: ``table_np.tolist()``) as
    the module docstring states them; empty when there are none."""
    problems = []
    if span_epoch & 1:
        problems.append(f"the span epoch {span_epoch} is odd: a transaction that changes shared pages is open, "
                        "or died before its recovery")
    ranges = sorted((r[START], r[START] + r[CAPACITY], i) for i, r in enumerate(rows) if r[STATE] in (LIVE, ENCODER))
    starts = [s for s, _, _ in ranges]
    for i, r in enumerate(rows):
        phys, m, taken = r[SPAN_PHYS], r[SPAN_CELLS], r[SPAN_TAKEN]
        if r[STATE] != LIVE or not (phys or m or taken):
            continue
        who = f"sequence {r[ID]}"
        if not 0 <= m <= taken or m % page_unit or taken % page_unit:
            problems.append(f"{who}: span of {m} cells keeping {taken} taken: not whole page units of "
                            f"{page_unit} cells with the first at most the second")
            continue
        if not taken:
            problems.append(f"{who}: span start {phys} with no cell taken")
            continue
        if r[LENGTH] < m:
            problems.append(f"{who}: maps {m} shared cells but holds {r[LENGTH]} tokens (a truncate below its "
                            "span copies the rest first)")
        lo, hi = phys, phys + taken
        if lo < 0 or hi > cells:
            problems.append(f"{who}: span cells [{lo}, {hi}) outside the arena's {cells} cells")
        k = bisect.bisect_left(starts, hi) - 1
        while k >= 0 and ranges[k][1] > lo:  # (the ranges do not overlap: their ends rise with their starts)
            s, e, j = ranges[k]
            k -= 1
            o = rows[j]
            if j == i:
                problems.append(f"{who}: span cells [{lo}, {hi}) inside its own range [{s}, {e})")
            elif s == lo and o[STATE] == LIVE:  # its owner, the donor still in place
                if not o[FLAGS] & LENT:
                    problems.append(f"sequence {o[ID]} lends cells [{lo}, {hi}) to {who} but is not flagged LENT")
                if hi > e:
                    problems.append(f"{who}: span cells [{lo}, {hi}) run past its owner {o[ID]}'s range [{s}, {e})")
            else:
                kind = "sequence" if o[STATE] == LIVE else "the encoder cache of"
                problems.append(f"{who}: span cells [{lo}, {hi}) overlap the range [{s}, {e}) of {kind} {o[ID]}")
    return problems
