"""A Ctrl-C at any point of shmkv (or of filelock, which holds the lifecycle lock) where the
interpreter can raise one (tests/_ctrl_c_points.py: a function's first instruction, a call through
C returning, a jump back taken) while a store is created, loaded, attached (read-write or
read-only), closed by its creator or removed leaves nothing of it behind once the program
carries on as it would:

* in /dev/shm: a create or load that raised left nothing (the program has no handle to remove
  it with); one that returned gives a handle whose close() removes everything; a close or a
  remove that raised is tried again and then leaves nothing; a close that raised and is not
  tried again (the program exits: a second Ctrl-C that comes while the first unwinds through a
  ``with`` block) leaves the store to the creator's exit, which removes it;
* in this process: no descriptor of the store's files once its handles are closed, no client
  of an attach that raised or was closed, no hold, handler or deferred Ctrl-C; and the Ctrl-C
  itself came out.

A SIGINT is delivered through the handler installed at that moment (shmkv's defers it inside its
critical sections, as it does a real signal), at the N-th point, for every N of an uninterrupted
run.
"""

from __future__ import annotations

import os

import filelock
import pytest
from _ctrl_c_points import CLEAN, Points, descriptors, lock_path_state, reset_lock_path
from _ctrl_c_scene import retry_after_ctrl_c as _retry

import shmkv
from shmkv.store import _lifecycle, _removal
from shmkv.testing import shm_entries, unique_name

_ROOTS = (os.path.dirname(shmkv.__file__) + os.sep, os.path.dirname(filelock.__file__) + os.sep)
OPS = ("create", "close", "close_then_exit", "remove", "persistent_create", "load", "persistent_load", "attach",
       "attach_readonly", "unlink", "owners")
_ON_A_STORE = ("close", "close_then_exit", "remove", "attach", "attach_readonly", "unlink", "owners")  # made first
_SNAP: dict[str, str] = {}
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _create(name: str, persistent: bool = False) -> shmkv.Store:
    return shmkv.create(name, layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=64, max_seqs=4,
                        persistent=persistent)


def _snapshot() -> str:
    """A snapshot of two sequences (made once), for load."""
    if not _SNAP:
        import atexit
        import tempfile

        import numpy as np

        fd, path = tempfile.mkstemp(suffix=".shmkv")
        os.close(fd)
        atexit.register(os.unlink, path)
        with _create(unique_name("ccs")) as st:
            for n in (5, 9):
                s = st.create_sequence(capacity=16)
                k = np.ones((2, n, 2, 8), np.float32)
                s.extend(k, -k, tokens=np.arange(n))
            st.save(path)
        _SNAP["path"] = path
    return _SNAP["path"]


def _start(op: str, name: str, store: shmkv.Store | None) -> shmkv.Store | None:
    """Run ``op`` (what the trace watches); the store it made, if any."""
    if op == "create":
        return _create(name)
    if op == "persistent_create":
        return _create(name, persistent=True)
    if op in ("load", "persistent_load"):
        return shmkv.load(_snapshot(), name, persistent=op == "persistent_load")
    if op.startswith("attach"):
        return shmkv.attach(name, readonly=op == "attach_readonly")
    assert store is not None
    if op in ("close", "close_then_exit"):
        store.close()
    elif op == "unlink":
        store.unlink()
    elif op == "owners":  # what `shmkv ls`, gc and the pytest plugin read of a store
        _lifecycle.store_owners(name)
    else:
        shmkv.remove(name)
    return store


def _mine(name: str) -> list[str]:
    return sorted(f for f in shm_entries() if f.startswith(f"skv_{name}."))


def _exit(name: str) -> None:
    """What this process's exit does for store ``name`` (and only for it: other tests' stores stay
    registered)."""
    others = {k: v for k, v in _removal.exit_removals.items() if k[0] != name}
    for k in others:
        del _removal.exit_removals[k]
    try:
        _removal._remove_at_exit()
    finally:
        _removal.exit_removals.update(others)


