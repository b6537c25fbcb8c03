"""pytest plugin for test suites of multi-process code on shmkv (loaded automatically).

Fixtures:

* ``shmkv_store``: a store with a unique name and a small float32 layout,
  removed after the test even when it failed or a child crashed.
* ``shmkv_store_factory``: ``factory(**create_kwargs)`` makes more stores
  (unique names unless ``name=`` is given), all removed afterwards.
* ``shmkv_child``: ``shmkv_child.run(fn, store, *args, start_method="spawn",
  timeout=60)`` runs ``fn(attached_store, *args)`` in a child process attached
  to ``store`` and returns its result, re-raising the child's exception with
  its traceback; ``shmkv_child.start(...)`` returns the running child. Every
  child is reaped (killed if needed) when the test ends.

Leak check: every test must leave no shmkv segment or lock file in /dev/shm;
one that does fails and names them (they are then removed). Opt out with
``@pytest.mark.shmkv_allow_leak``. Disable the whole plugin with ``-p no:shmkv``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from . import _segment
from ._store import Store, attach, create, remove
from .errors import StoreNotFound
from .testing import ChildProcess, shm_entries, unique_name

DEFAULT_LAYOUT: dict[str, Any] = dict(layers=2, kv_heads=2, head_dim=4, dtype="float32", max_tokens=256, max_seqs=8)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shmkv_allow_leak: do not fail this test for shmkv segments left behind")


@pytest.fixture(autouse=True)
def _shmkv_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    before = shm_entries()
    yield
    gc.collect()  # handles dropped by the test run their finalizers now
    leaked = shm_entries() - before
    if not leaked:
        return
    for f in leaked:
        try:
            os.unlink(os.path.join(_segment.SHM_DIR, f))
        except FileNotFoundError:
            pass
    if request.node.get_closest_marker("shmkv_allow_leak") is None:
        pytest.fail(f"test left shmkv shared memory behind: {sorted(leaked)} "
                    "(close or remove the stores it made; opt out with @pytest.mark.shmkv_allow_leak)",
                    pytrace=False)


@pytest.fixture
def shmkv_store_factory() -> Iterator[Callable[..., Store]]:
    made: list[Store] = []

    def factory(**kw: Any) -> Store:
        params = {**DEFAULT_LAYOUT, **kw}
        name = params.pop("name", None) or unique_name()
        store = create(name, **params)
        made.append(store)
        return store

    yield factory
    for store in made:
        name = store.name
        store.close()
        try:
            remove(name)
        except StoreNotFound:
            pass


@pytest.fixture
def shmkv_store(shmkv_store_factory: Callable[..., Store]) -> Store:
    return shmkv_store_factory()


def _attached(fn: Callable[..., Any], name: str, readonly: bool, *args: Any, **kwargs: Any) -> Any:
    store = attach(name, readonly=readonly)
    try:
        return fn(store, *args, **kwargs)
    finally:
        store.close()


class ChildRunner:
    """Starts functions in child processes attached to a store; reaps them all at the end."""

    def __init__(self) -> None:
        self.children: list[ChildProcess] = []

    def start(self, fn: Callable[..., Any], store: Store | str, *args: Any, start_method: str = "spawn",
              timeout: float = 60.0, readonly: bool = False, **kwargs: Any) -> ChildProcess:
        name = store if isinstance(store, str) else store.name
        child = ChildProcess(_attached, fn, name, readonly, *args, start_method=start_method,
                             timeout=timeout, **kwargs)
        self.children.append(child)
        return child

    def run(self, fn: Callable[..., Any], store: Store | str, *args: Any, start_method: str = "spawn",
            timeout: float = 60.0, readonly: bool = False, **kwargs: Any) -> Any:
        return self.start(fn, store, *args, start_method=start_method, timeout=timeout, readonly=readonly,
                          **kwargs).result()

    def reap(self) -> None:
        for child in self.children:
            child.kill()


@pytest.fixture
def shmkv_child() -> Iterator[ChildRunner]:
    runner = ChildRunner()
    yield runner
    runner.reap()
