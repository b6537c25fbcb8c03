"""Child-process side of tests/test_sharing_map_limits.py (module level, so a spawned
child can import it): a process whose own memory mappings fill ``vm.max_map_count``."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

import shmkv
from shmkv._engine.spans import mappings as share
from shmkv.store._store import engine_of

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


class Filler:
    """Memory mappings of this process's own (no memory: PROT_NONE address space with single
    pages made readable, each one splitting it), made until the kernel refuses one more."""

    PAGES = 1 << 18  # 1 GiB of address space: up to 2 x 131,072 mappings, more than the limit

    def __init__(self) -> None:
        addr = _libc.mmap(None, self.PAGES * PAGE, 0, 0x02 | 0x20 | 0x4000, -1, 0)  # PRIVATE|ANON|NORESERVE
        assert addr not in (None, ctypes.c_void_p(-1).value)
        self.addr: int = addr
        self.split: list[int] = []

    def fill(self, slack: int) -> None:
        """Split until the kernel refuses (at vm.max_map_count), then merge ``slack`` back (each
        frees two mappings)."""
        i = 1
        while i < self.PAGES and _libc.mprotect(self.addr + i * PAGE, PAGE, 1) == 0:
            self.split.append(i)
            i += 2
        assert i < self.PAGES, "vm.max_map_count is larger than this filler covers"
        for _ in range(slack):
            _libc.mprotect(self.addr + self.split.pop() * PAGE, PAGE, 0)

    def leave(self, free: int) -> None:
        """Fill, then give back mappings until exactly ``free`` are left (``free_mappings``):
        merges give back two each; one more taken by splitting the last page off the range."""
        self.fill(slack=0)
        while free_mappings() < free:
            _libc.mprotect(self.addr + self.split.pop() * PAGE, PAGE, 0)
        if free_mappings() > free:
            _libc.mprotect(self.addr + (self.PAGES - 1) * PAGE, PAGE, 1)
        assert free_mappings() == free

    def release(self) -> None:
        _libc.munmap(self.addr, self.PAGES * PAGE)
        self.split = []


def map_count() -> int:
    """This process's memory mappings now (lines of /proc/self/maps)."""
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def free_mappings() -> int:
    """How many more mappings the kernel lets this process make (-1: one over vm.max_map_count;
    [vsyscall], listed in /proc/self/maps, is not one of its mappings)."""
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
        return limit - sum(1 for line in f if not line.rstrip().endswith(b"[vsyscall]"))


def digest(*arrays: Any) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()


def content(store: Any, seq_id: int) -> str:
    seq = store.sequence(seq_id)
    lay = store.layout
    return digest(*[a for i in range(lay.layers) for a in seq.kv(i)])


def refused(fn: Callable[[], Any]) -> str:
    """'refused' if ``fn()`` raises ShareError naming the limit and the fix; else what it did."""
    try:
        out = fn()
    except share.ShareError as err:
        msg = str(err)
        ok = isinstance(err, shmkv.ShmkvError) and isinstance(err, OSError)
        ok = ok and "vm.max_map_count" in msg and "SHMKV_SHARE=0" in msg
        return "refused" if ok else f"ShareError without the fix: {msg}"
    except BaseException as err:
        return f"{type(err).__name__}: {err}"
    arrs = out if isinstance(out, tuple) else (out,)
    zeros = any(np.asarray(a).size and not np.asarray(a).any() for a in arrs if hasattr(a, "shape"))
    return f"returned {'zeros' if zeros else 'data'}"


