"""The workers, the workload and the processes of the serving benchmark (``shmkv.cli.bench.serve``).

A worker is a spawned process that imports this module by its package name
(``shmkv.cli.bench.serve_stack.worker``), which works from an installed package and from a
checkout alike; torch and transformers are imported inside the worker and ``point``'s callers only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

TEXT = ("You are a careful assistant for a team that runs inference servers. Answer briefly, cite the "
        "configuration option you rely on, say when you are unsure, and never invent numbers. ")
QUESTIONS = ["How do I size the KV cache?", "Why is the first token slow?", "What does prefix caching save?",
             "How many workers fit on two cores?", "What happens after a restart?", "Is greedy decoding exact?"]
SAMPLE_S = 0.2


# -- the workload --------------------------------------------------------------------------------


@dataclass
class Request:
    rid: int
    user: list[int]
    parent: int | None  # a second turn continues this earlier request


def workload(system: list[int], users: list[list[int]], every: int, lag: int) -> list[Request]:
    """Request i is the next turn of request i - lag when i % every == every - 1 (and i >= lag)."""
    return [Request(i, u, i - lag if every and i % every == every - 1 and i >= lag else None)
            for i, u in enumerate(users)]


def token_ids(a: argparse.Namespace, vocab: int, tokenizer: Any) -> tuple[list[int], list[list[int]]]:
    """The system prompt (S ids) and R user turns (U ids each): random ids, or text through the tokenizer."""
    import random

    rng = random.Random(a.seed)
    if tokenizer is None:
        system = [1] + [rng.randrange(3, vocab) for _ in range(a.system - 1)]
        return system, [[rng.randrange(3, vocab) for _ in range(a.user)] for _ in range(a.requests)]
    ids = tokenizer(TEXT)["input_ids"]
    more = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    while len(ids) < a.system:
        ids += more
    users = []
    for i in range(a.requests):
        u = tokenizer(f" Question {i}: {QUESTIONS[i % len(QUESTIONS)]} " * (1 + a.user // 8),
                      add_special_tokens=False)["input_ids"]
        users.append(u[: a.user])
    return ids[: a.system], users


# -- the worker process ----------------------------------------------------------------------


class Times(NamedTuple):
    """A worker's monotonic clock (one clock for every process) around one request."""

    get: float  # it asked the queue for its next request
    deq: float  # it had the request
    waited: float  # the prefill of a shared prefix in flight was done (= deq when there was no wait)
    gen: float  # the cache was made (for_prompt): generate() starts
    first: float  # the first new token
    end: float  # generate() returned


def _load_model(model_dir: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    auto: Any = AutoModelForCausalLM  # its stubs type from_pretrained as a method of an instance
    return auto.from_pretrained(model_dir, local_files_only=True).to(device).eval()


def worker(jobs: Any, results: Any, *, model_dir: str, device: str, store_name: str | None) -> None:
    """Answer requests from ``jobs`` until None; report ('ready', pid) first, then one tuple per request:
    through ``generate`` with a ``DynamicCache`` (``store_name`` None) or a ``ShmkvCache`` on that store."""
    try:
        _serve(jobs, results, model_dir=model_dir, device=device, store_name=store_name)
    except KeyboardInterrupt:
        pass
    except BaseException:
        import traceback

        results.put(("error", os.getpid(), traceback.format_exc()))
        raise


def _serve(jobs: Any, results: Any, *, model_dir: str, device: str, store_name: str | None) -> None:
    import torch
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    import shmkv
    from shmkv.transformers import ShmkvCache, cache_kwargs

    torch.set_num_threads(1)  # W workers on a few cores: one thread each
    model = _load_model(model_dir, device)
    store = shmkv.attach(store_name) if store_name else None

    class FirstToken(BaseStreamer):
        """generate() puts the prompt first, then each new token: the second put is the first token."""

        def __init__(self) -> None:
            self.puts, self.t = 0, 0.0

        def put(self, value: Any) -> None:
            self.puts += 1
            if self.puts == 2:
                self.t = time.monotonic()

        def end(self) -> None:
            return None

    def answer(prompt: list[int], new: int, warmup: bool = False) -> tuple[Any, int, float, float]:
        ids = torch.tensor([prompt], device=device)
        if store is None:
            cache: Any = DynamicCache(config=model.config)
        elif warmup:
            cache = ShmkvCache(store)  # the same code path, nothing looked up or kept
        else:  # room for the answer: a borrower that outgrows its range moves and copies the borrowed prefix
            cache = ShmkvCache.for_prompt(store, ids, capacity=len(prompt) + new)
        reused = cache.get_seq_length()
        streamer, t_gen = FirstToken(), time.monotonic()
        with torch.no_grad():
            out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, streamer=streamer)
        if isinstance(cache, ShmkvCache):
            cache.free() if warmup else cache.finish(out)
        return out, reused, t_gen, streamer.t

    answer([2] * 8, 2, warmup=True)  # first calls allocate and initialise: not a request's cost
    results.put(("ready", os.getpid()))
    try:
        while True:
            t_get = time.monotonic()
            if (job := jobs.get()) is None:
                break
            rid, prompt, new, want = job
            t0, c0 = time.monotonic(), time.process_time()
            if store is not None and want and store.match_prefix(prompt) < want:
                await_prefix(store, prompt, want)  # inside the request's TTFT and CPU time
            t_waited = time.monotonic()
            out, reused, t_gen, t_first = answer(prompt, new)
            t_end = time.monotonic()
            results.put(("done", rid, os.getpid(), reused, out[0, len(prompt):].tolist(),
                         Times(t_get, t0, t_waited, t_gen, t_first, t_end), time.process_time() - c0))
    finally:
        if store is not None:
            store.close()


