"""The end-to-end serving benchmark (shmkv/cli/bench/serve.py, tools/bench_serve.py), on a tiny run
through its main().

Timings are never asserted: the run must finish, every mode must produce the same tokens, the JSON
must carry every key the docs name, and the run's stores and temp files must be gone.
Skipped when torch or transformers is missing, except under CI (CI=true), where that is a failure.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import tempfile

import pytest
from conftest import importorskip_unless_ci, save_word_level_checkpoint

from shmkv.testing import shm_entries, start_in_process, unique_name

importorskip_unless_ci("torch")
importorskip_unless_ci("transformers", "5.0")
importorskip_unless_ci("ml_dtypes")

from shmkv.cli.bench import serve, serve_stack  # noqa: E402  (torch is imported inside their functions)

KEYS = ["ttft_p50_ratio", "ttft_p95_ratio", "throughput_ratio", "pss_ratio", "restart_ttft_ratio", "same_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # three stacks of spawned workers importing torch: minutes on a loaded machine
def test_tiny_run_same_tokens_every_key_the_plot_nothing_left(tmp_path, capsys):
    prefix = unique_name("srv")
    temps = set(glob.glob(os.path.join(tempfile.gettempdir(), "bench_serve-*")))
    png = tmp_path / "serve.png"
    drawn = os.environ.get("CI", "").lower() == "true" or importlib.util.find_spec("matplotlib") is not None
    rc = serve.main(["--size", "tiny", "--requests", "4", "--system", "64", "--user", "8", "--new-tokens", "4",
                     "--workers", "1", "--second-every", "4", "--json", "--store-prefix", prefix,
                     *(["--plot", str(png)] if drawn else [])])  # (CI installs the plot extra)
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out.strip().splitlines()[-1])
    for k in KEYS:
        assert k in res, (k, sorted(res))
    assert res["same_tokens"] is True
    if drawn:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in out
    for m in ("baseline", "shmkv", "warm"):
        assert res[f"{m}_ttft_p50_ms"] > 0 and res[f"{m}_ttft_p95_ms"] >= res[f"{m}_ttft_p50_ms"], res
        assert res[f"{m}_requests_per_s"] > 0 and res[f"{m}_pss_peak_mib"] > 0, res
        assert res[f"{m}_cpu_ms_per_request"] > 0, res
        shares = [res[f"{m}_worker_{k}_fraction"] for k in ("busy", "prefix_wait", "queue_empty", "handoff",
                                                               "between", "tail")]
        assert sum(shares) == pytest.approx(1.0) and shares[0] > 0, (m, shares)
        assert 0 < res[f"{m}_workers_on_cpu_fraction"] <= 1, res
        assert res[f"{m}_prompt_ms"] > 0 and res[f"{m}_decode_ms"] > 0, res
    ceiling = (res["baseline_prompt_ms"] + res["baseline_decode_ms"]) / res["shmkv_decode_ms"]
    assert res["throughput_ceiling"] == pytest.approx(ceiling), res
    assert res["baseline_reused_tokens"] == 0
    # request 3 is the next turn of request 0: the shmkv mode reuses the system prompt on every request
    # but the first, and request 0's whole turn on request 3; warm has everything cached
    assert res["shmkv_reused_tokens"] >= 2 * 64 + (64 + 8 + 3), res
    assert res["warm_reused_tokens"] > res["shmkv_reused_tokens"], res
    assert not {e for e in shm_entries() if e.startswith(f"skv_{prefix}")}, "a store of the run is left"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "bench_serve-*"))) <= temps, "temp dir left"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_model_path_runs_a_local_checkpoint_on_its_tokenizers_text(tmp_path, capsys):
    """--model PATH: the checkpoint's config and weights in every worker, the prompts the benchmark's
    text through the checkpoint's tokenizer (no download); every mode the same tokens."""
    import re

    words = re.findall(r"\w+|[^\w\s]", (serve_stack.TEXT + " ".join(serve_stack.QUESTIONS)).lower())
    model_dir = tmp_path / "checkpoint"
    tok = save_word_level_checkpoint(model_dir, words + ["question", ":"] + [str(i) for i in range(4)])
    prefix = unique_name("srvp")
    rc = serve.main(["--model", str(model_dir), "--requests", "4", "--system", "40", "--user", "8",
                     "--new-tokens", "4", "--workers", "1", "--json", "--store-prefix", prefix])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"model {model_dir}: 2 layers, hidden 64, vocab {len(tok)}" in out, out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["same_tokens"] is True, res
    assert res["shmkv_reused_tokens"] >= 3 * 32, res  # the system prompt (its 16-token blocks) reused
    system, users = serve_stack.token_ids(argparse.Namespace(seed=0, system=40, user=8, requests=4), 0, tok)
    assert len(system) == 40 and system[0] == tok.bos_token_id and tok.unk_token_id not in system, system
    assert [len(u) for u in users] == [8] * 4 and tok.convert_ids_to_tokens(users[0][:2]) == ["question", "0"]
    assert not {e for e in shm_entries() if e.startswith(f"skv_{prefix}")}, "a store of the run is left"


