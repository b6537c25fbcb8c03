"""The ``shmkv`` command line. Inspection commands attach read-only.

Exit codes: 0 success, 1 a problem found (missing store, failed check, ``rm`` of a
store that live processes still write), 2 bad usage (bare ``shmkv`` prints the help
and exits 2).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import select
import signal
import sys
import threading
import time
from typing import Any


from shmkv import __version__
from shmkv._engine.memory import segment as _segment
from shmkv.store._lifecycle import Owners, gc, list_stores, remove, store_owners
from shmkv.store._lifecycle import load as load_snapshot
from shmkv.store._store import attach
from shmkv.store._verify import verify
from shmkv.cli._args import count_arg, ids_arg, seconds_arg
from shmkv.cli._info import ProgressBar, info_of, print_info
from shmkv.cli._words import count, for_the_shell, size
from shmkv.errors import AccessDeniedError, InvalidArgumentError, ShmkvError, StoreExistsError, StoreNotFound


def _liveness(name: str) -> dict[str, Any]:
    """Who keeps store ``name`` alive: its creator and live read-write clients, and whether
    ``shmkv gc`` would remove it (gc's own rule, Owners.collectable)."""
    owners = store_owners(name)
    if not isinstance(owners, Owners):  # (removed, or written over, since it was attached)
        return {"owners_unknown": owners.value}
    return {"creator_pid": owners.creator[0], "creator_alive": owners.creator_alive(),
            "live_clients": owners.live_clients(), "gc_removes": owners.collectable(False),
            "gc_all_removes": owners.collectable(True)}


def _cmd_ls(a: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for name in list_stores():
        try:
            with attach(name, readonly=True, timeout=0.2) as s:
                st = s.stats()
                rows.append({"name": name, "sequences": st.sequences, "tokens": st.tokens,
                             "dtype": s.layout.dtype, "bytes_used": st.bytes_used, "persistent": s.persistent,
                             **_liveness(name)})
        except (ShmkvError, OSError) as e:  # another user's store, one being created or removed
            rows.append({"name": name, "error": str(e)})
    if a.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print(f"no stores in {_segment.SHM_DIR}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']}: {r['error']}")
            continue
        if "owners_unknown" in r:
            owners = f"owners unknown: {r['owners_unknown']} (being removed?)"
        else:
            owners = f"creator {r['creator_pid']} {'alive' if r['creator_alive'] else 'dead'}"
            live = r["live_clients"]
            owners += f", live clients: {', '.join(map(str, live))}" if live else ", no live clients"
            if r["gc_removes"]:
                owners += " (`shmkv gc` would remove it)"
            elif r["gc_all_removes"]:
                owners += " (persistent: `shmkv gc --all` would remove it)"
        print(f"{r['name']}: {count(r['sequences'], 'sequence')}, {count(r['tokens'], 'token')}, {r['dtype']}, "
              f"{r['bytes_used'] / 2**20:.2f} MiB{', persistent' if r['persistent'] else ''}; {owners}")
    return 0


def _cmd_info(a: argparse.Namespace) -> int:
    with attach(a.name, readonly=True) as s:
        d = info_of(s)
    print(json.dumps(d)) if a.json else print_info(d)
    return 0


def _cmd_watch(a: argparse.Namespace) -> int:
    with attach(a.name, readonly=True) as s:
        n = 0
        try:
            while a.count is None or n < a.count:
                d = info_of(s)
                if a.json:
                    print(json.dumps(d), flush=True)
                else:
                    if sys.stdout.isatty():
                        sys.stdout.write("\x1b[H\x1b[2J")
                    print(time.strftime("%H:%M:%S"), end=" ")
                    print_info(d)
                    sys.stdout.flush()
                n += 1
                if a.count is None or n < a.count:
                    time.sleep(a.interval)
        except KeyboardInterrupt:
            pass
    return 0


def _cmd_save(a: argparse.Namespace) -> int:
    with attach(a.name, readonly=True) as s:
        n = s.save(a.file, a.seq, progress=ProgressBar("save", a.progress or sys.stderr.isatty()))
    print(f"saved {a.name} to {a.file} ({n} bytes)")
    return 0


def _cmd_load(a: argparse.Namespace) -> int:
    try:
        s = load_snapshot(a.file, a.name, persistent=True,
                          progress=ProgressBar("load", a.progress or sys.stderr.isatty()))
    except StoreExistsError:
        raise StoreExistsError(
            f"a store named {a.name!r} exists already: choose another --name, or remove it first "
            f"(`shmkv rm {a.name}`)"
        ) from None
    n = len(s.sequences())
    s.close()
    print(f"loaded {a.file} into persistent store {a.name} ({count(n, 'sequence')}); "
          f"remove it with `shmkv rm {a.name}`")
    return 0


def _cmd_rm(a: argparse.Namespace) -> int:
    status = 0
    for name in a.names:
        if not a.force:
            try:
                with attach(name, readonly=True, timeout=0.2) as s:
                    live = s.clients()
            except StoreNotFound:
                live = []  # remove() says so below
            except (ShmkvError, OSError):
                live = _liveness(name).get("live_clients", [])  # a damaged store: the raw client table
            if live:
                print(f"shmkv rm: store {name!r} has live read-write clients (pid {', '.join(map(str, live))}): "
                      "they would keep writing into memory no new process can attach to; stop them first, "
                      "or pass --force", file=sys.stderr)
                status = 1
                continue
        try:
            remove(name)
        except (ShmkvError, OSError) as e:
            print(f"shmkv rm: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"removed {name}")
    return status


def _cmd_gc(a: argparse.Namespace) -> int:
    removed = gc(include_persistent=a.all)
    print(json.dumps(removed) if a.json else ("\n".join(f"removed {n}" for n in removed) or "nothing to remove"))
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    if a.repair:  # take the store lock once: the lock holder rolls back what a dead process left
        with attach(a.name) as s, s.transaction():
            pass
    with attach(a.name, readonly=True) as s:
        problems = verify(s)
    if a.json:
        print(json.dumps({"name": a.name, "ok": not problems, "problems": problems}))
    else:
        print("\n".join(problems) if problems else f"{a.name}: ok")
    return 1 if problems else 0


class SignalStop:
    """A stop flag that a signal handler may set (``shmkv snapshot``'s SIGTERM and SIGINT).

    ``threading.Event.set()`` takes the event's lock, and Python runs a handler in the main
    thread, between any two bytecodes, also while that thread holds the same lock inside
    ``Event.wait()`` (entering or leaving its sleep): the handler then waits for itself forever.
    This flag is a plain attribute plus a byte written to a pipe that ``wait`` polls (a set()
    just before the poll makes it return at once); no lock anywhere."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._poll = select.poll()  # (poll, not select: a descriptor number may exceed FD_SETSIZE)
        self._poll.register(self._r, select.POLLIN)
        self._set = False

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._w, b"\0")
        except OSError:  # (the pipe is full: a byte already wakes the wait; or it is closed)
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        if not self._set:
            self._poll.poll(timeout * 1000)
        return self._set

    def close(self) -> None:
        for fd in (self._r, self._w):
            os.close(fd)


def snapshot_loop(name: str, directory: str, every: float, keep: int, *, count: int | None = None,
                  stop: threading.Event | SignalStop | None = None, log: Any = print) -> list[str]:
    """Save store ``name`` into ``directory`` every ``every`` seconds, keeping the newest ``keep``."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidArgumentError(f"keep={keep!r} must be at least 1 (the snapshot just written is kept)")
    stop = stop or threading.Event()
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        raise InvalidArgumentError(f"--dir {directory!r} is a file, not a directory: give a directory") from None
    except PermissionError:
        raise AccessDeniedError(f"--dir {directory!r} cannot be made here: no permission") from None
    written: list[str] = []
    ours = re.compile(re.escape(name) + r"-\d{8}T\d{12}Z\.shmkv")  # what this loop names its files (the stamp below)
    with attach(name, readonly=True) as store:
        n = 0
        while not stop.is_set() and (count is None or n < count):
            t0 = time.monotonic()
            stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
            path = os.path.join(directory, f"{name}-{stamp}.shmkv")
            nbytes = store.save(path)
            written.append(path)
            log(f"snapshot {path} ({nbytes} bytes, {time.monotonic() - t0:.3f} s)")
            mine = sorted(f for f in os.listdir(directory) if ours.fullmatch(f))  # (not another store's, "NAME-x")
            for old in mine[: max(0, len(mine) - keep)]:
                os.unlink(os.path.join(directory, old))
            n += 1
            if count is None or n < count:
                stop.wait(max(0.0, every - (time.monotonic() - t0)))
    return written


def _cmd_snapshot(a: argparse.Namespace) -> int:
    stop = SignalStop()  # (not a threading.Event: see SignalStop)

    def handler(signum: int, frame: Any) -> None:
        print(f"signal {signum}: stopping after the current snapshot", file=sys.stderr)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    if a.nice:
        os.nice(a.nice)  # decode workers first: a snapshot may take longer, their tokens may not
    try:
        snapshot_loop(a.name, a.dir, a.every, a.keep, count=a.count, stop=stop, log=lambda m: print(m, flush=True))
    finally:
        stop.close()
    return 0


def _cmd_doctor(a: argparse.Namespace) -> int:
    from shmkv._engine.spans.stitch import CACHE_LIMIT as _STITCH_LIMIT
    from shmkv.store._doctor import MAPS_PER_STORE, doctor

    d = doctor(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype, tokens=a.tokens)
    if a.json:
        print(json.dumps(d.as_dict()))
        return 0 if d.ok else 1
    lay = d.layout
    print(f"platform     {d.system} {d.machine}: {'supported' if d.supported_platform else 'NOT supported'}; "
          f"Python {d.python}, numpy {d.numpy}, shmkv {d.shmkv}")
    print(f"/dev/shm     {d.shm_path} ({d.shm_fs or 'missing'}): {d.shm_free / 2**20:.0f} MiB free of "
          f"{d.shm_size / 2**20:.0f} MiB{'' if d.shm_writable else ', NOT writable'}")
    given = any(x is not None for x in (a.layers, a.kv_heads, a.head_dim, a.dtype))
    print(f"room         {d.tokens_fit:,} tokens fit in /dev/shm now, for a model of {lay['layers']} layers, "
          f"{lay['kv_heads']} KV heads of {lay['head_dim']} dims, {lay['dtype']} ({size(d.bytes_per_token)} "
          "a token, K and V)" + ("" if given else "; that is the default layout, an 8B Llama-3-sized model: "
                                 "--layers, --kv-heads, --head-dim and --dtype give yours"))
    if d.max_map_count is not None:
        print(f"mappings     vm.max_map_count {d.max_map_count:,}, {d.maps_in_use:,} in use by this process: about "
              f"{d.stores_mappable:,} more stores can be attached ({MAPS_PER_STORE} mappings each), keeping "
              f"{2 * _STITCH_LIMIT:,} for the views of shared prefix pages")
    print(f"liveness     PID namespace {d.pid_namespace} "
          f"({'the initial one' if d.initial_pid_namespace else 'not the initial one: a container'}); "
          + ("liveness is a kernel lock: processes in other PID namespaces (containers sharing this /dev/shm) are "
             "seen alive or dead correctly" if d.cross_namespace_liveness
             else "judged by pid: right between processes of this PID namespace only"))
    for e in d.extras:
        print(f"extra        {e.name:<13} " + (e.version if e.version else f"not installed: {e.pip}"))
    for n in d.notes:
        print(f"note: {n}")
    for pr in d.problems:
        print(f"PROBLEM: {pr}")
    print("ok: shmkv can run here" if d.ok else "shmkv cannot run here as it is (see PROBLEM above)")
    return 0 if d.ok else 1


def _cmd_demo(a: argparse.Namespace) -> int:
    from shmkv.cli import _demo as demo

    terminated: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:  # (kill, timeout, a service manager): as a Ctrl-C
        terminated.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        summary = demo.run(workers=a.workers, new_tokens=a.tokens, snapshot=a.snapshot,
                           start_method=a.start_method, out=lambda m: print(m, flush=True))
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (the demo ignored a second one meanwhile)
        print(f"{'terminated' if terminated else 'interrupted'}; the demo's store was removed", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0 if summary["ok"] else 1


def _cmd_bench(a: argparse.Namespace) -> int:
    # The benchmarks ship in the package (shmkv/cli/bench/), imported only here: numpy
    # baselines, multiprocessing and the scenarios stay out of every other command.
    from shmkv.cli.bench.driver import main as bench_main

    return bench_main(a.bench_args)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except the empty ones (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmkv", description="Shared-memory KV cache: run the demo, inspect stores.",
                                epilog="`shmkv demo` runs the main job; `shmkv COMMAND --help` describes a command.")
    p.add_argument("--version", action="version", version=f"shmkv {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    def add(name: str, fn: Any, help: str, json_flag: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help,
                            formatter_class=_HelpFormatter)
        sp.set_defaults(fn=fn)
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print JSON for scripts")
        return sp

    d = add("demo", _cmd_demo, "tokenizer + decode workers + snapshotter on one store, checked against numpy")
    d.add_argument("--workers", type=count_arg(1, 32), default=2, help="decode worker processes (1-32)")
    d.add_argument("--tokens", type=count_arg(1, 512), default=24,
                   help="new tokens per request (1-512: what the demo's store holds)")
    d.add_argument("--snapshot", help="keep the snapshot in this file (by default it is written to the temp "
                   "directory and removed at the end)")
    d.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
                   help="how the demo starts its processes")
    sp = add("doctor", _cmd_doctor, "check this machine: /dev/shm room, platform, extras (exit 1 if shmkv "
             "cannot run)", True)
    sp.add_argument("--layers", type=count_arg(1), help="layout of the largest-store figure (default 32)")
    sp.add_argument("--kv-heads", type=count_arg(1), help="(default 8)")
    sp.add_argument("--head-dim", type=count_arg(1), help="(default 128)")
    sp.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64", "int8"],
                    help="(default bfloat16)")
    sp.add_argument("--tokens", type=count_arg(1), help="exit 1 unless this many tokens of the layout fit now")
    add("ls", _cmd_ls, "list stores", True)
    sp = add("info", _cmd_info, "layout and sequence table of a store", True)
    sp.add_argument("name")
    sp = add("watch", _cmd_watch, "refresh `info` until Ctrl-C", True)
    sp.add_argument("name")
    sp.add_argument("--interval", type=seconds_arg, default=1.0)
    sp.add_argument("--count", type=count_arg(1), help="stop after this many refreshes")
    sp = add("save", _cmd_save, "save a store to a snapshot file")
    sp.add_argument("name")
    sp.add_argument("file")
    sp.add_argument("--seq", type=ids_arg, help="comma-separated sequence ids (default: all)")
    sp.add_argument("--progress", action="store_true", help="show progress even when not on a terminal")
    sp = add("load", _cmd_load, "create a persistent store from a snapshot file")
    sp.add_argument("file")
    sp.add_argument("--name", required=True)
    sp.add_argument("--progress", action="store_true")
    sp = add("rm", _cmd_rm, "remove stores (refused while live processes write them, unless --force)")
    sp.add_argument("names", nargs="+", metavar="NAME")
    sp.add_argument("--force", action="store_true",
                    help="remove even if live read-write clients are attached (they keep their mappings)")
    sp = add("gc", _cmd_gc, "remove stores whose creator and clients are dead", True)
    sp.add_argument("--all", action="store_true", help="persistent stores too")
    sp = add("verify", _cmd_verify, "check a store's header invariants (exit 1 on a problem)", True)
    sp.add_argument("--repair", action="store_true",
                    help="first take the store lock: roll back an operation a dead process left half done")
    sp.add_argument("name")
    sp = add("snapshot", _cmd_snapshot, "save a store periodically, keeping the newest K files")
    sp.add_argument("name")
    sp.add_argument("--dir", required=True, help="directory of the snapshot files NAME-TIMESTAMP.shmkv")
    sp.add_argument("--every", type=seconds_arg, default=60.0, help="seconds between snapshots")
    sp.add_argument("--keep", type=count_arg(1), default=3,
                    help="newest snapshot files kept, at least 1 (older ones are deleted)")
    sp.add_argument("--count", type=count_arg(1),
                    help="stop after this many snapshots (default: until SIGINT/SIGTERM)")
    sp.add_argument("--nice", type=int, default=10, help="scheduling niceness to add (0 keeps it)")
    from shmkv.cli._remote import add_cli  # shmkv push, shmkv tier (the remote tier)

    add_cli(sub)
    # The bench parses its own options (--quick, --json, --only, ...): `shmkv bench --help` shows them.
    sub.add_parser("bench", help="benchmarks against numpy, np.save and multiprocessing (`shmkv bench --help`)",
                   add_help=False).set_defaults(fn=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    cmd = ""
    try:
        parser = _parser()
        args, extra = parser.parse_known_args(argv)
        if args.cmd is None:  # bare `shmkv`: the help, as a usage error
            parser.print_help()
            return 2
        cmd = f" {args.cmd}"
        if args.cmd == "bench":
            args.bench_args = extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        try:
            return int(args.fn(args))
        except ShmkvError as e:
            msg = for_the_shell(str(e))
            if getattr(args, "json", False):  # a script asked for JSON: the error too
                print(json.dumps({"error": msg, "type": type(e).__name__}))
            else:
                print(f"shmkv{cmd}: {msg}", file=sys.stderr)
            return 1
        except BrokenPipeError:
            return 1
    except KeyboardInterrupt:  # Ctrl-C at any moment: one line, no traceback; 130 as a shell reports it
        print(f"shmkv{cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
