"""Creation, attachment, persistence, removal and gc (DESIGN section 4)."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from _children import create_and_exit
from conftest import START_METHODS

import shmkv
from shmkv.store import _lifecycle
from shmkv._engine import segment as _segment
from shmkv.testing import ChildFailed, run_in_process, unique_name


def _gc_one(name: str) -> bool:
    """gc's judgement of one store (a test never runs a global gc: other programs' stores are not ours)."""
    return _lifecycle._collect(name, include_persistent=False, grace=30.0)


def _exists(name: str) -> bool:
    return os.path.exists(_segment.shm_path(_segment.header_name(name)))


def test_segments_are_private_and_listed(store):
    for seg in (_segment.header_name(store.name), _segment.data_name(store.name)):
        assert stat.S_IMODE(os.stat(_segment.shm_path(seg)).st_mode) == 0o600
    assert store.name in shmkv.list_stores()


def test_group_mode_on_request(make_store):
    s = make_store(mode=0o660)
    assert stat.S_IMODE(os.stat(_segment.shm_path(_segment.header_name(s.name))).st_mode) == 0o660


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_creator_exit(method, how):
    """A non-persistent store goes with its creator's exit; after a SIGKILL, gc removes it."""
    name = unique_name()
    if how == "kill":
        with pytest.raises(ChildFailed):
            run_in_process(create_and_exit, name, False, how, start_method=method, timeout=60)
        assert _exists(name)  # nobody ran the cleanup
        assert _gc_one(name)
    else:
        run_in_process(create_and_exit, name, False, how, start_method=method, timeout=60)
    assert not _exists(name)
    assert not os.path.exists(_segment.lock_path(name))


def test_persistent_store_outlives_creator_until_removed():
    name = unique_name()
    run_in_process(create_and_exit, name, True, "exit", start_method="spawn", timeout=60)
    try:
        assert not _gc_one(name)  # creator is dead but the store is persistent
        s = shmkv.attach(name)
        assert s.persistent and s.sequences()[0].length == 2
        s.close()
        assert _exists(name)
    finally:
        shmkv.remove(name)
    assert not _exists(name)


def test_gc_keeps_live_stores(store):
    assert not _gc_one(store.name)
    assert _exists(store.name)


def test_creator_close_removes_but_views_stay_valid(make_store):
    store = make_store()
    seq = store.create_sequence()
    seq.extend(np.full((2, 2, 2, 4), 3.0), np.full((2, 2, 2, 4), 4.0))
    keys = seq.keys(1)
    store.close()
    assert not _exists(store.name)
    # the view keeps its pages mapped: reading it is safe, not a segfault
    np.testing.assert_array_equal(keys, np.full((2, 2, 4), 3.0))
    with pytest.raises(shmkv.StoreClosedError):
        seq.keys(1)


def test_forked_child_does_not_remove_parent_store(store):
    seq = store.create_sequence()
    seq.extend(np.ones((2, 1, 2, 4)), np.ones((2, 1, 2, 4)))

    pid = os.fork()
    if pid == 0:  # child: use the inherited handle, then exit normally (atexit runs)
        code = 0
        try:
            try:
                seq.append(0, np.zeros((2, 4)), np.zeros((2, 4)))
                code = 3  # an inherited write handle must not write
            except shmkv.LeaseError:
                pass
            store.close()
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _exists(store.name)
    assert seq.length == 1


def test_store_pickles_by_name(store):
    seq = store.create_sequence()
    seq.extend(np.ones((2, 1, 2, 4)), np.ones((2, 1, 2, 4)))
    again = run_in_process(_length_via_pickle, store, seq.id, start_method="spawn", timeout=60)
    assert again == 1


def _length_via_pickle(store: shmkv.Store, seq_id: int) -> int:
    n = store.sequence(seq_id).length
    store.close()
    return n
