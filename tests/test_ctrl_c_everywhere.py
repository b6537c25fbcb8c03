"""A Ctrl-C at any function entry of shmkv, in a process that survives it, leaves no wrong data
and no stuck handle.

For each public operation, in float32 (a one-cell page unit) and int8 (a 32-cell one: prefixes
really share pages), a SIGINT is delivered through the installed handler at each Python function
entry inside shmkv during the operation (shmkv's handler defers it inside critical sections, as
it does a real signal). The process then carries on with the handles it holds: three decode
steps each. Every sequence is checked in this attachment and in a fresh read-only one: each
cell's K/V match the token id at its position, sequences the operation does not touch are
unchanged, touched ones hold their old or their new state, and every handle that holds a lease
can decode (tests/_ctrl_c_scene.py builds the scene and runs the trials).

The fast tier takes every fifth point of each operation (fewer on long ones: about 40 at most);
the slow tier takes them all.
"""

from __future__ import annotations

import pytest

from _ctrl_c_scene import OPS, expected, points, trial

DTYPES = ["float32", "int8"]
# A Ctrl-C that lands in a finalizer (a generator closed by the garbage collector) is printed and
# ignored by Python, as a real one is: what is checked is that the store and the handles are right.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _run(op: str, dtype: str, every: int) -> None:
    before, after = expected(op, dtype)
    n = points(op, dtype)
    assert n > 10, f"{op}: only {n} call events inside shmkv: the trace does not see the operation"
    if every > 1:  # the fast tier: at most about 40 points an operation
        every = max(every, n // 40)
    problems: list[str] = []
    for point in range(1 + (n // 2) % every, n + 1, every):
        problems += trial(op, dtype, point, before, after)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_a_ctrl_c_at_every_fifth_function_entry_leaves_every_sequence_right(op: str, dtype: str) -> None:
    _run(op, dtype, every=5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_a_ctrl_c_at_every_function_entry_leaves_every_sequence_right(op: str, dtype: str) -> None:
    _run(op, dtype, every=1)