def near_the_limit(name: str, readonly: bool, path: str, got: Any, ready: Any) -> dict[str, Any]:
    """Attach ``name``, fill this process's mappings but a few, tell the parent (``ready``),
    get the ids (donor, other row, borrower mapped before, new borrower) from ``got``, and try
    every read path: of the new borrower (its span cannot be mapped here) and of the others.
    Then free the mappings and read the borrower again. Returns what each path did (and the
    mappings this process held after each: ``maps``), and digests."""
    import torch  # (imported before the filling: loading a library takes mappings)

    store = shmkv.attach(name, readonly=readonly)
    lay = store.layout
    for info in store.sequences():  # what is there now mapped (a read-only attachment maps at a read)
        store.sequence(info.id).keys(0)  # (a read maps its span; opening a read handle does not)
    filler = Filler()
    out: dict[str, Any] = {}
    try:
        filler.fill(slack=2)  # 4 mappings free: a span of 6 arrays needs 12
        ready.set()
        d_id, c_id, b0_id, b_id = got.get(timeout=60)
        out["others"] = {i: content(store, i) for i in (d_id, c_id, b0_id)}
        eng = engine_of(store)
        out["unmapped"] = sorted(eng.shares.unmapped)
        b = store.sequence(b_id)
        k1 = np.ones((1, lay.kv_heads, lay.head_dim), np.float32)
        paths: dict[str, Callable[[], Any]] = {
            "keys": lambda: b.keys(0),
            "values": lambda: b.values(1),
            "kv": lambda: b.kv(2),
            "read": lambda: b.read(0),
            "raw_keys": lambda: b.raw_keys(1)[0],
            "iter_tokens": lambda: next(b.iter_tokens(0))[2],
            "head": lambda: b.head(0, 1),
            "torch_kv": lambda: tuple(t.numpy() for t in b.torch_kv(0)),
            "batch_kv": lambda: store.batch_kv([b], 1),
            "save": lambda: store.save(path, seq_ids=[b_id]),
            "save_all": lambda: store.save(path),
        }
        if not readonly:
            def append() -> Any:
                w = store.sequence(b_id, write=True)
                try:
                    return w.append(0, k1, k1)
                finally:
                    w.release()

            def batch() -> Any:
                with store.forward([b_id], [len(b)]) as fw:
                    return fw.put(0, k1, k1)[0]

            def reuse(sharing: bool) -> Any:
                was, share.ENABLED = share.ENABLED, sharing
                try:
                    s = store.create_sequence(capacity=1024, prefix=np.r_[np.asarray(b.tokens), [9]])
                    try:
                        copies[f"reuse_{sharing}"] = np.array(s.keys(0))
                        return copies[f"reuse_{sharing}"]
                    finally:
                        s.free()
                finally:
                    share.ENABLED = was

            def copy_prefix(sharing: bool) -> Any:
                was, share.ENABLED = share.ENABLED, sharing
                dst = store.create_sequence(capacity=1024, prefix=[999_999])  # (a miss: on a page unit)
                try:
                    store.copy_prefix(b_id, dst.id, len(b) - 3)
                    copies[f"copy_prefix_{sharing}"] = np.array(dst.keys(0))
                    return copies[f"copy_prefix_{sharing}"]
                finally:
                    share.ENABLED = was
                    dst.free()

            def with_lease(fn: Callable[[Any], Any]) -> Callable[[], Any]:
                def run() -> Any:
                    w = store.sequence(b_id, write=True)
                    try:
                        return fn(w)
                    finally:
                        w.release()
                return run

            paths["batch_kv_pending"] = with_lease(lambda w: store.batch_kv([w], 0, pending=True))
            paths["torch_kv_pending"] = with_lease(lambda w: w.torch_kv(0, pending=True)[0].numpy())
            def fork(w: Any) -> Any:
                f = w.fork()
                try:
                    copies["fork"] = np.array(f.keys(0))
                    return copies["fork"]
                finally:
                    f.free()

            paths["fork"] = with_lease(fork)

            paths.update({"append": append, "forward": batch, "reuse_shared": lambda: reuse(True),
                          "reuse_copied": lambda: reuse(False), "copy_prefix_shared": lambda: copy_prefix(True),
                          "copy_prefix_copied": lambda: copy_prefix(False)})
        copies: dict[str, np.ndarray] = {}
        out["paths"], out["maps"] = {}, {"start": map_count()}
        for what, fn in paths.items():
            out["paths"][what] = refused(fn)
            out["maps"][what] = map_count()
        out["copies"] = copies
        out["still_unmapped"] = sorted(eng.shares.unmapped)
        out["torch"] = torch.__name__
    finally:
        filler.release()
    out["after"] = content(store, b_id)
    out["after_batch_kv"] = digest(*store.batch_kv([store.sequence(b_id)], 1))
    out["after_unmapped"] = sorted(engine_of(store).shares.unmapped)
    store.save(path, seq_ids=[b_id])
    if not readonly:
        s = store.create_sequence(capacity=1024, prefix=np.r_[np.asarray(store.sequence(b_id).tokens), [9]])
        out["reused"] = (len(s), content(store, s.id))
        s.free()
    store.close()
    return out
