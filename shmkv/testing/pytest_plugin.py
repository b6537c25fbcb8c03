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

Leak check (opt-in: ``shmkv_leak_check = true`` in the pytest ini options, or
``@pytest.mark.shmkv_leak_check`` on a test, module or class): a test must
leave no shmkv store behind; one that does fails and names them (they are then
removed). It judges only stores created by this test session's own process
tree (the plugin sets ``SHMKV_PYTEST_SESSION`` in the environment unless it is
inherited, and every store records its creator's value; each pytest-xdist worker
is a session of its own), and of those only the ones that appeared
during the test and whose creator is the test process itself or is dead. It
never touches a store of another process: other programs on the machine, or
a live worker the test left running. Opt a test out with
``@pytest.mark.shmkv_allow_leak``. Disable the whole plugin with ``-p no:shmkv``.
"""

from __future__ import annotations

import gc
import os
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shmkv._engine.clients import liveness as _liveness
from shmkv._engine.memory import segment as _segment
from shmkv.store._lifecycle import SESSION_ENV, Owners, create, session_tag, store_owners
from shmkv.store._removal import origin, remove_if_same
from shmkv.store._store import Store, attach, engine_of
from shmkv.errors import ShmkvError
from shmkv.testing import ChildProcess, shm_entries, unique_name

DEFAULT_LAYOUT: dict[str, Any] = dict(layers=2, kv_heads=2, head_dim=4, dtype="float32", max_tokens=256, max_seqs=8)
_previous_tag = pytest.StashKey[str | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("shmkv_leak_check", type="bool", default=False,
                  help="shmkv: fail tests that leave shmkv stores behind (only stores this session created)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shmkv_allow_leak: do not fail this test for shmkv segments left behind")
    config.addinivalue_line("markers", "shmkv_leak_check: fail this test if it leaves shmkv stores behind")
    # Every process this session starts inherits the tag (set before any forkserver starts).
    # A pytest run inside a test keeps the tag it inherits: it is part of that test's process tree.
    # A pytest-xdist worker runs tests beside the other workers: it takes a tag of its own, so that
    # its leak check never judges (nor removes) a store of another worker's test.
    config.stash[_previous_tag] = previous = os.environ.get(SESSION_ENV)
    if not previous or hasattr(config, "workerinput"):
        os.environ[SESSION_ENV] = secrets.token_hex(8)


def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_previous_tag, None)
    if previous is None:
        os.environ.pop(SESSION_ENV, None)
    else:
        os.environ[SESSION_ENV] = previous


def _judged(name: str, session: int) -> tuple[int, str] | None:
    """(identity, why) if store ``name`` is this test's to judge, else None.

    Ours: created with this session's tag, by this very process or by one that is dead.
    """
    made = origin(name)
    if made is None:
        return None
    tag, identity, pid, key = made
    if not session or tag != session:
        return None
    if key in _liveness.created_keys:
        return identity, "created by the test"
    owners = store_owners(name)  # the creator's liveness is its byte of the liveness file
    if isinstance(owners, Owners) and owners.creator[1] == key and not owners.creator_alive():
        return identity, f"created by process {pid}, now dead"
    return None  # a live process of this session (a worker still running): not ours to remove


def _leak_check_enabled(request: pytest.FixtureRequest) -> bool:
    if request.node.get_closest_marker("shmkv_allow_leak") is not None:
        return False
    return bool(request.node.get_closest_marker("shmkv_leak_check") is not None
                or request.config.getini("shmkv_leak_check"))


@pytest.fixture(autouse=True)
def _shmkv_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    if not _leak_check_enabled(request):
        yield
        return
    # What exists now is frozen out of the collector for the test's duration, so the collection
    # after it walks only the objects the test made (a full one over torch's and transformers'
    # objects costs a tenth of a second, every test); thawed after it, so that garbage the
    # session makes later among those objects is collected as usual.
    gc.freeze()
    before = shm_entries()
    yield
    gc.collect()  # handles dropped by the test close their descriptors now
    gc.unfreeze()
    session = session_tag()
    pre, suf = _segment.PREFIX, ".h"
    leaked = []
    for f in sorted(shm_entries() - before):
        if f.startswith(pre) and f.endswith(suf):
            name = f[len(pre) : -len(suf)]
            judged = _judged(name, session)
            if judged is not None:
                leaked.append(name)
                try:
                    remove_if_same(name, judged[0])
                except ShmkvError:
                    pass
    if leaked:
        pytest.fail(f"test left shmkv stores behind: {leaked} (close or remove the stores it made; "
                    "opt out with @pytest.mark.shmkv_allow_leak)", pytrace=False)

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
    for store in made:  # only the store each handle made: a newer one of that name stays
        name, identity = store.name, engine_of(store).identity
        store.close()
        remove_if_same(name, identity)


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
