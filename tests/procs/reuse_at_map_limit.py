"""Child-process side of tests/test_sharing_map_limits.py (module level, so a spawned child can
import it): a process whose own memory mappings fill ``vm.max_map_count`` reuses a cached prefix."""

from __future__ import annotations

from typing import Any

import numpy as np
from procs.map_filler import Filler, content, free_mappings, refused

import shmkv
from shmkv._engine.table.header import SPAN_CELLS
from shmkv.store._store import engine_of


def reuse_at_the_limit(name: str, prompt: list[int], donor_id: int) -> dict[str, Any]:
    """Attach ``name``, map what is there, fill this process's mappings but 4 (a span of 6 arrays
    needs 12), then reuse the donor's prefix (``create_sequence(prefix=)``) and fork the donor:
    what each gave (lengths, digests, spans), with the mappings still full."""
    store = shmkv.attach(name)
    for info in store.sequences():  # what is there now mapped (before the filling)
        store.sequence(info.id).keys(0)  # (a read maps its span; opening a read handle does not)
    eng = engine_of(store)
    filler = Filler()
    out: dict[str, Any] = {}
    try:
        filler.fill(slack=2)
        s = store.create_sequence(capacity=1024, prefix=np.asarray(prompt))
        f = store.sequence(donor_id).fork()
        out["reuse"] = (s.id, len(s), content(store, s.id))
        out["fork"] = (f.id, len(f), content(store, f.id))
        out["spans"] = [int(eng.table_np[eng.slot_of(x.id), SPAN_CELLS]) for x in (s, f)]
        out["unmapped"] = sorted(eng.shares.unmapped)
        out["shared_tokens"] = store.stats().shared_tokens
        s.release()
        f.release()
    finally:
        filler.release()
    store.close()
    return out


def put_back_with_free(name: str, free: int, prompt: list[int], got: Any, ready: Any) -> dict[str, Any]:
    """Attach ``name``, map what is there, leave exactly ``free`` mappings free, reuse the
    prompt's prefix (the span refused: a copy), tell the parent (``ready``), get a borrower's id
    (created meanwhile by the parent: its span cannot be mapped here) from ``got``, read it
    (refused), copy its prefix into a new sequence. What each did, and this process's mappings
    after each: free, rows left ``dirty`` (their own pages not put back) and ``unmapped``."""
    store = shmkv.attach(name)
    for info in store.sequences():
        store.sequence(info.id).keys(0)  # (a read maps its span; opening a read handle does not)
    eng = engine_of(store)
    sh = eng.shares
    filler = Filler()
    out: dict[str, Any] = {}

    def after() -> dict[str, Any]:
        return {"over": free_mappings() < 0, "dirty": sorted(sh.dirty), "unmapped": sorted(sh.unmapped)}

    try:
        filler.leave(free)
        try:
            s = store.create_sequence(capacity=1024, prefix=np.asarray(prompt))
            out["reuse"] = (s.id, len(s), content(store, s.id), int(eng.table_np[eng.slot_of(s.id), SPAN_CELLS]))
        except Exception as err:
            out["reuse"] = f"{type(err).__name__}: {err}"
        out["after_reuse"] = after()
        ready.set()
        b = store.sequence(got.get(timeout=60))
        out["read"] = refused(lambda: b.keys(0))
        out["after_read"] = after()
        try:
            dst = store.create_sequence(capacity=1024, prefix=[999_999])
            store.copy_prefix(b.id, dst.id, len(b) - 3)
            out["copy"] = (dst.id, np.array(dst.keys(0)))
        except Exception as err:
            out["copy"] = f"{type(err).__name__}: {err}"
        out["after_copy"] = after()
    finally:
        filler.release()
    store.close()
    return out


def die_in_the_fallback(name: str, prompt: list[int]) -> None:
    """Attach ``name`` with span mappings refused (ENOMEM, as at vm.max_map_count), reuse the
    prompt's prefix, and be SIGKILLed right after the fallback copied the span (the create's
    transaction still open)."""
    import ctypes
    import errno
    import os
    import signal

    from shmkv._engine.spans import mappings as share
    from shmkv._engine.spans.lending import Sharing

    store = shmkv.attach(name)
    sh = engine_of(store).shares
    real_mmap, real_copy = share.libc_mmap, Sharing._copy_span

    def mmap(*args: Any) -> Any:
        if args[3] & share.MAP_ANONYMOUS:  # the spare's page (Spare): not a cell's mapping
            return real_mmap(*args)
        if args[5] != args[0] - sh.base:  # a span (another cell's pages): refused
            ctypes.set_errno(errno.ENOMEM)
            return share.MAP_FAILED
        return real_mmap(*args)

    def copy_then_die(self: Sharing, start: int, src: int, m: int) -> None:
        real_copy(self, start, src, m)
        os.kill(os.getpid(), signal.SIGKILL)

    share.libc_mmap = mmap
    Sharing._copy_span = copy_then_die  # type: ignore[method-assign]
    store.create_sequence(capacity=1024, prefix=np.asarray(prompt))
    raise AssertionError("the fallback never ran")