def test_device_cuda_without_a_gpu_is_one_line_and_exit_0(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: the cuda run is the benchmark itself")

    def made(*args: object, **kwargs: object) -> None:
        raise AssertionError("the skipped run began its work (a directory, the stack of processes)")

    monkeypatch.setattr(serve.tempfile, "mkdtemp", made)
    monkeypatch.setattr(serve, "Stack", made)
    assert serve.main(["--device", "cuda", "--quick"]) == 0
    assert capsys.readouterr().out == "bench_serve: --device cuda: torch sees no GPU here, skipped\n"


OTHER_SHAPES = {  # a head_dim of its own (not hidden / heads), key/value heads left unset (= heads)
    "head_dim": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "no_kv_heads": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=None),
}


@pytest.mark.parametrize("shape", [*sorted(serve.MODELS), *OTHER_SHAPES])
def test_output_share_counts_the_weights_a_decode_step_reads(shape):
    """output_share, from the config alone, against the parameters of the model built from it: the
    output layer over itself plus every decoder layer's projections (not the norms, not the embedding)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**serve.MODELS.get(shape) or OTHER_SHAPES[shape])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    read = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and p.dim() == 2)
    out = model.lm_head.weight.numel()
    assert serve.output_share(config) == pytest.approx(out / (out + read))


def test_output_share_of_another_family_is_unknown_and_the_header_says_nothing():
    from transformers import GPT2Config

    assert serve.output_share(GPT2Config()) is None and serve._share_note(GPT2Config()) == ""


def test_workload_second_turns_follow_earlier_requests():
    reqs = serve_stack.workload([1, 2, 3], [[i] for i in range(12)], every=4, lag=5)
    assert [(r.rid, r.parent) for r in reqs if r.parent is not None] == [(7, 2), (11, 6)]
    assert all(r.parent is None for r in serve_stack.workload([1], [[i] for i in range(8)], every=0, lag=1))


def test_worker_memory_counts_the_store_once():
    """The store counts once and in full, whether or not a worker's Pss holds its pages: the workers'
    Pss share of the store mappings is swapped for the store's resident bytes."""
    import numpy as np

    import shmkv

    name = unique_name("srvm")
    with shmkv.create(name, layers=8, kv_heads=2, head_dim=64, dtype="float32", max_tokens=4096) as store:
        seq = store.create_sequence(capacity=2048)
        seq.extend(np.ones((8, 2048, 2, 64), np.float32), np.ones((8, 2048, 2, 64), np.float32))
        held = serve_stack.store_bytes(name)
        assert held >= 8 * 2048 * 2 * 64 * 4 * 2  # K and V of every layer: 16 MiB
        slack = 4 * 2**20
        before = serve_stack._rollup_kb(os.getpid())["Pss"] * 1024
        counted, anon = serve_stack.worker_memory([os.getpid()], name)
        assert abs(counted - (before + held)) < slack, (counted, before, held)  # pages not mapped here yet
        assert anon >= held
        views = [seq.kv(i) for i in range(8)]  # held while measuring: a view may map pages of its own
        assert sum(float(k.sum() + v.sum()) for k, v in views) == 2 * 8 * 2048 * 2 * 64  # every page read here
        after = serve_stack._rollup_kb(os.getpid())["Pss"] * 1024
        assert after - before > held - slack  # this process's Pss now holds the store's pages ...
        counted_after, _ = serve_stack.worker_memory([os.getpid()], name)
        assert abs(counted_after - counted) < slack, (counted_after, counted)  # ... and they still count once
        seq.free()


