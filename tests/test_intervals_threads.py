"""The per-process interval lists (pages reserved and owed: ``_engine/memory/pages.py``) are changed
from several threads of one process: a decode thread's ``room`` (no store lock) beside another
thread's punch or reservation (under it). Each change is atomic: no update is lost."""

from __future__ import annotations

import sys
import threading

from shmkv._engine.memory.intervals import add_interval, covers, take_interval


def test_interval_changes_from_two_threads_lose_nothing() -> None:
    spans: list[tuple[int, int]] = []
    rounds = 3000
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(base: int) -> None:  # its own cells: [base + 4i, base + 4i + 2) added, half taken again
        try:
            start.wait(10)
            for i in range(rounds):
                a = base + 4 * i
                add_interval(spans, a, a + 2)
                if i % 2:
                    take_interval(spans, a, a + 2)
                assert covers(spans, a, a + 2) == (not i % 2)
        except BaseException as e:
            errors.append(e)

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [threading.Thread(target=worker, args=(base,)) for base in (0, 1 << 20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(was)
    assert not errors, errors[0]
    want = sorted((base + 4 * i, base + 4 * i + 2) for base in (0, 1 << 20) for i in range(0, rounds, 2))
    assert spans == want
