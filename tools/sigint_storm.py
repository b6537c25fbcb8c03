"""A storm of real SIGINTs on a process that survives them, working on shared prefix pages.

A child process (fork or spawn) loops over borrowers of a cached prefix: creates them
(``create_sequence(prefix=...)``), reads them (``keys``, ``batch_kv``, a read-only attachment),
extends them, decodes into them (append to every layer, then commit; a Ctrl-C between the
calls: ``discard``), truncates them into their spans (copy-on-write), forks them, ``copy_prefix``-es
from them and frees them, catching KeyboardInterrupt around every step and going on (a REPL, a
notebook, a server). The parent sends SIGINT every 0.2-3 ms meanwhile. K and V of every cell are
derived from its token id (K = 4 * token + layer, V = -K), so any cell can be checked against
the token ids, and the child keeps the token ids every sequence committed (a step interrupted
leaves the sequence as before the step or as after it, nothing else).

After the storm the child checks every live sequence (its write handles, a read handle, a
read-only attachment), creates sequences on recycled cells and checks they read their own
bytes, drops its handles and counts its mappings of the data file; the parent then checks the
same sequences through fresh attachments, takes the store lock, runs ``shmkv info``.

Run: ``python tools/sigint_storm.py [--seconds 5] [--method fork|spawn] [--rounds 3] [--seed N]``.
Prints one line a round and exits 1 on any wrong data, wedged lock or leak.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Any
from collections.abc import Iterator

import numpy as np

import shmkv
from shmkv.testing import unique_name

L, H, D = 3, 2, 64
PROMPT = list(range(1, 201))  # the donor's tokens
CAP = 256


def kv_of(tokens: Any) -> tuple[np.ndarray, np.ndarray]:
    """[L, n, H, D] K and V of ``tokens``: K = 4 * token + layer, V = -K (exact in float32)."""
    t = np.asarray(tokens, dtype=np.float32)
    k = np.empty((L, len(t), H, D), np.float32)
    for layer in range(L):
        k[layer] = (4 * t + layer)[:, None, None]
    return k, -k


def check(store: shmkv.Store, sid: int, ref: list[int], where: str) -> str | None:
    """None when sequence ``sid`` holds exactly ``ref`` (token ids, K and V of every layer)."""
    h = store.sequence(sid)
    toks = [int(x) for x in np.asarray(h.tokens)]
    if toks != ref:
        return f"{where}: seq {sid} tokens {_short(toks)} != committed {_short(ref)}"
    k_want, v_want = kv_of(ref)
    for layer in range(L):
        k, v = h.kv(layer)
        k, v = np.asarray(k), np.asarray(v)
        if k.shape != k_want[layer].shape or not np.array_equal(k, k_want[layer]):
            bad = np.nonzero((k != k_want[layer]).any(axis=(1, 2)))[0] if k.shape == k_want[layer].shape else []
            got = k[bad[:4], 0, 0] if len(bad) else k.shape
            want = k_want[layer][bad[:4], 0, 0] if len(bad) else k_want[layer].shape
            cells = [int(c) for c in bad[:8]]
            return f"{where}: seq {sid} layer {layer} K wrong at cells {cells} (got {got}, want {want})"
        if not np.array_equal(v, v_want[layer]):
            return f"{where}: seq {sid} layer {layer} V wrong"
    return None


def _short(x: list[int]) -> str:
    return str(x) if len(x) < 12 else f"[{x[0]}..{x[-1]}] ({len(x)}) tail {x[-4:]}"


def data_maps(name: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("skv_" + name + ".d"))


GATE = [False]  # SIGINT reaches shmkv's handler only while a step's shmkv call runs


@contextmanager
def no_sigint() -> Iterator[None]:
    """The harness's own bookkeeping (SIGINTs meanwhile are dropped by ``gated``)."""
    yield


@contextmanager
def sigint_open() -> Iterator[None]:
    """A step's call into shmkv: SIGINTs are delivered to shmkv's handler (as in a REPL)."""
    GATE[0] = True
    try:
        yield
    finally:
        GATE[0] = False