def test_wait_hint_waits_only_for_more_than_the_cache_holds():
    system = [1, 2, 3, 4, 5, 6]
    assert serve_stack.wait_hint([*system, 9], [[*system, 8]], []) == 6  # the first requests: the system prompt
    assert serve_stack.wait_hint([*system, 9], [[*system, 8]], [[*system, 7, 7]]) == 0  # cached already
    assert serve_stack.wait_hint([*system, 9], [[*system, 9, 5]], [[1, 2]]) == 6  # at most len - 1
    assert serve_stack.wait_hint([*system, 9], [], []) == 0


def test_await_prefix_sleeps_until_another_processes_prefill_commits(tmp_path):
    """A worker whose prompt shares a prefix with another process's prefill in progress sleeps on that
    sequence and wakes when the prefill commits with its ids: the store then holds the shared prefix."""
    import numpy as np
    from procs.serve import await_then_match
    from test_wait import wait_for_file

    import shmkv

    name = unique_name("srvw")
    prompt = list(range(3, 43))
    ready = str(tmp_path / "sleeping")
    with shmkv.create(name, layers=2, kv_heads=2, head_dim=8, dtype="float32", max_tokens=1024) as store:
        seq = store.create_sequence(capacity=64)  # this process's prefill in progress: nothing committed
        child = start_in_process(await_then_match, name, [*prompt, 7, 8], len(prompt), ready, timeout=120)
        wait_for_file(ready, child)  # the child sleeps on it
        assert store.match_prefix([*prompt, 7, 8]) == 0
        k = np.ones((2, len(prompt), 2, 8), np.float32)
        seq.extend(k, k, tokens=prompt)
        held, sleeps = child.result()
        assert held == len(prompt) and sleeps >= 1
        seq.free()


def test_worker_time_splits_each_workers_window():
    T = serve_stack.Times
    run = serve_stack.Run("shmkv", workers=3, t0=100.0, last=110.0)
    # worker 1: busy from the start, 0.5 s from an answer to its next get, busy to the end
    # worker 2: 2 s asleep on a prefix in flight; later 2 s in get before the scheduler queued, 0.5 s handoff
    # worker 3: answered nothing
    for rid, pid, put, t in [(0, 1, 100.0, T(99.0, 100.0, 100.0, 100.0, 101.0, 104.0)),
                             (2, 1, 100.0, T(104.5, 104.5, 104.5, 104.5, 105.0, 110.0)),
                             (1, 2, 100.0, T(100.0, 100.0, 102.0, 102.0, 103.0, 105.0)),
                             (3, 2, 107.0, T(105.0, 107.5, 107.5, 107.5, 108.0, 109.0))]:
        run.times[rid], run.pid[rid], run.put[rid] = t, pid, put
    got = serve_stack.worker_time(run)
    want = {"busy": 14.0, "prefix_wait": 2.0, "queue_empty": 2.0, "handoff": 0.5, "between": 0.5, "tail": 11.0}
    assert got == pytest.approx({k: v / 30 for k, v in want.items()})
    assert sum(got.values()) == pytest.approx(1.0)


def test_cpu_shares_of_the_window():
    run = serve_stack.Run("baseline", workers=2, cpu_window=(10.0, 15.0, 12.0, 6.0, 1.0))
    assert serve_stack.cpu_shares(run) == pytest.approx({
        "workers_on_cpu_fraction": 0.6, "workers_runqueue_fraction": 0.3, "workers_asleep_fraction": 0.1,
        "scheduler_cores": 0.1, "other_cores": 0.2})


def test_cpu_seconds_counts_this_process_on_a_cpu():
    import time

    before = serve_stack.cpu_seconds([os.getpid()])
    start = time.process_time()
    while time.process_time() - start < 0.2:  # spin: CPU time, not a wait
        pass
    machine, on_cpu, _ready, me = (b - a for a, b in zip(before, serve_stack.cpu_seconds([os.getpid()]), strict=True))
    assert on_cpu >= 0.19 and me >= 0.17, (on_cpu, me)  # os.times counts clock ticks (10 ms)
    assert machine >= 0.17, machine
