from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shmkv
from shmkv.testing import shm_entries, unique_name

START_METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it (segments and lock files)."""
    before = shm_entries()
    yield
    gc.collect()
    leaked = shm_entries() - before
    for f in leaked:  # clean up so one leak does not fail every later test
        try:
            os.unlink(os.path.join("/dev/shm", f))
        except FileNotFoundError:
            pass
    assert not leaked, f"test left shared memory behind: {sorted(leaked)}"


@pytest.fixture
def make_store() -> Iterator[Callable[..., shmkv.Store]]:
    """Factory: make_store(**layout) creates a store with a unique name; removed afterwards."""
    made: list[shmkv.Store] = []

    def factory(**kw: Any) -> shmkv.Store:
        params: dict[str, Any] = dict(layers=2, kv_heads=2, head_dim=4, dtype="float32", max_tokens=256, max_seqs=8)
        params.update(kw)
        name = params.pop("name", None) or unique_name()
        s = shmkv.create(name, **params)
        made.append(s)
        return s

    yield factory
    for s in made:
        name = s.name
        s.close()
        try:
            shmkv.remove(name)
        except shmkv.StoreNotFound:
            pass


@pytest.fixture
def store(make_store: Callable[..., shmkv.Store]) -> shmkv.Store:
    return make_store()
