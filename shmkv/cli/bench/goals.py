"""The goals ``shmkv bench`` checks: the project's performance targets, each a bound on one
figure of the report, with what that figure measures (printed beside a MISSED goal and by
``shmkv bench --goals``). Ratios compare shmkv with a baseline timed in the same run."""

from __future__ import annotations

from .scenarios import TABLE_SIZES

# key -> (comparison, bound)
GOALS: dict[str, tuple[str, float]] = {
    "decode_ratio": ("<=", 1.5),
    "truncate_step_us": ("<=", 30.0),
    "handoff_ms": ("<", 1.0),
    "handoff_read_ratio": ("<=", 1.5),
    **{f"create_sequence_us_{n}": ("<=", 100.0) for n in TABLE_SIZES},
    **{f"free_us_{n}": ("<=", 100.0) for n in TABLE_SIZES},
    **{f"open_sequence_us_{n}": ("<=", 10.0) for n in TABLE_SIZES},
    "sequences_us_per_seq": ("<=", 5.0),
    "copy_prefix_ratio": (">=", 0.8),
    "save_ratio": (">=", 0.9),
    "load_vs_limit": (">=", 0.8),
    "prefill_vs_limit": (">=", 0.8),
    "snapshotter_overhead": ("<", 0.10),
    "prefix_lookup_us_16": ("<=", 50.0 + 300 / 16),
    "prefix_lookup_us_1000": ("<=", 50.0 + 300 / 16),
    "stitched_read_ratio": (">=", 0.9),
    "prefix_memory_ratio": ("<=", 1.25),
    "prefix_request_vs_extend1": ("<=", 20.0),
    "remote_pull_ratio": (">=", 0.7),
    "remote_push_ratio": (">=", 0.7),
    "int8_step_ratio": ("<=", 2.0),
    "quantize_ratio": (">=", 0.25),
    "wait_vs_pipe": ("<=", 3.0),
    "wait_readonly_vs_pipe": ("<=", 3.0),
    "idle_waiter_wakeups_per_s": ("<=", 1.0),
    "idle_readonly_waiter_wakeups_per_s": ("<=", 1.0),
    "attach_ms_spawn": ("<", 1.0),  # shmkv.attach in a fresh spawned process (docs/design.md §7: under 1 ms)
    "attach_ms_fork": ("<", 1.0),  # ... in a child forked from a process holding the store
    "create_sequence_flat": ("<=", 1.2),
    "hf_generate_ratio": ("<=", 1.1),
    "hf_generate_ratio_b4": ("<=", 1.3),
    "ttft_p50_ratio": ("<=", 0.2),
    "throughput_ratio": (">=", 2.0),
    "pss_ratio": ("<=", 1.0),
    "restart_ttft_ratio": ("<=", 1.5),
    "same_tokens": (">=", 1.0),
}

_TABLE = "with {n} sequences in the store, in microseconds"
# key -> what the figure measures, in a sentence a user can check the goal against
WHAT: dict[str, str] = {
    "decode_ratio": "time of a decode step (append one token to 32 layers + commit) / the same writes into "
                    "preallocated numpy arrays",
    "truncate_step_us": "microseconds a speculative rollback (truncate) adds to a decode step",
    "handoff_ms": "milliseconds for another process to attach a 128 MiB sequence and get its views",
    "handoff_read_ratio": "time to read every byte of the handed-over sequence / reading a plain /dev/shm file",
    **{f"create_sequence_us_{n}": "one create_sequence() " + _TABLE.format(n=n) for n in TABLE_SIZES},
    **{f"free_us_{n}": "one Sequence.free() " + _TABLE.format(n=n) for n in TABLE_SIZES},
    **{f"open_sequence_us_{n}": "one store.sequence(id) " + _TABLE.format(n=n) for n in TABLE_SIZES},
    "sequences_us_per_seq": "microseconds store.sequences() takes per sequence listed (the worst table size)",
    "copy_prefix_ratio": "copy_prefix bandwidth / np.copyto of the same bytes",
    "save_ratio": "snapshot save bandwidth / np.save + fsync + atomic rename of the same bytes",
    "load_vs_limit": "snapshot load bandwidth / sendfile of the file into a fresh /dev/shm file (the limit)",
    "prefill_vs_limit": "time of pwrite into a fresh /dev/shm file (the limit) / time to prefill a new store",
    "snapshotter_overhead": "decode throughput lost by workers (cores - 1 of them) while a snapshotter saves "
                            "the store in a loop",
    "prefix_lookup_us_16": "microseconds of match_prefix() for a 300-token prompt with 16 sequences cached",
    "prefix_lookup_us_1000": "microseconds of match_prefix() for a 300-token prompt with 1000 sequences cached",
    "stitched_read_ratio": "reading a plain view / reading a view stitched from shared prefix pages",
    "prefix_memory_ratio": "/dev/shm bytes held by 32 requests sharing a 2,048-token prefix / their distinct "
                           "tokens' bytes",
    "prefix_request_vs_extend1": "create_sequence(prefix=) over a cached 2,048-token prefix / one one-token "
                                 "extend",
    "remote_pull_ratio": "redis-py pipelined GET time / shmkv's pull of the same bytes",
    "remote_push_ratio": "redis-py pipelined SET time / shmkv's push of the same bytes",
    "int8_step_ratio": "time of an int8 decode step at 2,048 tokens / a float16 store's",
    "quantize_ratio": "float16 extend time / int8 extend time (int8 quantizes on the way in)",
    "wait_vs_pipe": "Sequence.wait wake-up time after a commit / a process woken by a pipe",
    "wait_readonly_vs_pipe": "the same for a read-only attachment",
    "idle_waiter_wakeups_per_s": "times a second an idle Sequence.wait wakes up (0 is best)",
    "idle_readonly_waiter_wakeups_per_s": "the same for a read-only attachment",
    "attach_ms_spawn": "milliseconds of shmkv.attach in a fresh spawned process (median of 8)",
    "attach_ms_fork": "milliseconds of shmkv.attach in a child forked from a process that holds the store",
    "create_sequence_flat": "create_sequence time with 4096 sequences / with 16 (flat: 1.0)",
    "hf_generate_ratio": "model.generate() time with ShmkvCache / with DynamicCache, batch 1",
    "hf_generate_ratio_b4": "the same at batch 4",
    "ttft_p50_ratio": "serving (shmkv bench --only serve): median time to first token with one shared store "
                      "(ShmkvCache.for_prompt) / with DynamicCache, 2 workers, a 2,048-token system prompt",
    "throughput_ratio": "serving: requests answered per second with the shared store / with DynamicCache",
    "pss_ratio": "serving: the workers' peak memory (summed Pss, the store counted once in full) with the "
                 "shared store / with DynamicCache",
    "restart_ttft_ratio": "serving: median time to first token after a warm restart from a snapshot / before it",
    "same_tokens": "serving: 1 when every request produced the same tokens in every mode (DynamicCache, "
                   "shared store, warm restart), else 0",
}


def met(val: float, goal: tuple[str, float]) -> bool:
    op, bound = goal
    return {"<=": val <= bound, "<": val < bound, ">=": val >= bound}[op]


def listing() -> str:
    """Every goal, its bound and what it measures (``shmkv bench --goals``)."""
    return "\n".join(f"{k:<36} {op} {bound:g}\n    {WHAT[k]}" for k, (op, bound) in GOALS.items())
