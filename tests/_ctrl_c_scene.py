"""A Ctrl-C at every point of shmkv's code where the interpreter can raise one, during one
operation, the process carrying on.

``trial(op, dtype, point)`` builds a scene (a finished donor, a borrower of its prompt, a plain
sequence, a small target sequence, a sequence whose leaseholder died), runs ``op`` under a trace
that, at the ``point``-th such point inside shmkv (``_ctrl_c_points``: a function's first
instruction, a call through C returning, a jump back), calls the SIGINT handler installed at
that moment (shmkv's own defers the signal inside its critical sections, as a real signal is),
then carries on as a surviving REPL would: three decode steps through every handle it holds
(a step interrupted by a deferred Ctrl-C is tried again), then checks every sequence in this
attachment and in a fresh read-only one. ``points(op, dtype)`` counts the points of an
uninterrupted run. Every value is ``K = 4 * token + layer`` (``V = -K``), so any cell of any
sequence can be checked against its own token id.

Used by tests/test_ctrl_c_everywhere.py (and its _snapshots twin); usable by hand:
``python tests/_ctrl_c_scene.py truncate_borrower int8`` runs every point of one operation.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import shmkv
from shmkv.testing import assert_store_state, unique_name

from _ctrl_c_points import Points, descriptors

L, H, D = 2, 32, 32  # float32: a 4 KiB cell, one-cell page unit; int8: a 32-cell page unit
PROMPT = list(range(1, 97))  # the donor's prompt: three int8 page units

OPS = ("decode", "decode_moved", "extend", "extend_grow", "truncate_plain", "truncate_borrower", "copy_prefix",
       "copy_into_borrower", "fork", "free", "free_borrower", "create_prefix", "finish", "take_over", "restore", "save")


def retry_after_ctrl_c(fn: Callable[[], Any]) -> Any:
    """What a program does after a Ctrl-C it caught: the call again (a Ctrl-C deferred by a critical
    section may still come out of the first retry)."""
    for attempt in range(3):
        try:
            return fn()
        except KeyboardInterrupt:
            if attempt == 2:
                raise
    return None


def kv(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """K and V of ``tokens`` for every layer: [L, n, H, D] (read-only: made once a token list)."""
    return _kv(tuple(tokens))


@functools.lru_cache(maxsize=256)
def _kv(tokens: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(tokens, dtype=np.float32)
    k = np.empty((L, len(t), H, D), np.float32)
    for layer in range(L):
        k[layer] = (4 * t + layer)[:, None, None]
    v = -k
    k.flags.writeable = v.flags.writeable = False
    return k, v


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Every element of ``a`` within 1e-5 of ``b``'s, relatively: ``np.allclose(a, b, rtol=1e-5,
    atol=0)`` for finite ``b``, without its general cases (a check runs for every layer of every
    sequence, thousands of times a test)."""
    return bool((np.abs(a - b) <= 1e-5 * np.abs(b)).all())


def problems_of(store: shmkv.Store, where: str) -> tuple[dict[int, list[int]], list[str]]:
    """Every sequence's token ids, and every cell whose K/V does not match its token id."""
    found: dict[int, list[int]] = {}
    bad: list[str] = []
    for info in store.sequences():
        try:
            s = store.sequence(info.id)
            toks = [int(x) for x in np.asarray(s.tokens)]
            want_k, want_v = kv(toks)
            for layer in range(L):
                k, v = s.kv(layer)
                k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
                if k.shape != want_k[layer].shape or not (_close(k, want_k[layer]) and _close(v, want_v[layer])):
                    rows = [i for i in range(min(len(k), len(toks))) if not _close(k[i], want_k[layer][i])]
                    bad.append(f"{where}: sequence {info.id} layer {layer}: cells {rows[:6]} do not hold "
                               f"their tokens' keys (tokens {toks[:4]}..{len(toks)}, shape {k.shape})")
                    break
            found[info.id] = toks
        except shmkv.SequenceNotFound:
            continue
    return found, bad


@dataclass
class Scene:
    store: shmkv.Store
    handles: dict[str, Any]  # the write handles this process holds, by role
    ids: dict[str, int]
    snap: str
    tmp: tempfile.TemporaryDirectory[str]
    results: list[Any] = field(default_factory=list)  # what the operation returned (new handles)

    def close(self) -> None:
        self.store.close()
        self.tmp.cleanup()