def await_prefix(store: Any, prompt: list[int], want: int, timeout: float = 60.0) -> None:
    """Until ``store`` holds ``want`` tokens of ``prompt``: another worker computes them right now
    (its prefill commits them with their ids, ``ShmkvCache.for_prompt``), so this worker sleeps
    on the length of the other workers' sequences in progress (futex) instead of computing the
    same prefix again. Gives up (and computes them) when no other worker has a prefill in
    progress for about a second, or after ``timeout`` seconds."""
    import shmkv

    me, deadline, idle = os.getpid(), time.monotonic() + timeout, 0
    while store.match_prefix(prompt) < want and time.monotonic() < deadline:
        busy = [i.id for i in store.sequences()
                if i.lease_alive and i.lease_pid != me and not i.finished and i.length < want]
        if not busy:
            idle += 1
            if idle > 500:  # the other worker has not even started it: compute it here
                return
            time.sleep(0.002)
            continue
        idle = 0
        try:
            store.sequence(busy[0]).wait(want, timeout=0.05)
        except (shmkv.WaitTimeout, shmkv.SequenceNotFound):
            pass


def wait_hint(prompt: list[int], in_flight: list[list[int]], cached: list[list[int]]) -> int:
    """Tokens of ``prompt`` worth waiting for: the longest prefix it shares with a request in flight
    (queued or running), when that is longer than what it shares with what the answered requests
    cached; else 0 (no wait). What a scheduler with a shared prefix cache does for requests that
    arrive together (SGLang's in-batch prefix caching computes a shared prefix once, too)."""

    def common(other: list[int]) -> int:  # bisection over list comparisons (C loops), 2n ids compared
        lo, hi = 0, min(len(prompt), len(other))
        if prompt[:hi] == other[:hi]:
            return hi
        while hi - lo > 1:  # the first lo ids agree, the first hi do not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if prompt[lo:mid] == other[lo:mid] else (lo, mid)
        return lo

    want = min(max((common(p) for p in in_flight), default=0), len(prompt) - 1)
    return want if want > max((common(c) for c in cached), default=0) else 0


# -- memory ------------------------------------------------------------------------------------


