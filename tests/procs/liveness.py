"""A shmkv process driven line by line over stdin/stdout (JSON), for tests/test_liveness.py:
started as is, or in a PID namespace of its own (``unshare -p -f --mount-proc``).

Each request is ``{"op": ..., ...}``; each answer ``{"ok": value}`` or ``{"error": class name,
"msg": text}``. The process keeps its attachments and write handles until it is killed or
told to ``exit``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

import numpy as np

import shmkv
from shmkv import cli
from shmkv._engine.locking import lifecycle_lock as _lifecycle_lock
from shmkv.store import _lifecycle

stores: dict[str, shmkv.Store] = {}
handles: dict[tuple[str, int], Any] = {}
paused: dict[str, Any] = {}


def _kv(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((1, n, 1, 2), np.float32), np.full((1, n, 1, 2), 2.0, np.float32)


def handle(req: dict[str, Any]) -> Any:
    op, name = req["op"], req.get("name", "")
    if op == "pid":
        return os.getpid()
    if op == "create":
        stores[name] = shmkv.create(name, layers=1, kv_heads=1, head_dim=2, max_tokens=64, max_seqs=4,
                                    dtype="float32", persistent=req.get("persistent", False))
        return None
    if op == "attach":
        stores[name] = shmkv.attach(name, readonly=req.get("readonly", False))
        return None
    if op == "new_seq":
        seq = stores[name].create_sequence(capacity=8)
        seq.extend(*_kv(2))
        handles[(name, seq.id)] = seq
        return seq.id
    if op == "lease":
        handles[(name, req["id"])] = stores[name].sequence(req["id"], write=True)
        return None
    if op == "clients":
        return stores[name].clients()
    if op == "sequences":
        return [[s.id, s.lease_alive] for s in stores[name].sequences()]
    if op == "ls":  # `shmkv ls --json`, this store's line
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli.main(["ls", "--json"])
        return next(r for r in json.loads(out.getvalue()) if r["name"] == name)
    if op == "collect":  # gc's judgement of this one store (never a global gc in a test)
        with _lifecycle_lock.lifecycle(name):
            return _lifecycle._collect(name, include_persistent=False, grace=30.0)
    if op == "close":
        stores.pop(name).close()
        return None
    if op == "fork_sleeper":  # a forked child that inherits our descriptors and outlives us
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(0)  # leave the test's pipes to the parent
                os.close(1)
                os.write(w, b"x")  # its at-fork hooks have run (shmkv's dropped our liveness descriptor)
                import time

                time.sleep(600)
            finally:
                os._exit(0)
        os.close(w)
        os.read(r, 1)
        os.close(r)
        return pid
    if op == "save_paused":  # a save to req["path"] that stops inside, its temp file written to
        import threading

        go, inside = threading.Event(), threading.Event()
        result: dict[str, Any] = {}

        def progress(done: int, total: int) -> None:
            inside.set()
            go.wait(60)

        def run() -> None:
            try:
                result["ok"] = stores[name].save(req["path"], progress=progress)
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=run)
        t.start()
        inside.wait(60)
        paused[name] = (go, t, result)
        return None
    if op == "save_resume":  # let the paused save finish: its result (bytes, or the error)
        go, t, result = paused.pop(name)
        go.set()
        t.join(60)
        return result
    if op == "exists":
        return name in shmkv.list_stores()
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "exit":
            break
        try:
            answer: dict[str, Any] = {"ok": handle(req)}
        except Exception as e:
            answer = {"error": type(e).__name__, "msg": str(e)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
