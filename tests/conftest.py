"""Our suite uses the shipped pytest plugin (shmkv.pytest_plugin): its leak check
runs after every test, and ``shmkv_store`` / ``shmkv_store_factory`` make stores."""

from __future__ import annotations

import pytest

import shmkv

pytest_plugins = ["pytester"]

START_METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture
def make_store(shmkv_store_factory):
    return shmkv_store_factory


@pytest.fixture
def store(shmkv_store: shmkv.Store) -> shmkv.Store:
    return shmkv_store
