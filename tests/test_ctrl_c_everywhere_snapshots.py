"""tests/test_ctrl_c_everywhere.py's every-point trials of save and restore (its fast tier takes
their sample): each has thousands of points (a restore's loop over sequences and arrays, a
save's over chunks), so they have a file of their own, which the suite's workers run beside
the other operations'.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from _ctrl_c_scene import SNAPSHOT_OPS, holders, run_points

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (see there)


@pytest.fixture(scope="module", autouse=True)
def _stop_holders() -> Iterator[None]:
    yield
    holders.stop()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("op", SNAPSHOT_OPS)
def test_a_ctrl_c_at_each_remaining_point_of_a_snapshot_leaves_every_sequence_right(op: str, dtype: str) -> None:
    run_points(op, dtype, sample=False)
