"""``shmkv demo``: a tokenizer, decode workers and a snapshotter sharing one store.

A tiny numpy transformer (shmkv.cli._model) continues a few prompts that share a
system prefix. The tokenizer process starts every request with
``create_sequence(prefix=...)``: the store's prefix cache gives it the longest
prefix any earlier request computed (the system prompt, and more where prompts
share their first words), and the tokenizer computes only the rest. Decode
workers take requests, lease their sequences, decode greedily on zero-copy
views and ``finish()`` them (cached prefixes for later requests); a snapshotter
saves the store once while they run. The main process then checks that every generated token
equals a single-process run without shmkv.

What it prints: first what it starts (store, processes), then progress as the
processes report, then one line per request (``matches`` the single-process
reference or ``DIFFERENT``), per-worker throughput, the snapshot, and the
verdict with the wall time. It leaves nothing behind: the store is removed, and
the snapshot file too unless ``snapshot=`` (``--snapshot FILE``) asked to keep it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmkv.cli import _model
from shmkv.cli._quiet import children_ignore_sigint
from shmkv.cli._words import size
from shmkv._snapshot import save as _save
from shmkv.store import _doctor
from shmkv.store._lifecycle import create
from shmkv.store._store import attach
from shmkv.errors import InvalidArgumentError

DEMO_MARGIN = 1 << 20  # the header segment and its tables
READY_TIMEOUT = 60.0  # seconds the tokenizer waits for each decode worker to start

SYSTEM = "You are a helpful assistant. Answer briefly and cite the cache. "
PROMPTS = [
    "What is a KV cache?",
    "Why share memory between processes?",
    "Explain speculative decoding.",
    "How does RoPE encode positions?",
    "What does a snapshot contain?",
    "Name three attention variants.",
]


@dataclass
class Result:
    index: int
    seq_id: int
    worker: int
    tokens: list[int]
    seconds: float
    reused: int  # prompt tokens the prefix cache gave
    prompt: int  # prompt tokens in all (system prefix included)


def _tokenizer(name: str, prompts: list[str], new_tokens: int, requests: Any, workers: int, *,
               ready: Any) -> None:
    try:
        store = attach(name)
        model = _model.Model()
        prefix = _model.encode(SYSTEM)
        for _ in range(workers):  # every decode worker up before the first request (none finds them all taken)
            try:
                ready.get(timeout=READY_TIMEOUT)
            except queue.Empty:  # (one not up within READY_TIMEOUT: the others take every request)
                break
        for i, text in enumerate(prompts):
            prompt = _model.encode(text)
            full = np.concatenate([prefix, prompt])
            # the longest prefix any earlier request computed, copied in; computed here: the rest
            seq = store.create_sequence(capacity=len(full) + new_tokens, prefix=full)
            reused = len(seq)
            cache = _model.SeqCache(seq)
            if reused < len(prefix):  # the system prompt, as its own step (as the reference does)
                model.forward(cache, prefix[reused:], np.arange(reused, len(prefix)))
                seq.commit(tokens=prefix[reused:])
            start = max(reused, len(prefix))
            logits = model.forward(cache, full[start:], np.arange(start, len(full)))
            seq.commit(tokens=full[start:])
            seq.release()  # a decode worker takes the lease
            requests.put((i, seq.id, int(np.argmax(logits)), len(full), reused))
            if i == 0:  # a note for the main process, through a worker
                requests.put(("prefilled", len(full)))
        store.close()
    except KeyboardInterrupt:
        pass
    finally:
        for _ in range(workers):
            requests.put(None)


def _worker(name: str, wid: int, new_tokens: int, requests: Any, results: Any, *, ready: Any) -> None:
    try:
        store = attach(name)
        model = _model.Model()
        ready.put(wid)
        while (job := requests.get()) is not None:
            if job[0] == "prefilled":  # the tokenizer's note for the main process
                results.put(job)
                continue
            index, seq_id, tok, pos, reused = job
            seq = store.sequence(seq_id, write=True)
            cache = _model.SeqCache(seq)
            out = []
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                out.append(tok)
                logits = model.forward(cache, np.array([tok]), np.array([pos]))
                seq.commit(tokens=[tok], positions=[pos])
                tok, pos = int(np.argmax(logits)), pos + 1
            results.put(Result(index, seq_id, wid, out, time.perf_counter() - t0, reused, pos - new_tokens))
            seq.finish()  # done: kept as a cached prefix for later requests (evicted when room is needed)
        store.close()
    except KeyboardInterrupt:
        pass


def _snapshotter(name: str, path: str, delay: float, results: Any) -> None:
    try:
        store = attach(name, readonly=True)
        time.sleep(delay)
        t0 = time.perf_counter()
        nbytes = store.save(path)
        results.put(("snapshot", path, nbytes, len(store.sequences()), time.perf_counter() - t0))
        store.close()
    except KeyboardInterrupt:
        pass


def run(*, workers: int = 2, new_tokens: int = 24, prompts: list[str] | None = None,
        snapshot: str | None = None, start_method: str = "spawn", out: Any = print,
        timeout: float = 300.0) -> dict[str, Any]:
    """Run the demo; return a summary (``ok`` is the equality check).

    ``snapshot``: where to keep the snapshot file; by default it is written to the
    temporary directory and removed before returning.
    """
    prompts = PROMPTS if prompts is None else prompts
    cfg = _model.Config()
    max_tokens = 4096
    # the room all of max_tokens takes, header included, checked before anything starts
    # (a CacheFullError naming the size and `--shm-size`, not a traceback from a worker)
    per = _doctor.bytes_per_token(cfg.layers, cfg.kv_heads, cfg.head_dim, "float32")
    _doctor.check_room(max_tokens * per + DEMO_MARGIN, "the demo's store")
    name = f"demo{os.getpid()}"
    keep_snapshot = snapshot is not None
    if snapshot is not None:  # checked before anything starts, not when the snapshotter saves at the end
        where = os.path.dirname(os.path.abspath(snapshot))
        if os.path.isdir(snapshot) or not os.path.isdir(where) or not os.access(where, os.W_OK):
            raise InvalidArgumentError(f"--snapshot {snapshot!r}: give the path of a file in a directory this user "
                                       "can write (it is written there at the end)")
    snapshot = snapshot or os.path.join(tempfile.gettempdir(), f"shmkv-demo-{os.getpid()}.shmkv")
    ctx: Any = mp.get_context(start_method)
    out(f"shmkv demo: a tiny numpy transformer ({cfg.layers} layers, {cfg.kv_heads} KV heads of {cfg.head_dim}) "
        f"continues {len(prompts)} prompts by {new_tokens} tokens each")
    out(f"starting store {name!r} and {workers + 2} processes ({start_method}): a tokenizer, {workers} decode "
        f"workers, a snapshotter ...")
    store = create(name, layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype="float32",
                   max_tokens=max_tokens, max_seqs=len(prompts) + 2)
    procs: list[Any] = []
    try:
        with children_ignore_sigint():  # (multiprocessing's resource tracker may start here)
            requests, results, ready = ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs.append(ctx.Process(target=_tokenizer, args=(name, prompts, new_tokens, requests, workers),
                                 kwargs={"ready": ready}))
        procs += [ctx.Process(target=_worker, args=(name, w, new_tokens, requests, results), kwargs={"ready": ready})
                  for w in range(workers)]
        procs.append(ctx.Process(target=_snapshotter, args=(name, snapshot, 0.5, results)))
        t0 = time.perf_counter()
        for p in procs:
            with children_ignore_sigint():  # (one at a time: the window where SIGINT is ignored stays short)
                p.start()
        got: list[Result] = []
        snap = None
        deadline = time.monotonic() + timeout
        while len(got) < len(prompts) or snap is None:
            try:
                item = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    # a Ctrl-C to the process group stops the children, and reaches this process
                    # too, sometimes a moment later: give it that moment to arrive (as
                    # KeyboardInterrupt, exit 130) before calling the early stop an error
                    time.sleep(0.5)
                    raise RuntimeError("demo processes stopped before finishing") from None
                continue
            if isinstance(item, Result):
                got.append(item)
                out(f"  request {item.index} done by worker {item.worker} "
                    f"({len(got)}/{len(prompts)})")
            elif item[0] == "prefilled":
                out(f"tokenizer: request 0 prefilled ({item[1]} tokens, nothing cached yet); later requests "
                    "start from the prefix cache; requests go to the workers")
            else:
                snap = item
                out(f"snapshotter: saved {item[3]} sequences, read-only, beside the workers")
        wall = time.perf_counter() - t0
        for p in procs:
            p.join(30)
        # the equality claim: the same tokens as one process without shmkv
        model = _model.Model(cfg)
        prefix = _model.encode(SYSTEM)
        ok = True
        reused = sum(r.reused for r in got)
        total = sum(r.prompt for r in got)
        st = store.stats()
        out(f"prefix cache: {reused} of {total} prompt tokens reused, {total - reused} computed "
            f"({st.prefix_hits} hits, {st.prefix_misses} misses: create_sequence(prefix=...) found them)")
        if st.prefix_hits and st.shared_tokens:
            out(f"shared prefix pages: {st.shared_tokens} tokens ({size(st.bytes_shared)}) read in place from "
                f"another sequence's pages, not copied: {st.shared_tokens / st.prefix_hits:.0f} tokens "
                f"({size(st.bytes_shared / st.prefix_hits)}) a request")
        out("each request's new tokens against a single-process numpy run without shmkv "
            "('matches': the same tokens):")
        for r in sorted(got, key=lambda r: r.index):
            want = _model.reference_generate(model, prefix, _model.encode(prompts[r.index]), new_tokens)
            same = want == r.tokens
            ok &= same
            out(f"  request {r.index} (seq {r.seq_id}, worker {r.worker}, prompt {r.reused} reused + "
                f"{r.prompt - r.reused} computed): {'matches' if same else 'DIFFERENT'}, "
                f"tokens {r.tokens[:10]}{'...' if len(r.tokens) > 10 else ''}")
        for w in range(workers):
            mine = [r for r in got if r.worker == w]
            toks = sum(len(r.tokens) for r in mine)
            secs = sum(r.seconds for r in mine)
            out(f"worker {w}: {len(mine)} requests, {toks} tokens, {toks / secs if secs else 0:.0f} tokens/s")
        where = "" if keep_snapshot else "; removed at the end (--snapshot FILE keeps it)"
        out(f"snapshot: {snap[1]}: {size(snap[2])}, {snap[3]} sequences, written in {snap[4] * 1000:.1f} ms{where}")
        out(f"equal to a single-process run without shmkv: {'yes' if ok else 'NO'} "
            f"(wall time {wall:.1f} s, process start-up included)")
        return {"ok": ok, "tokens": {r.index: r.tokens for r in got}, "snapshot": snap[1] if keep_snapshot else None,
                "store": name}
    except KeyboardInterrupt:
        # a second Ctrl-C (the terminal's to the process group, or timeout's second signal) waits
        # until the clean-up below is done; the caller puts the handler back
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise
    finally:
        for p in procs:
            if p.pid is None:  # never started (a Ctrl-C came first)
                continue
            if p.is_alive():
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        store.close()  # the creator: removes the store's segments
        if not keep_snapshot:
            try:
                os.unlink(snapshot)
            except FileNotFoundError:
                pass
            # an interrupted save's temporary file (its writer is dead: joined above)
            _save.remove_stale_temps(os.path.dirname(snapshot) or ".", os.path.basename(snapshot))