_HOLDER = r"""
import os
import sys

import shmkv


def ready():  # a child forked ahead of its request (the fork is off the test's path): it reads
    # "store-name sequence-id" from its pipe, takes that lease and dies holding it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        code = 1
        try:
            line = os.read(r, 4096).decode()
            if line:
                name, seq_id = line.split()
                shmkv.attach(name).sequence(int(seq_id), write=True)
                code = 0
        finally:
            os._exit(code)
    os.close(r)
    return pid, w


child = ready()
for line in sys.stdin:
    pid, w = child
    os.write(w, line.encode())
    os.close(w)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
    child = ready()
pid, w = child
os.close(w)  # the waiting child reads nothing and exits
os.waitpid(pid, 0)
"""


class _Holders:
    """A small process (shmkv and numpy imported, nothing else) that forks the leaseholders that
    die: a fork of this one costs half of what a fork of a test process that imported torch does,
    and it forks the next one while the test runs its trial."""

    proc: subprocess.Popen[str] | None = None

    def died_holding(self, store: shmkv.Store, seq_id: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            root = os.path.dirname(os.path.dirname(shmkv.__file__))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{store.name} {seq_id}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "0", "the leaseholder did not take its lease"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()
            try:
                proc.wait(10)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()


holders = _Holders()  # stopped by the tests' module fixture, or at exit
atexit.register(holders.stop)


SNAPSHOT_OPS = ("restore", "save")  # the ops that restore the scene's snapshot or save over it
_SNAPSHOTS: dict[tuple[str, str], str] = {}  # (dtype, op) -> the scene's snapshot, saved once


def _link_snapshot(st: shmkv.Store, dtype: str, op: str, path: str) -> None:
    """The scene's snapshot at ``path``: saved once for ``dtype`` and ``op`` (every scene holds the
    same sequences), a hard link to that file afterwards (a save over ``path`` replaces the link)."""
    saved = _SNAPSHOTS.get((dtype, op))
    if saved is None:
        keep = tempfile.mkdtemp(prefix="shmkv-ctrlc-snap-")
        atexit.register(shutil.rmtree, keep, True)
        saved = os.path.join(keep, "scene.shmkv")
        st.save(saved)
        _SNAPSHOTS[(dtype, op)] = saved
    try:
        os.link(saved, path)
    except OSError:  # (another file system)
        shutil.copyfile(saved, path)


def scene(dtype: str, op: str) -> Scene:
    """The store, its sequences and handles that ``op`` runs on (and its snapshot, when ``op``
    restores it or saves over it)."""
    st = shmkv.create(unique_name("ctrlc"), layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=4096,
                      max_seqs=16)
    tmp = tempfile.TemporaryDirectory(prefix="shmkv-ctrlc-")
    try:
        donor = st.create_sequence(capacity=256, prefix=PROMPT)
        donor.extend(*kv(PROMPT), tokens=PROMPT)
        donor.finish()
        a = st.create_sequence(capacity=256, prefix=[*PROMPT[:80], 500])  # borrows the donor's first cells
        own = [500, *range(6000, 6019)]
        a.extend(*kv(own[len(a) - 80:]), tokens=own[len(a) - 80:])
        p = st.create_sequence(capacity=64)
        p.extend(*kv(list(range(3000, 3040))), tokens=list(range(3000, 3040)))
        b = st.create_sequence(capacity=64)
        b.extend(*kv(list(range(7000, 7010))), tokens=list(range(7000, 7010)))
        orphan = st.create_sequence(capacity=64)
        orphan.extend(*kv(list(range(8000, 8012))), tokens=list(range(8000, 8012)))
        orphan.release()
        holders.died_holding(st, orphan.id)
        snap = os.path.join(tmp.name, "scene.shmkv")
        if op in SNAPSHOT_OPS:
            _link_snapshot(st, dtype, op, snap)
        return Scene(st, {"a": a, "p": p, "b": b}, {"donor": donor.id, "a": a.id, "p": p.id, "b": b.id,
                                                    "orphan": orphan.id}, snap, tmp)
    except BaseException:
        st.close()
        tmp.cleanup()
        raise


def prepare(sc: Scene, op: str) -> None:
    """What happens before ``op``, untraced."""
    if op == "decode_moved":  # another handle's change moved b; a newcomer takes b's old cells
        st = sc.store
        st.copy_prefix(sc.ids["a"], sc.ids["b"], 30)
        c = st.create_sequence(capacity=64)
        c.extend(*kv(list(range(11000, 11010))), tokens=list(range(11000, 11010)))
        sc.handles["c"] = c


def run_op(sc: Scene, op: str) -> None:
    st, h = sc.store, sc.handles
    a, p = h["a"], h["p"]
    if op in ("decode", "decode_moved"):  # one token on every layer, then commit
        s = a if op == "decode" else h["b"]  # (b: its handle first re-reads its row)
        k, v = kv([9000])
        for layer in range(L):
            s.append(layer, k[layer, 0], v[layer, 0])
        s.commit(tokens=[9000])
    elif op == "extend":
        a.extend(*kv(list(range(9100, 9110))), tokens=list(range(9100, 9110)))
    elif op == "extend_grow":  # past the capacity: the sequence moves to a larger range
        p.extend(*kv(list(range(9200, 9240))), tokens=list(range(9200, 9240)))
    elif op == "truncate_plain":
        p.truncate(20)
    elif op == "truncate_borrower":  # inside its borrowed span
        a.truncate(40)
    elif op == "copy_prefix":
        st.copy_prefix(a.id, h["b"].id, 50)
    elif op == "copy_into_borrower":  # the borrower's content replaced: its span goes back
        st.copy_prefix(p.id, a.id, 30)
    elif op == "fork":
        sc.results.append(a.fork(70))
    elif op == "free":
        p.free()
    elif op == "free_borrower":  # its borrowed span released (the donor's lent cells stay the donor's)
        a.free()
    elif op == "create_prefix":
        sc.results.append(st.create_sequence(capacity=128, prefix=[*PROMPT[:90], 1]))
    elif op == "finish":
        a.finish()
    elif op == "take_over":
        sc.results.append(st.sequence(sc.ids["orphan"], write=True))
    elif op == "restore":
        st.restore(sc.snap)
    elif op == "save":
        st.save(sc.snap)
    else:
        raise ValueError(op)


def points(op: str, dtype: str) -> int:
    """The points inside shmkv (``_ctrl_c_points``) of an uninterrupted run of ``op``."""
    sc = scene(dtype, op)
    try:
        prepare(sc, op)
        tr = Points()
        assert not tr.run(lambda: run_op(sc, op))
        return tr.count
    finally:
        sc.close()


def _step(h: Any, token: int) -> None:
    k, v = kv([token])
    for layer in range(L):
        h.append(layer, k[layer, 0], v[layer, 0])
    h.commit(tokens=[token])


SAMPLE = 12  # points an operation in the fast tier


def run_points(op: str, dtype: str, sample: bool) -> None:
    """Trials of ``op`` at about SAMPLE of its points, evenly spaced from mid-stride (``sample``),
    or at every other point: the two together take every point once. Fails naming the problems."""
    before, after = expected(op, dtype)
    n = points(op, dtype)
    assert n > 10, f"{op}: only {n} points inside shmkv: the trace does not see the operation"
    every = max(1, n // SAMPLE)
    taken = set(range(1 + every // 2, n + 1, every))
    problems: list[str] = []
    for point in sorted(taken if sample else set(range(1, n + 1)) - taken):
        problems += trial(op, dtype, point, before, after)
    assert not problems, "\n".join(problems[:20])


def trial(op: str, dtype: str, point: int, before: dict[int, list[int]] | None = None,
          after: dict[int, list[int]] | None = None) -> list[str]:
    """One interrupted run; the problems found (empty: none). ``before``/``after``: the token ids
    of every sequence in the scene and after an uninterrupted run (``expected``). Once the scene's
    handles are closed and dropped, nothing of its store or snapshot is open in this process
    (a mapping keeps a descriptor of its own: while a view lives, that one stays)."""
    names: list[str] = []  # the scene's store and snapshot directory
    out = _trial(op, dtype, point, before, after=after, names=names)
    out += [f"{op}/{dtype} point {point}: still open: {path}"
            for path in descriptors(f"skv_{names[0]}.", names[1])] if names else []
    return out


def _trial(op: str, dtype: str, point: int, before: dict[int, list[int]] | None, *,
           after: dict[int, list[int]] | None, names: list[str]) -> list[str]:
    sc = scene(dtype, op)
    names += [sc.store.name, sc.tmp.name]
    out: list[str] = []
    try:
        prepare(sc, op)
        tr = Points(point)
        interrupted = tr.run(lambda: run_op(sc, op))
        tag = f"{op}/{dtype} point {point} ({tr.where or 'not fired'}{', raised' if interrupted else ''})"
        # the process carries on: three decode steps through every handle it holds
        held = dict(sc.handles)
        for i, r in enumerate(sc.results):
            held[f"new{i}"] = r
        if interrupted:  # what a program does after a Ctrl-C between a step's calls: drop the step
            for h in held.values():
                _discard(h)
        next_token = 20000
        for role, h in held.items():
            for _ in range(3):
                for attempt in range(3):  # a Ctrl-C deferred by a critical section is raised later
                    next_token += 1
                    try:
                        _step(h, next_token)
                        break
                    except KeyboardInterrupt:
                        _discard(h)
                        if attempt == 2:
                            out.append(f"{tag}: {role}: a Ctrl-C on every try")
                    except (shmkv.SequenceNotFound, shmkv.LeaseError, shmkv.ReadOnlyError) as e:
                        if not _may_lose(op, role, sc, h):
                            out.append(f"{tag}: {role} cannot decode: {type(e).__name__}: {e}")
                        break
                    except shmkv.ShmkvError as e:
                        out.append(f"{tag}: {role} cannot decode: {type(e).__name__}: {e}")
                        break
                else:
                    continue
                if out:
                    break
        from shmkv._engine.locking import interrupts
        interrupts.deferred.clear()
        try:
            assert_store_state(sc.store)
        except AssertionError as e:
            out.append(f"{tag}: {e}")
        seen, bad = problems_of(sc.store, tag)
        out += bad
        ro = shmkv.attach(sc.store.name, readonly=True)
        try:
            seen_ro, bad_ro = problems_of(ro, tag + " (read-only attachment)")
            out += bad_ro
            if seen_ro != seen:
                out.append(f"{tag}: a fresh read-only attachment sees other sequences: "
                           f"{sorted(seen_ro)} vs {sorted(seen)}")
        finally:
            ro.close()
        if before is not None and after is not None:
            out += _old_or_new(tag, seen, before, after)
        temps = [f for f in os.listdir(sc.tmp.name) if f != "scene.shmkv"]  # (a save's temporary file)
        if temps:
            out.append(f"{tag}: left in the snapshot's directory: {temps}")
    finally:
        sc.close()
    return out


def _discard(h: Any) -> None:
    try:
        h.discard()
    except (shmkv.SequenceNotFound, shmkv.LeaseError, shmkv.ReadOnlyError):
        pass


def _may_lose(op: str, role: str, sc: Scene, h: Any) -> bool:
    """Whether a held handle may have lost its sequence or lease through ``op``: then a fresh
    write handle can be taken, or the sequence is gone (never a lease nobody can use)."""
    if op not in ("free", "free_borrower", "finish", "restore"):
        return False
    try:
        sc.store.sequence(h.id, write=True)
    except shmkv.SequenceNotFound:
        return True
    except shmkv.LeaseError:
        return False  # leased, by nobody who can write it
    return True


def expected(op: str, dtype: str) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Token ids of every sequence of the scene, and after an uninterrupted ``op``."""
    sc = scene(dtype, op)
    try:
        prepare(sc, op)
        before, _ = problems_of(sc.store, "scene")
        run_op(sc, op)
        after, _ = problems_of(sc.store, "after")
        return before, after
    finally:
        sc.close()


def _old_or_new(tag: str, seen: dict[int, list[int]], before: dict[int, list[int]],
                after: dict[int, list[int]]) -> list[str]:
    """Each sequence holds its old or new tokens (plus what the decode steps committed, ids >= 20000)."""
    out = []
    new_states = [t for i, t in after.items() if i not in before]
    for sid, toks in seen.items():
        core = [t for t in toks if t < 20000]
        if any(t >= 20000 for t in toks[len(core):]) and toks[:len(core)] != core:
            out.append(f"{tag}: sequence {sid}: decoded tokens in the middle: {toks}")
        cands = [before.get(sid), after.get(sid)] if sid in before else new_states
        if core not in cands:
            out.append(f"{tag}: sequence {sid} holds {core[:6]}..{len(core)}, neither its old nor its new tokens")
    return out


if __name__ == "__main__":
    ops = [sys.argv[1]] if len(sys.argv) > 1 else list(OPS)
    dtypes = [sys.argv[2]] if len(sys.argv) > 2 else ["float32", "int8"]
    total = fails = 0
    for op_ in ops:
        for dt in dtypes:
            b_, a_ = expected(op_, dt)
            n_ = points(op_, dt)
            for pt in range(1, n_ + 1):
                total += 1
                got = trial(op_, dt, pt, b_, a_)
                if got:
                    fails += 1
                    print("\n".join(got), flush=True)
            print(f"{op_} {dt}: {n_} points", flush=True)
    print(f"{fails} of {total} trials with problems")