def trial(op: str, point: int) -> tuple[Points, list[str]]:
    """One run of ``op`` interrupted at point ``point`` (0: not at all); its trace (where it
    fired, how many points it saw), and what is left once the program carried on: of the store
    in /dev/shm, and of a Ctrl-C in this process's lock path."""
    name = unique_name("cc")
    store = None
    if op in _ON_A_STORE:
        store = _create(name)
    if op.endswith("load"):
        _snapshot()  # made once, outside the trace
    tr = Points(point, lambda path: path.startswith(_ROOTS))
    box = [store]

    def start() -> None:
        box[0] = _start(op, name, box[0])

    raised = tr.run(start)
    creator, store = (store, box[0] if box[0] is not store else None) if op.startswith("attach") else (None, box[0])
    found: list[str] = []
    try:  # the program carries on
        if op in ("create", "persistent_create", "load", "persistent_load"):
            if store is not None:  # returned: its handle removes it
                if op.startswith("persistent"):
                    _retry(lambda: shmkv.remove(name))
                _retry(store.close)
        elif op in ("close", "owners"):
            assert store is not None
            _retry(store.close)
        elif op == "unlink":
            assert store is not None
            _retry(store.unlink)
        elif op == "close_then_exit":
            _exit(name)
        elif op.startswith("attach"):
            assert creator is not None
            if store is not None:
                _retry(store.close)
            if creator.clients() != [os.getpid()]:  # ours only: the attach's row is gone, or was never made
                found.append(f"live clients {creator.clients()}")
            _retry(creator.close)
        else:
            try:
                _retry(lambda: shmkv.remove(name))
            except shmkv.StoreNotFound:
                pass
            assert store is not None
            _retry(store.close)
        found += _mine(name)
        if op != "close_then_exit":  # (the exit would close them)
            found += [f"open: {path}" for path in descriptors(f"skv_{name}.")]
        state = lock_path_state()
        if state != CLEAN:
            found.append(f"the lock path's state {state}")
            reset_lock_path()  # (for the next trials)
        if tr.fired and not raised:
            found.append("the Ctrl-C was lost")
        return tr, found
    finally:
        left = _mine(name)
        if left:  # whatever the trial found, the machine is left clean
            for f in left:
                try:
                    os.unlink(os.path.join("/dev/shm", f))
                except FileNotFoundError:
                    pass


def points(op: str) -> int:
    """The points of an uninterrupted run of ``op``, which leaves nothing behind either: the
    second run's (the first also does one-time work, imports and caches, that the trials skip)."""
    for _ in range(2):
        tr, left = trial(op, 0)
        assert not left, f"{op}: an uninterrupted run left {left}"
    return tr.count


SAMPLE = 12  # points an operation in the fast tier


def _run(op: str, sample: bool) -> None:
    n = points(op)
    assert n > 10, f"{op}: only {n} points: the trace does not see the operation"
    every = max(1, n // SAMPLE)
    chosen = set(range(1 + every // 2, n + 1, every))  # about SAMPLE, evenly spaced, from mid-stride
    problems = []
    for point in sorted(chosen if sample else set(range(1, n + 1)) - chosen):
        tr, left = trial(op, point)
        if left:
            problems.append(f"{op} point {point}/{n} ({tr.where}): left {left}")
    assert not problems, "\n".join(problems[:30]) + f"\n({len(problems)} of {n} points)"


@pytest.mark.parametrize("op", OPS)
def test_a_ctrl_c_at_a_sample_of_points_of_a_cold_path_leaves_nothing_behind(op: str) -> None:
    _run(op, sample=True)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # (a close's or an unlink's 3,600 points)
@pytest.mark.parametrize("op", OPS)
def test_a_ctrl_c_at_each_remaining_point_of_a_cold_path_leaves_nothing_behind(op: str) -> None:
    """Every point that the sample above does not take."""
    _run(op, sample=False)
