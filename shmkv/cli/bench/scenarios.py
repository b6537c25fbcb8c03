"""The scenarios of ``shmkv bench`` by name: what each one's baseline is, in one sentence, what
each needs beyond the core install, the /dev/shm room each needs, and which run only when named."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable

from .cases import (bench_copy_prefix, bench_decode, bench_handoff, bench_prefill, bench_snapshot,
                    bench_truncate)
from .cases_more import (TABLE_SIZES, bench_hf, bench_prefix, bench_quant, bench_remote, bench_table,
                         bench_wait, bench_workers, has_wait)
from .serve import bench_serve
from .timing import Figures

__all__ = ["BASELINES", "EXTRAS", "OPT_IN", "SCENARIOS", "SHM_MARGIN", "SHM_NEEDS", "TABLE_SIZES", "has_wait",
           "lacking"]

BASELINES = {
    "hf": "transformers' DynamicCache in model.generate() of the same tiny random-weight Llama, 256 new tokens, "
          "interleaved, batch 1 and batch 4 (the same tokens checked first)",
    "prefix": "match_prefix of a 300-token prompt with 16 and with 1000 finished sequences cached (flat goal); "
              "time to first token of the demo's model with the 250-token system prompt cached vs computed; "
              "reading a stitched view (a donor's pages + own pages in one array) vs a plain view of the "
              "same bytes; 32 requests over a cached 2,048-token prompt: /dev/shm bytes held vs the distinct "
              "tokens' bytes, and each create vs a one-token extend",
    "serve": "the same requests on the same workers with transformers' DynamicCache, no reuse between requests",
    "remote": "redis-py GET / pipelined SET of the same chunk bytes on the same throwaway redis-server",
    "decode": "the same per-token K/V slices written into preallocated numpy arrays in this process, "
              "taking the [0:t+1] views attention reads (and, for reference, np.concatenate growth)",
    "truncate": "the same append-one-token-to-every-layer + commit steps without the truncate: "
                "truncate_step_us is what the rollback adds per step",
    "handoff": "multiprocessing.Queue.put and Connection.send_bytes of the same K/V arrays to a receiver that is "
               "already started and waiting, timed from the sender's first call to the receiver holding the "
               "data; shmkv's receiver also reads every byte, compared with mmap-ing and reading a plain "
               "/dev/shm file of the same size",
    "copy_prefix": "np.copyto of the same number of bytes between two preallocated arrays",
    "snapshot": "save: np.save of the same bytes + fsync + atomic rename + directory fsync (the same promise); "
                "load: os.sendfile of the snapshot file into a fresh /dev/shm file (the physical limit) and "
                "np.load into anonymous memory",
    "prefill": "os.pwrite of the same bytes into a fresh /dev/shm file (tmpfs then allocates pages without "
               "zeroing them: the physical limit); first-touch numpy copies shown for reference",
    "workers": "the same decode workers with no snapshotter running, alternated run by run, at N = cores - 1 "
               "and N = cores workers",
    "quant": "a float16 store of the same shape: extend (write), every value of every layer's K and V read, "
             "and decode steps (one token appended to every layer, commit) at the prefilled context, in a "
             "process that has freed a large array before (as one running a model has)",
    "table": "none (absolute times per operation at 16, 256 and 4096 sequences: flat is the goal)",
    "wait": "a bare pipe: the same kind of process (spawned, asleep) blocked in os.read of a pipe, woken by "
            "one byte written into it, measured the same way as the commit that wakes a seq.wait of a read-write "
            "and of a read-only attachment (alternated; the waker timed from just before its call, the woken "
            "process from its return); attach: shmkv.attach in a fresh spawned and a fresh forked process "
            "(median of 8 each); an idle waiter's wake-ups counted by the kernel (voluntary context switches)",
}


SCENARIOS: dict[str, Callable[[bool], Figures]] = {
    "decode": bench_decode,
    "truncate": bench_truncate,
    "handoff": bench_handoff,
    "copy_prefix": bench_copy_prefix,
    "snapshot": bench_snapshot,
    "prefill": bench_prefill,
    "workers": bench_workers,
    "quant": bench_quant,
    "table": bench_table,
    "wait": bench_wait,
    "prefix": bench_prefix,
    "remote": bench_remote,
    "hf": bench_hf,
    "serve": bench_serve,
}

# Scenarios a plain `shmkv bench` leaves out (they take minutes): only `--only NAME` runs them.
OPT_IN = {"serve"}

_MiB = 1 << 20
_TOK = 16 * 8 * 128 * 2 * 2  # bytes of one token of the 16-layer float16 shapes (K and V): 64 KiB

# Peak /dev/shm bytes each scenario holds at once (stores and baseline files), by --quick
# or not: measured in a private tmpfs (decode 16 MiB quick, handoff 256,
# copy_prefix 192, snapshot 128, prefill 128, workers 384 on 2 cores, quant 24.3, table
# 12, prefix 28, remote 256; without --quick decode 64, copy_prefix 384, snapshot 256, quant 97,
# workers 512 on 2 cores) and written as the shapes' arithmetic, which gives the same figures. The driver
# refuses up front, saying how much, when /dev/shm has less free (plus SHM_MARGIN).
SHM_NEEDS: dict[str, Callable[[bool], int]] = {
    "decode": lambda quick: 32 * 8 * 128 * 2 * 2 * (128 if quick else 512),
    "truncate": lambda quick: 16 * _MiB,
    "handoff": lambda quick: 2 * 2048 * _TOK,  # the store and a plain /dev/shm file of the same bytes
    "copy_prefix": lambda quick: 3 * (1024 if quick else 2048) * _TOK,
    "snapshot": lambda quick: 2 * (1024 if quick else 2048) * _TOK,
    "prefill": lambda quick: 2048 * _TOK,  # the store or the pwrite file, never both
    "workers": lambda quick: (os.cpu_count() or 1) * (1024 + (2048 if quick else 3072)) * _TOK,
    # a float16 store and an int8 one (codes and a float32 scale per token and head), K and V
    "quant": lambda quick: (512 if quick else 2048) * 2 * 8 * 8 * (128 * 2 + 128 + 4),
    "table": lambda quick: 16 * _MiB,
    "wait": lambda quick: 4 * _MiB,
    "prefix": lambda quick: 32 * _MiB,
    "remote": lambda quick: 2 * 2048 * _TOK,  # two stores: the pusher's and the puller's
    "hf": lambda quick: 16 * _MiB,
    # one store at a time; the warm restart's, the largest, held 210 MiB at the quick size (S = 2048,
    # W = 2); the full sweep's S = 4096 and W = 4 points hold more (estimated, not measured)
    "serve": lambda quick: (256 if quick else 768) * _MiB,
}
SHM_MARGIN = 16 * _MiB  # headers, tables, the allocator's rounding

# What a scenario needs beyond `pip install shmkv`: (Python modules, programs on PATH, how to get them).
# The driver skips a scenario that lacks one before any scenario runs, with one line saying so.
EXTRAS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "remote": (("redis",), ("redis-server",),
               "the redis extra and a redis-server: pip install 'shmkv[redis]'; apt-get install redis-server"),
    "hf": (("torch", "transformers"), (), "the transformers extra: pip install torch 'shmkv[transformers]'"),
    "serve": (("torch", "transformers"), (), "the transformers extra: pip install torch 'shmkv[transformers]'"),
    "quant": (("numba",), (), "the fast extra (numba: int8's compiled loops): pip install 'shmkv[fast]'"),
}


def lacking(name: str) -> str | None:
    """None if scenario ``name`` can run here, else why not in one line: what is missing, how to get it."""
    if name == "wait" and not has_wait():
        return "this version of shmkv has no Sequence.wait"
    modules, programs, how = EXTRAS.get(name, ((), (), ""))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    missing += [f"{p} (not on PATH)" for p in programs if shutil.which(p) is None]
    return f"needs {how} (missing: {', '.join(missing)})" if missing else None