def install_gate() -> None:
    """Put a gate in front of shmkv's SIGINT handler (``interrupts._on_sigint``, which shmkv itself
    installs only while a store lock is held): it passes the signal (and the interrupted frame)
    on while ``GATE`` is open, drops it otherwise, so the harness's own loop and bookkeeping are
    never interrupted. With the gate installed shmkv leaves the handler alone (it is not Python's
    default one), so every SIGINT of a step goes through ``_on_sigint``, held lock or not. A
    KeyboardInterrupt the handler raises closes the gate (no call between: nothing can interrupt
    that)."""
    from shmkv._engine.locking.interrupts import _on_sigint as inner

    def gated(signum: int, frame: Any) -> None:
        if GATE[0]:
            try:
                inner(signum, frame)
            except BaseException:
                # closed before anything else runs: the KeyboardInterrupt may come out at the
                # entry of ``sigint_open``'s ``__exit__``, whose ``finally`` then never runs, and
                # the harness's own bookkeeping must not take the next one
                GATE[0] = False
                raise

    signal.signal(signal.SIGINT, gated)


class Storm:
    def __init__(self, name: str, donors: set[int], seed: int) -> None:
        self.store = shmkv.attach(name)
        self.ro = shmkv.attach(name, readonly=True)
        self.name = name
        self.donors = donors
        self.rng = random.Random(seed)
        self.live: dict[int, Any] = {}  # id -> write handle
        self.ref: dict[int, list[int]] = {}  # id -> committed token ids
        self.next_tok = 100_000 + 100_000 * (seed % 50)
        self.pending: tuple[Any, ...] | None = None
        self.errors: list[str] = []
        self.counts: dict[str, int] = {}
        self.interrupted: dict[str, int] = {}
        self.orphans: set[int] = set()
        self.op = "none"
        self.log: list[str] = ["start"]  # the steps, for the report of the first problem
        self.first_log: list[str] | None = None

    def fresh(self, n: int) -> list[int]:
        t = list(range(self.next_tok, self.next_tok + n))
        self.next_tok += n
        return t

    # -- the steps (each runs with SIGINT open; its bookkeeping with SIGINT blocked) --------

    def step(self) -> None:
        ops = ["create", "extend", "decode", "decode", "read", "truncate", "fork", "copy", "free", "ro", "batch"]
        if len(self.live) < 2:
            op = "create"
        elif len(self.live) > 8:
            op = "free"
        else:
            op = self.rng.choice(ops)
        with no_sigint():
            self.counts[op] = self.counts.get(op, 0) + 1
            self.op = op
        self.log.append(op)
        getattr(self, "op_" + op)()
        self.log[-1] += " ok"

    def pick(self) -> tuple[int, Any]:
        sid = self.rng.choice(sorted(self.live))
        self.log[-1] += f" {sid}:{_short(self.ref[sid])}"
        return sid, self.live[sid]

    def op_create(self) -> None:
        m = self.rng.randrange(17, len(PROMPT))
        p = PROMPT[:m] + self.fresh(1)
        with no_sigint():
            self.pending = ("new",)
        with sigint_open():
            s = self.store.create_sequence(capacity=CAP, prefix=p)
        with no_sigint():
            self.live[s.id] = s
            self.ref[s.id] = p[:len(s)]
            self.log[-1] += f" -> {s.id}:{_short(self.ref[s.id])}"
            self.pending = None

    def op_extend(self) -> None:
        sid, s = self.pick()
        before = self.ref[sid]
        room = CAP - len(before)
        if room < 2:
            return
        new = self.fresh(self.rng.randrange(1, min(room, 24)))
        k, v = kv_of(new)
        with no_sigint():
            self.pending = ("seq", sid, [before, before + new])
        with sigint_open():
            s.extend(k, v, tokens=new)
        with no_sigint():
            self.ref[sid] = before + new
            self.pending = None

    def op_decode(self) -> None:
        """One decode step: a token appended to every layer, then committed. A Ctrl-C between
        the calls leaves the appended tokens pending; the program drops them (``discard``), as
        a REPL user or a server's step loop does, and the sequence holds its old tokens."""
        sid, s = self.pick()
        before = self.ref[sid]
        if CAP - len(before) < 1:
            return
        new = self.fresh(1)
        k, v = kv_of(new)
        with no_sigint():
            self.pending = ("seq", sid, [before, before + new])
        try:
            with sigint_open():
                for layer in range(L):
                    s.append(layer, k[layer, 0], v[layer, 0])
                s.commit(tokens=new)
        except KeyboardInterrupt:
            with no_sigint():
                try:
                    s.discard()
                except shmkv.ShmkvError:
                    pass
            raise
        with no_sigint():
            self.ref[sid] = before + new
            self.pending = None

    def op_truncate(self) -> None:
        sid, s = self.pick()
        before = self.ref[sid]
        n = self.rng.randrange(0, len(before) + 1)
        self.log[-1] += f" n={n}"
        with no_sigint():
            self.pending = ("seq", sid, [before, before[:n]])
        with sigint_open():
            s.truncate(n)
        with no_sigint():
            self.ref[sid] = before[:n]
            self.pending = None

    def op_fork(self) -> None:
        sid, s = self.pick()
        n = self.rng.randrange(0, len(self.ref[sid]) + 1)
        with no_sigint():
            self.pending = ("new",)
        with sigint_open():
            t = s.fork(n, capacity=CAP)
        with no_sigint():
            self.live[t.id] = t
            self.ref[t.id] = self.ref[sid][:n]
            self.log[-1] += f" n={n} -> {t.id}"
            self.pending = None

    def op_copy(self) -> None:
        a, _ = self.pick()
        b, _ = self.pick()
        if a == b:
            return
        n = self.rng.randrange(0, min(len(self.ref[a]), CAP) + 1)
        before = self.ref[b]
        with no_sigint():
            self.pending = ("seq", b, [before, self.ref[a][:n]])
            self.log[-1] += f" n={n}"
        with sigint_open():
            self.store.copy_prefix(a, b, n)
        with no_sigint():
            self.ref[b] = self.ref[a][:n]
            self.pending = None

    def op_free(self) -> None:
        sid, s = self.pick()
        with no_sigint():
            self.pending = ("free", sid)
        with sigint_open():
            s.free()
        with no_sigint():
            del self.live[sid], self.ref[sid]
            self.pending = None

    def op_read(self) -> None:
        sid, s = self.pick()
        ref = self.ref[sid]
        layer = self.rng.randrange(L)
        with sigint_open():
            k = np.asarray(s.keys(layer))
        want = kv_of(ref)[0][layer]
        if not np.array_equal(k, want):
            with no_sigint():
                bad = np.nonzero((k != want).any(axis=(1, 2)))[0] if k.shape == want.shape else []
                got = k[bad[:4], 0, 0] if len(bad) else k.shape
                self.errors.append(f"read: seq {sid} layer {layer} keys differ from committed {_short(ref)} "
                                   f"at cells {[int(c) for c in bad[:8]]}: got {got}"
                                   f" (K = 4 * token + layer), again: {check(self.store, sid, ref, 'reread')}")

    def op_batch(self) -> None:
        sid, s = self.pick()
        layer = self.rng.randrange(L)
        with sigint_open():
            k, _v = self.store.batch_kv([s], layer)
        want = kv_of(self.ref[sid])[0][layer]
        if not np.array_equal(np.asarray(k)[0], want):
            with no_sigint():
                self.errors.append(f"batch_kv: seq {sid} layer {layer} differs from committed")

    def op_ro(self) -> None:
        sid, _ = self.pick()
        with sigint_open():
            err = check(self.ro, sid, self.ref[sid], "ro")
        if err:
            with no_sigint():
                self.errors.append(err)

    # -- after an interrupt -----------------------------------------------------------------

    def reconcile(self) -> None:
        """(SIGINT blocked) The interrupted step left its sequence as before or as after."""
        p = self.pending
        if p is None:
            return
        if p[0] == "seq":
            sid, cands = p[1], p[2]
            toks = [int(x) for x in np.asarray(self.store.sequence(sid).tokens)]
            own = [int(x) for x in np.asarray(self.live[sid].tokens)]
            if toks not in cands:
                self.errors.append(f"after a Ctrl-C in {self.op}: seq {sid} holds {_short(toks)}, "
                                   f"neither before {_short(cands[0])} nor after {_short(cands[1])}")
                self.ref[sid] = toks
            else:
                self.ref[sid] = toks
            if own != toks:
                self.errors.append(f"after a Ctrl-C in {self.op}: seq {sid}'s write handle reads "
                                   f"{_short(own)}, a read handle {_short(toks)}")
        elif p[0] == "free":
            sid = p[1]
            ids = {i.id for i in self.store.sequences()}
            if sid not in ids:
                del self.live[sid], self.ref[sid]
        elif p[0] == "new":
            known = set(self.live) | self.donors | self.orphans
            for info in self.store.sequences():
                if info.id in known:
                    continue
                # made by the interrupted create or fork, its handle lost with the frame
                self.orphans.add(info.id)
                toks = [int(x) for x in np.asarray(self.store.sequence(info.id).tokens)]
                err = check(self.store, info.id, toks, f"orphan of a Ctrl-C in {self.op}")
                if err:
                    self.errors.append(err)
        self.pending = None

    def run(self, stop: Any) -> None:
        while True:
            if self.errors and self.first_log is None:
                self.first_log = self.log[-40:]
            del self.log[:-200]
            try:
                if self.pending is not None:
                    with no_sigint():
                        self.reconcile()
                if stop.is_set():
                    return
                self.step()
            except KeyboardInterrupt:
                with no_sigint():
                    self.interrupted[self.op] = self.interrupted.get(self.op, 0) + 1
                    self.log[-1] += " KI"
            except shmkv.ShmkvError as e:
                with no_sigint():
                    self.errors.append(f"{self.op}: {type(e).__name__}: {e}")
                    if self.pending is None or self.pending[0] == "new":
                        continue
                    # an error that is not a Ctrl-C: the step may be half done as well
            except Exception as e:
                with no_sigint():
                    self.errors.append(f"{self.op}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    def verify(self) -> dict[str, Any]:
        """SIGINT ignored from here on: the checks after the storm."""
        st = self.store
        errors = self.errors
        for sid, ref in sorted(self.ref.items()):
            for where, store in (("child rw", st), ("child ro", self.ro)):
                err = check(store, sid, ref, where)
                if err:
                    errors.append(err)
            own = [int(x) for x in np.asarray(self.live[sid].tokens)]
            if own != ref:
                errors.append(f"child write handle: seq {sid} tokens {_short(own)} != {_short(ref)}")
        ids = {i.id for i in st.sequences()}
        want_ids = set(self.ref) | self.donors | self.orphans
        if ids != want_ids:
            errors.append(f"sequences() {sorted(ids)} != live + donors + orphans {sorted(want_ids)}")
        # everything freed, then new sequences on the recycled cells read their own bytes
        for sid in list(self.live):
            self.live.pop(sid).free()
            del self.ref[sid]
        for sid in sorted(self.orphans):
            try:
                st.sequence(sid, write=True).free()
            except shmkv.ShmkvError as e:
                errors.append(f"orphan {sid}: cannot take and free it: {type(e).__name__}: {e}")
        for i in range(10):
            if i % 2:
                p = self.fresh(1)  # a miss
            else:
                p = PROMPT[:self.rng.randrange(17, len(PROMPT))] + self.fresh(1)
            s = st.create_sequence(capacity=CAP, prefix=p)
            base = p[:len(s)]
            new = self.fresh(40)
            s.extend(*kv_of(new), tokens=new)
            self.live[s.id] = s
            self.ref[s.id] = base + new
        for sid, ref in sorted(self.ref.items()):
            for where, store in (("recycled rw", st), ("recycled ro", self.ro)):
                err = check(store, sid, ref, where)
                if err:
                    errors.append(err)
        for d in self.donors:
            err = check(st, d, PROMPT, "donor")
            if err:
                errors.append(err)
        if self.first_log:
            errors.insert(0, "steps before the first problem:\n      " + "\n      ".join(self.first_log))
        return {"errors": errors, "ref": dict(self.ref), "counts": self.counts,
                "interrupted": self.interrupted, "orphans": sorted(self.orphans)}


def child(name: str, donors: list[int], seed: int, ready: Any, stop: Any, release: Any, q: Any) -> None:  # noqa: PLR0917
    maps0 = data_maps(name)
    storm = Storm(name, set(donors), seed)
    install_gate()
    maps_attached = data_maps(name)
    ready.set()
    try:
        storm.run(stop)
    except BaseException:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stderr.write(f"the storm loop raised (last steps {storm.log[-6:]}):\n{traceback.format_exc()}")
        sys.stderr.flush()
        raise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from shmkv._engine.locking import interrupts

    interrupts.deferred.clear()
    try:
        out = storm.verify()
    except Exception:
        out = {"errors": ["verify raised:\n" + traceback.format_exc()], "ref": {}, "counts": storm.counts,
               "interrupted": storm.interrupted, "orphans": []}
    out["maps_peak"] = data_maps(name)
    q.put(out)
    release.wait(60)
    # drop the handles: the mapping count returns near where it started
    storm.live.clear()
    for sid in list(out["ref"]):
        try:
            storm.store.sequence(sid, write=True).free()
        except shmkv.ShmkvError:
            pass
    storm.store.close()
    storm.ro.close()
    del storm
    gc.collect()
    q.put({"maps_start": maps0, "maps_attached": maps_attached, "maps_end": data_maps(name)})


def one_round(method: str, seconds: float, seed: int, summary: dict[str, Any] | None = None) -> list[str]:
    """One storm; returns the problems found (``summary``, when given, gets the counts)."""
    ctx: Any = mp.get_context(method)
    name = unique_name("sig")
    st = shmkv.create(name, layers=L, kv_heads=H, head_dim=D, dtype="float32", max_tokens=16384, max_seqs=64)
    problems: list[str] = []
    try:
        d = st.create_sequence(capacity=CAP, prefix=PROMPT)
        d.extend(*kv_of(PROMPT), tokens=PROMPT)
        d.finish()
        ready, stop, release, q = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        p = ctx.Process(target=child, args=(name, [d.id], seed, ready, stop, release, q), daemon=True)
        p.start()
        try:
            if not ready.wait(60):
                return ["child never got ready"]
            rng = random.Random(seed)
            sent = 0
            end = time.monotonic() + seconds
            while time.monotonic() < end and p.is_alive():
                os.kill(p.pid, signal.SIGINT)
                sent += 1
                time.sleep(rng.uniform(0.0002, 0.003))
            stop.set()
            if not p.is_alive():
                return [f"child died in the storm: exit code {p.exitcode}"]
            out = q.get(timeout=120)
            problems += out["errors"]
            # a fresh attachment here reads what the child committed
            for ro in (False, True):
                with shmkv.attach(name, readonly=ro) as fresh:
                    for sid, ref in sorted(out["ref"].items()):
                        err = check(fresh, sid, ref, "parent fresh " + ("ro" if ro else "rw"))
                        if err:
                            problems.append(err)
            with st.transaction():  # no lock held (LockTimeout otherwise)
                pass
            info = subprocess.run([sys.executable, "-m", "shmkv", "info", name], capture_output=True,
                                  text=True, timeout=60)
            if info.returncode != 0:
                problems.append(f"shmkv info: exit {info.returncode}: {info.stderr[-500:]}")
            stats = st.stats()
            release.set()
            end_maps = q.get(timeout=60)
            p.join(30)
            if end_maps["maps_end"] > end_maps["maps_start"] + 2:
                problems.append(f"child's data mappings: {end_maps} (peak {out['maps_peak']})")
            left = {i.id for i in st.sequences()}
            if left != {d.id}:
                problems.append(f"after the child freed all: sequences {sorted(left)} (donor {d.id})")
            if summary is not None:
                summary.update(sent=sent, steps=out["counts"], interrupted=out["interrupted"],
                               orphans=out["orphans"], maps=end_maps, maps_peak=out["maps_peak"])
            print(f"  {method} seed {seed}: {sent} SIGINTs, steps {sum(out['counts'].values())} "
                  f"interrupted {sum(out['interrupted'].values())} {out['interrupted']}, orphans "
                  f"{out['orphans']}, maps {end_maps} peak {out['maps_peak']}, stats seqs {stats.sequences}",
                  flush=True)
        finally:
            if p.is_alive():
                p.kill()
            p.join(10)
    finally:
        st.close()
        try:
            shmkv.remove(name)
        except shmkv.StoreNotFound:
            pass
    return problems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--method", default="both", choices=["fork", "spawn", "both"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    methods = ["fork", "spawn"] if a.method == "both" else [a.method]
    bad = 0
    for r in range(a.rounds):
        for m in methods:
            s = seed + r
            problems = one_round(m, a.seconds, s)
            for pr in problems[:20]:
                print(f"  PROBLEM ({m} seed {s}): {pr}", flush=True)
            bad += bool(problems)
    print("OK" if not bad else f"{bad} round(s) with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
