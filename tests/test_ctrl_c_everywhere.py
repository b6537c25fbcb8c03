"""A Ctrl-C at any point of shmkv's code where the interpreter can raise one, in a process that
survives it, leaves no wrong data, no stuck handle and nothing open.

For each public operation, in float32 (a one-cell page unit) and int8 (a 32-cell one: prefixes
really share pages), a SIGINT is delivered through the installed handler at each such point
inside shmkv during the operation (tests/_ctrl_c_points.py: a function's first instruction, a
call through C returning, a jump back taken; shmkv's handler defers it inside critical sections,
as it does a real signal). The process then carries on with the handles it holds: three decode
steps each. Every sequence is checked in this attachment and in a fresh read-only one: each
cell's K/V match the token id at its position, sequences the operation does not touch are
unchanged, touched ones hold their old or their new state, and every handle that holds a lease
can decode; once the handles are closed, no descriptor of the store or the snapshot is open and
no save left a temporary file (tests/_ctrl_c_scene.py builds the scene and runs the trials).

The fast tier takes a sample of each operation's points (about a dozen, spread over the whole
operation); the slow tier takes all the others, so that the two together take every point once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from _ctrl_c_scene import OPS, SNAPSHOT_OPS, holders, run_points

DTYPES = ["float32", "int8"]
# A Ctrl-C that lands in a finalizer (a generator closed by the garbage collector) is printed and
# ignored by Python, as a real one is: what is checked is that the store and the handles are right.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module", autouse=True)
def _stop_holders() -> Iterator[None]:
    yield
    holders.stop()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_a_ctrl_c_at_a_sample_of_points_leaves_every_sequence_right(op: str, dtype: str) -> None:
    run_points(op, dtype, sample=True)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [op for op in OPS if op not in SNAPSHOT_OPS])
def test_a_ctrl_c_at_each_remaining_point_leaves_every_sequence_right(op: str, dtype: str) -> None:
    """Every point that the sample above does not take (save and restore: in
    tests/test_ctrl_c_everywhere_snapshots.py, a file of their own so that they run beside these)."""
    run_points(op, dtype, sample=False)
