"""Regression tests for what an attack found in shared prefix pages (issue 23, atk2 findings
in the lead's notes: one test per finding, named by its number)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import shmkv
from shmkv.store._store import engine_of

L, H, D = 3, 4, 64


def _store(make_store, **kw):
    args = dict(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=16384, max_seqs=32)
    args.update(kw)
    return make_store(**args)


def _donor(store, n=300, capacity=1024, first=1000, finish=True):
    prompt = np.arange(first, first + n)
    d = store.create_sequence(capacity=capacity, prefix=prompt)
    rng = np.random.default_rng(n)
    shape = (store.layout.layers, n - len(d), store.layout.kv_heads, store.layout.head_dim)
    d.extend(rng.standard_normal(shape), rng.standard_normal(shape), tokens=prompt[len(d):])
    if finish:
        d.finish()
    return d, prompt


def _reap(pid: int, timeout: float = 20.0) -> int | None:
    """The child's exit code, or None when it did not end in ``timeout`` (then it is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_06_fork_while_a_thread_holds_the_span_lock(make_store):
    """A child forked while another thread is inside Shares.sync/apply (holding the span lock)
    reads after the span epoch moved: it gets a fresh lock, not the held copy."""
    st = _store(make_store)
    d, p = _donor(st)
    want = np.asarray(d.keys(0)).copy()
    reader = shmkv.attach(st.name, readonly=True)
    try:
        reader.sequence(d.id).keys(0)
        st.create_sequence(capacity=1024, prefix=np.r_[p, [1]])  # the span epoch moves
        inside, leave = threading.Event(), threading.Event()

        def syncing() -> None:
            with engine_of(reader).shares.lock:  # where a thread is during sync/apply
                inside.set()
                leave.wait(30)

        t = threading.Thread(target=syncing)
        t.start()
        try:
            assert inside.wait(10)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    code = 0 if np.array_equal(np.asarray(reader.sequence(d.id).keys(0)), want) else 2
                finally:
                    os._exit(code)
        finally:
            leave.set()
            t.join()
        assert _reap(pid) == 0
    finally:
        reader.close()