def _rollup_kb(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup``'s Pss fields in kB (Pss, Pss_Anon, Pss_File, Pss_Shmem)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss"):
                k, v = line.split()[:2]
                out[k.rstrip(":")] = int(v)
    return out


def store_bytes(name: str) -> int:
    """Resident bytes of store ``name``'s files in /dev/shm (tmpfs allocates what was written)."""
    n = 0
    for f in os.listdir("/dev/shm"):
        if f.startswith(f"skv_{name}."):
            try:
                n += os.stat(os.path.join("/dev/shm", f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return n


def worker_memory(pids: list[int], store: str | None) -> tuple[int, int]:
    """Summed Pss of the workers in bytes with the store's pages counted once and in full: the
    workers' Pss of shared memory (Pss_Shmem: their share of the store pages they touched) is
    replaced by the store's resident bytes. Also the same without the libraries' file pages
    (Pss_Anon + store), whose share moves with every other process mapping torch."""
    pss = anon = 0
    for pid in pids:
        try:
            r = _rollup_kb(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        pss += r["Pss"] - r.get("Pss_Shmem", 0)
        anon += r.get("Pss_Anon", 0)
    held = store_bytes(store) if store else 0
    return pss * 1024 + held, anon * 1024 + held


def cpu_seconds(pids: list[int]) -> tuple[float, float, float, float]:
    """Seconds so far: the machine's busy CPU (every core, /proc/stat), the processes ``pids``' time on
    a CPU and their time ready to run on a run queue (summed over their threads,
    /proc/PID/task/*/schedstat), and this process's CPU (every thread)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    machine = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    run = queued = 0
    for pid in pids:
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    on, wait = f.read().split()[:2]
                run, queued = run + int(on), queued + int(wait)
        except (FileNotFoundError, ProcessLookupError):
            pass
    me = os.times()
    return machine, run / 1e9, queued / 1e9, me.user + me.system


# -- one mode --------------------------------------------------------------------------------


@dataclass
class Run:
    mode: str
    ttft: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # the worker's CPU seconds per request
    tokens: dict[int, list[int]] = field(default_factory=dict)
    reused: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    mem_peak: int = 0
    mem_end: int = 0
    anon_peak: int = 0  # the same without the libraries' file pages
    store_end: int = 0  # the store's resident bytes at the end
    new_tokens: int = 0
    restart_s: float = 0.0  # warm: load of the snapshot until every worker is ready
    workers: int = 0
    times: dict[int, Times] = field(default_factory=dict)
    pid: dict[int, int] = field(default_factory=dict)  # the worker that answered each request
    put: dict[int, float] = field(default_factory=dict)  # when the scheduler queued each request
    t0: float = 0.0  # the timed window: from the first request queued to the last answer
    last: float = 0.0
    cpu_window: tuple[float, ...] = ()  # wall; machine, workers on a CPU, workers ready, scheduler (cpu_seconds)

    def ttft_pct(self, q: float) -> float:
        """The ``q`` quantile of the run's TTFTs (the nearest one, no interpolation)."""
        s = sorted(self.ttft)
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    @property
    def requests_per_s(self) -> float:
        return len(self.tokens) / self.seconds

    @property
    def cpu_per_request(self) -> float:
        """The workers' CPU seconds a request, on average."""
        return statistics.mean(self.cpu)


def cpu_shares(run: Run) -> dict[str, float]:
    """Over the timed window: the fraction of it each worker (on average) ran on a CPU, was ready to
    run but waited for a core (run queue: other processes had the cores), slept (idle: waiting for a
    request, another worker's prefill, a lock); the cores the scheduler used (its memory sampler
    included) and the cores the machine's other processes used."""
    wall, machine, run_s, queued_s, scheduler = run.cpu_window
    n = wall * max(1, run.workers)
    return {"workers_on_cpu_fraction": run_s / n, "workers_runqueue_fraction": queued_s / n,
            "workers_asleep_fraction": max(0.0, 1 - (run_s + queued_s) / n), "scheduler_cores": scheduler / wall,
            "other_cores": max(0.0, machine - run_s - scheduler) / wall}


def worker_time(run: Run) -> dict[str, float]:
    """How the workers spent the timed window, as fractions of (workers x window): ``busy`` (from a
    request's cache lookup to its last token), ``prefix_wait`` (asleep on a shared prefix another
    worker computes), ``queue_empty`` (in ``jobs.get`` before the scheduler had queued the request),
    ``handoff`` (in ``jobs.get`` with the request queued: the pipe, unpickling), ``between`` (from an
    answer to the next ``jobs.get``: sending the answer), ``tail`` (after its last answer, or the
    whole window for a worker that answered nothing)."""
    window = run.last - run.t0
    out = dict.fromkeys(("busy", "prefix_wait", "queue_empty", "handoff", "between", "tail"), 0.0)
    pids = sorted(set(run.pid.values()))
    out["tail"] = window * max(0, run.workers - len(pids))
    for pid in pids:
        prev = run.t0
        for rid, t in sorted(((r, t) for r, t in run.times.items() if run.pid[r] == pid), key=lambda x: x[1].deq):
            get = max(t.get, run.t0)
            out["between"] += get - prev
            empty = min(max(0.0, run.put[rid] - get), t.deq - get)
            out["queue_empty"] += empty
            out["handoff"] += t.deq - get - empty
            out["prefix_wait"] += t.waited - t.deq
            out["busy"] += t.end - t.waited
            prev = t.end
        out["tail"] += run.last - prev
    return {k: v / (window * max(1, run.workers, len(pids))) for k, v in out.items()}


class Stack:
    """The processes and stores of the run: everything it started, stopped and removed on the way out."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.procs: list[Any] = []
        self.stores: list[Any] = []

    def stop(self, jobs: Any = None) -> None:
        if jobs is not None:
            for _ in self.procs:
                jobs.put(None)
        for p in self.procs:
            p.join(30 if jobs is not None else 2)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
        for s in self.stores:
            s.close()
        self.stores = []


def serve(stack: Stack, a: argparse.Namespace, mode: str, *, model_dir: str, store: str | None,
          system: list[int], reqs: list[Request], snapshot: str | None = None) -> Run:
    """Start W workers, queue the requests in order (a second turn once its earlier answer is in),
    collect the answers and memory samples; then save the store (``snapshot``) and stop the workers."""
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    jobs.cancel_join_thread()  # not joined at exit: after a Ctrl-C no killed worker reads what it still sends
    run = Run(mode, workers=a.workers)
    t_start = time.monotonic()
    kw = dict(model_dir=model_dir, device=a.device, store_name=store)
    stack.procs = [ctx.Process(target=worker, args=(jobs, results), kwargs=kw, daemon=True) for _ in range(a.workers)]
    for p in stack.procs:
        p.start()
    pids = [p.pid for p in stack.procs]
    ready = 0
    while ready < a.workers:
        ready += _next(results, stack.procs)[0] == "ready"
    run.restart_s = time.monotonic() - t_start
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.wait(SAMPLE_S):
            pss, anon = worker_memory(pids, store)
            run.mem_peak, run.anon_peak = max(run.mem_peak, pss), max(run.anon_peak, anon)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    prompts: dict[int, list[int]] = {}
    queued, t0, last = 0, time.monotonic(), time.monotonic()
    cpu0 = cpu_seconds(pids)
    try:
        while len(run.tokens) < len(reqs):
            while queued < len(reqs) and (reqs[queued].parent is None or reqs[queued].parent in run.tokens):
                r = reqs[queued]
                base = system if r.parent is None else prompts[r.parent] + run.tokens[r.parent]
                prompts[r.rid] = base + r.user
                want = 0
                if store is not None:  # the baseline has no cache to wait for
                    in_flight = [p for q, p in prompts.items() if q not in run.tokens and q != r.rid]
                    want = wait_hint(prompts[r.rid], in_flight, [prompts[q] + run.tokens[q] for q in run.tokens])
                run.put[r.rid] = time.monotonic()
                jobs.put((r.rid, prompts[r.rid], a.new_tokens, want))
                queued += 1
            _, rid, pid, reused, toks, times, cpu = _next(results, stack.procs)
            run.cpu.append(cpu)
            run.tokens[rid], run.reused[rid], run.times[rid], run.pid[rid] = toks, reused, times, pid
            run.ttft.append(times.first - times.deq)
            run.new_tokens += len(toks)
            last = max(last, times.end)
            if len(run.tokens) % max(1, len(reqs) // 4) == 0:
                print(f"    {mode}: {len(run.tokens)}/{len(reqs)} answered", flush=True)
        cpu1 = cpu_seconds(pids)
        run.seconds, run.t0, run.last = last - t0, t0, last
        run.cpu_window = (time.monotonic() - t0, *(b - a for a, b in zip(cpu0, cpu1, strict=True)))
        print(f"    {mode}: {run.requests_per_s:.2f} requests/s, worker CPU {run.cpu_per_request * 1e3:.0f} ms "
              f"a request, TTFT p50 {run.ttft_pct(0.5) * 1e3:.1f} ms", flush=True)
    finally:
        stop_sampling.set()
        sampler.join()
    run.mem_end, anon = worker_memory(pids, store)  # the workers are still alive, the store still open
    run.mem_peak, run.anon_peak = max(run.mem_peak, run.mem_end), max(run.anon_peak, anon)
    run.store_end = store_bytes(store) if store else 0
    if snapshot is not None and store is not None:
        snapshotter(store, snapshot)
    stack.stop(jobs)
    return run


def _next(results: Any, procs: list[Any], timeout: float = 600.0) -> tuple[Any, ...]:
    """The next message from a worker; raises at once if one died or reported an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg: tuple[Any, ...] = results.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"a worker process died (exit codes {dead})") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"worker {msg[1]} failed:\n{msg[2]}")
        return msg
    raise TimeoutError(f"no answer from the workers within {timeout} s")


def snapshotter(store: str, path: str) -> None:
    """Save ``store`` as the snapshotter process does (``shmkv snapshot``), once, to ``path``."""
    import shmkv

    directory = os.path.dirname(path)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmkv.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-m", "shmkv", "snapshot", store, "--dir", directory, "--count", "1",
                        "--keep", "1", "--nice", "0"], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode:
        raise RuntimeError(f"shmkv snapshot failed ({r.returncode}): {r.stderr[-2000:]}")
    files = [f for f in os.listdir(directory) if f.startswith(f"{store}-") and f.endswith(".shmkv")]
    os.replace(os.path.join(directory, files[0]), path)
