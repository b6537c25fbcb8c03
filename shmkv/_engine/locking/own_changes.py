"""The structural changes this process made to each row of a store, foreign ones excepted
(``Journal.changing``; journal invariant 10 covers those): such a change may write the row's
own cells, committed or rolled back, so a write handle of this process keeps its pending
tokens across someone else's change only while its row's count has not moved since its own
last change (``_sequence/writer.py`` ``addressing_kept``)."""

from __future__ import annotations

changes_here: dict[str, list[int]] = {}  # store name -> a count per table row


def counts_here(name: str, rows: int) -> list[int]:
    """``changes_here[name]``, at least ``rows`` long (grown in place: one list per name here,
    shared by the process's attachments of that store)."""
    counts = changes_here.setdefault(name, [])
    counts.extend([0] * (rows - len(counts)))
    return counts
