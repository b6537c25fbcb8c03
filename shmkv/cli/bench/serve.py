"""End-to-end serving benchmark: a real transformers architecture, W decode worker processes, a chat workload.

The scheduler (this module's main process) queues R requests; W worker processes take them from a
``multiprocessing`` queue (spawn) and answer each with ``model.generate`` (greedy, G new tokens).
Every request starts with the same system prompt of S tokens and has its own user turn of U
tokens; every ``--second-every``-th request is the next turn of an earlier one (its prompt: the
earlier prompt, that request's answer, a new user turn), queued once the earlier answer is in.
Three modes, the same requests in the same order:

* baseline: each worker runs ``generate`` with transformers' ``DynamicCache``, no reuse;
* shmkv: the workers share one store; ``ShmkvCache.for_prompt`` starts each request from the
  longest prefix any process cached (a prompt is cached from its prefill on), ``cache.finish``
  keeps each finished request cached; a request that shares a longer prefix with one in flight
  than with the cached ones (the first requests: the system prompt) waits for that prefill
  instead of computing the same prefix again (the wait counts in its TTFT);
* warm: the shmkv stack's store saved by a snapshotter process (``shmkv snapshot --count 1``),
  every process stopped and the store removed, a new stack started from the snapshot file
  (``shmkv.load``), the same requests again.

Reported per mode: TTFT (time to first token, from the moment a worker takes the request off the
queue to the first generated token, timed by a streamer: it includes ``for_prompt``), p50/p95;
requests/s and generated tokens/s (from the first request queued to the last answer); worker memory
(the summed Pss of the worker processes, ``/proc/PID/smaps_rollup``, with the store's pages counted
once and in full: the workers' Pss of the store mappings is replaced by the store's resident bytes
in /dev/shm), the peak over samples every 0.2 s and at the end while the workers are alive; and
whether every mode produced exactly the same token ids. Ratios are mode / baseline (for TTFT and
memory lower is better, for throughput higher), restart_ttft_ratio is warm / shmkv.

    python -m shmkv.cli.bench.serve --quick [--json] [--plot docs/serve.png]
    python -m shmkv.cli.bench.serve                  # full: S = 256, 1024, 2048, 4096 at W = 2; W = 1, 4 at S = 2048
    python -m shmkv.cli.bench.serve --model PATH     # a local checkpoint and its tokenizer (no network)
    python -m shmkv.cli.bench.serve --device cuda    # model on the GPU, the store as the cross-process tier

The last line with --json is one JSON object (the headline point: S = 2048, W = 2). Stores and the
snapshot files are the run's own (names from --store-prefix, files in a temp directory), removed at
the end, on errors and on Ctrl-C. Needs ``pip install 'shmkv[transformers]'`` (and the plot extra for --plot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from .args import png_arg
from .serve_stack import Run, Stack, cpu_shares, serve, store_bytes, token_ids, worker_time, workload

MODELS: dict[str, dict[str, Any]] = {
    # initializer_range 0.2 (HF default 0.02): peaky logits, so greedy choices are not near-ties that
    # a different summation order (a prompt computed in another forward) could flip.
    # "small": the output layer is 27% of the weights a decode step reads (output_share), about the
    # largest share among published small models of this family (Qwen2.5-0.5B 28%, SmolLM2-135M and
    # Llama-3.2-1B 21%, TinyLlama 6%); "small-v32k": the same layers with a 32,000-token vocabulary,
    # where it is 74% and each decode step mostly reads the output layer.
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4),
    "small-v32k": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
MODES = ("baseline", "shmkv", "warm")
GOALS = {  # quick size, S = 2048, W = 2, on a 2-core CPU machine
    "ttft_p50_ratio": ("<=", 0.2), "throughput_ratio": (">=", 2.0), "pss_ratio": ("<=", 1.0),
    "restart_ttft_ratio": ("<=", 1.5), "same_tokens": ("==", True),
}


# -- one point (S, W): the three modes, alternated over repeats ---------------------------------------


def point(stack: Stack, a: argparse.Namespace, config: Any, model_dir: str, tokenizer: Any) -> dict[str, Any]:
    import shmkv
    from shmkv.transformers import ShmkvCache

    system, users = token_ids(a, config.vocab_size, tokenizer)
    reqs = workload(system, users, a.second_every, 2 * a.workers + 1)
    longest = max(len(system) + (1 + (r.parent is not None)) * (a.user + a.new_tokens) for r in reqs)
    cap = dict(max_tokens=2 * (len(reqs) * (longest + 64) + 4096), max_seqs=2 * len(reqs) + 4 * a.workers + 8)
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    print(f"  S = {a.system}, W = {a.workers}: {len(reqs)} requests, "
          f"{sum(r.parent is not None for r in reqs)} of them second turns", flush=True)
    for rep in range(a.repeats):
        tag = f"{rep % 10}{a.workers}"
        order = ["baseline", "shmkv"] if rep % 2 == 0 else ["shmkv", "baseline"]
        for mode in order:
            print(f"    {mode} ...", flush=True)
            if mode == "baseline":
                runs[mode].append(serve(stack, a, mode, model_dir=model_dir, store=None, system=system, reqs=reqs))
                continue
            name, snap = f"{a.store_prefix}s{tag}", os.path.join(stack.tmp, "snapshots", f"run{tag}.shmkv")
            os.makedirs(os.path.dirname(snap), exist_ok=True)
            owner = ShmkvCache.from_config(config, name, **cap)  # the model's dtype
            stack.stores.append(owner)
            runs["shmkv"].append(serve(stack, a, "shmkv", model_dir=model_dir, store=name, system=system, reqs=reqs,
                                       snapshot=snap))
            stack.stop()  # every process stopped, the store removed
            assert store_bytes(name) == 0, f"store {name} outlived its stack"
            print("    warm restart ...", flush=True)
            t = time.monotonic()
            wname = f"{a.store_prefix}w{tag}"
            stack.stores.append(shmkv.load(snap, wname, **cap))
            load_s = time.monotonic() - t
            os.unlink(snap)
            run = serve(stack, a, "warm", model_dir=model_dir, store=wname, system=system, reqs=reqs)
            run.restart_s += load_s
            runs["warm"].append(run)
            stack.stop()
    return summarize(a, runs)


def summarize(a: argparse.Namespace, runs: dict[str, list[Run]]) -> dict[str, Any]:
    """Per mode the median over repeats of each figure; the ratios; same_tokens over every run."""
    ref = runs["baseline"][0].tokens
    res: dict[str, Any] = {"system": a.system, "workers": a.workers, "requests": a.requests, "user": a.user,
                           "new_tokens": a.new_tokens, "repeats": a.repeats,
                           "same_tokens": all(r.tokens == ref for rs in runs.values() for r in rs)}
    med = statistics.median
    for m, rs in runs.items():
        res[m] = {
            "ttft_p50_ms": med(r.ttft_pct(0.5) for r in rs) * 1e3,
            "ttft_p95_ms": med(r.ttft_pct(0.95) for r in rs) * 1e3,
            "requests_per_s": med(r.requests_per_s for r in rs),
            "tokens_per_s": med(r.new_tokens / r.seconds for r in rs),
            "cpu_ms_per_request": med(r.cpu_per_request for r in rs) * 1e3,
            "pss_peak_mib": med(r.mem_peak for r in rs) / 2**20,
            "pss_end_mib": med(r.mem_end for r in rs) / 2**20,
            "anon_peak_mib": med(r.anon_peak for r in rs) / 2**20,
            "store_mib": med(r.store_end for r in rs) / 2**20,
            "reused_tokens": med(sum(r.reused.values()) for r in rs),
            "ttft_ms": [t * 1e3 for r in rs for t in r.ttft],
            # a request's time in its worker: the prompt (from the cache made to the first token: what
            # a prefix cache can save) and the decode (the other tokens: what none can)
            "prompt_ms": med(statistics.mean(t.first - t.gen for t in r.times.values()) for r in rs) * 1e3,
            "decode_ms": med(statistics.mean(t.end - t.first for t in r.times.values()) for r in rs) * 1e3,
        }
        shares = [worker_time(r) for r in rs]
        res[m].update({f"worker_{k}_fraction": med(x[k] for x in shares) for k in shares[0]})
        cpus = [cpu_shares(r) for r in rs]
        res[m].update({k: med(x[k] for x in cpus) for k in cpus[0]})
        if m == "warm":
            res[m]["restart_s"] = med(r.restart_s for r in rs)
    b, s, w = res["baseline"], res["shmkv"], res["warm"]
    res.update(ttft_p50_ratio=s["ttft_p50_ms"] / b["ttft_p50_ms"], ttft_p95_ratio=s["ttft_p95_ms"] / b["ttft_p95_ms"],
               throughput_ratio=s["requests_per_s"] / b["requests_per_s"],
               cpu_throughput_ratio=b["cpu_ms_per_request"] / s["cpu_ms_per_request"],
               pss_ratio=s["pss_peak_mib"] / b["pss_peak_mib"], pss_end_ratio=s["pss_end_mib"] / b["pss_end_mib"],
               anon_ratio=s["anon_peak_mib"] / b["anon_peak_mib"],
               restart_ttft_ratio=w["ttft_p50_ms"] / s["ttft_p50_ms"],
               warm_throughput_ratio=w["requests_per_s"] / b["requests_per_s"],
               on_cpu_ratio=s["workers_on_cpu_fraction"] / b["workers_on_cpu_fraction"],
               # the throughput ratio if the shmkv mode's prompts cost nothing: a baseline request's
               # prompt and decode over the shmkv mode's decode alone
               throughput_ceiling=(b["prompt_ms"] + b["decode_ms"]) / s["decode_ms"])
    return res


def report(res: dict[str, Any]) -> None:
    print(f"  {'mode':<9} {'TTFT p50 ms':>11} {'p95 ms':>8} {'req/s':>7} {'tok/s':>7} {'CPU ms/req':>10} "
          f"{'Pss peak MiB':>12} "
          f"{'end MiB':>8} {'anon MiB':>8} {'store MiB':>9} {'reused':>7}")
    for m in MODES:
        r = res[m]
        print(f"  {m:<9} {r['ttft_p50_ms']:>11.1f} {r['ttft_p95_ms']:>8.1f} {r['requests_per_s']:>7.2f} "
              f"{r['tokens_per_s']:>7.1f} {r['cpu_ms_per_request']:>10.0f} {r['pss_peak_mib']:>12.1f} "
              f"{r['pss_end_mib']:>8.1f} "
              f"{r['anon_peak_mib']:>8.1f} {r['store_mib']:>9.1f} {r['reused_tokens']:>7.0f}")
    for m in MODES:
        r = res[m]
        print(f"  {m:<9} workers busy {r['worker_busy_fraction']:.0%} of the window; idle: prefix wait "
              f"{r['worker_prefix_wait_fraction']:.0%}, queue empty {r['worker_queue_empty_fraction']:.0%}, "
              f"handoff {r['worker_handoff_fraction']:.0%}, between {r['worker_between_fraction']:.0%}, "
              f"tail {r['worker_tail_fraction']:.0%}")
        print(f"  {'':<9} each worker on a CPU {r['workers_on_cpu_fraction']:.0%} of the window, waiting for "
              f"a core {r['workers_runqueue_fraction']:.0%}, asleep {r['workers_asleep_fraction']:.0%}; the scheduler "
              f"used {r['scheduler_cores']:.2f} cores, other processes {r['other_cores']:.2f}")
    print(f"  ratios: ttft_p50 {res['ttft_p50_ratio']:.3f}, ttft_p95 {res['ttft_p95_ratio']:.3f}, "
          f"throughput {res['throughput_ratio']:.2f} (CPU time per request: {res['cpu_throughput_ratio']:.2f}, "
          f"times the workers' share of the CPU: {res['on_cpu_ratio']:.2f}), "
          f"pss {res['pss_ratio']:.3f} (end {res['pss_end_ratio']:.3f}, "
          f"anon {res['anon_ratio']:.3f}), "
          f"restart_ttft {res['restart_ttft_ratio']:.2f} (restart {res['warm']['restart_s']:.1f} s); "
          f"same_tokens {res['same_tokens']}", flush=True)
    b, s = res["baseline"], res["shmkv"]
    print(f"  a request in its worker: prompt {b['prompt_ms']:.0f} ms and decode {b['decode_ms']:.0f} ms "
          f"(baseline), {s['prompt_ms']:.0f} and {s['decode_ms']:.0f} ms (shmkv): prompts that cost nothing "
          f"would give throughput {res['throughput_ceiling']:.2f} (the ceiling of any prefix cache here)",
          flush=True)


# -- the run -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one point, S = 2048, W = 2, 24 requests (about a minute)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.add_argument("--plot", metavar="PNG", type=png_arg,
                   help="write the TTFT distribution, throughput and memory bars here (needs the plot extra)")
    p.add_argument("--model", metavar="PATH", help="a local checkpoint directory with its tokenizer "
                   "(default: a random-weight Llama from a config, seed --seed)")
    p.add_argument("--size", choices=sorted(MODELS), default="small",
                   help="the random model: small (4 layers, hidden 256, vocab 4,096), small-v32k (the same layers, "
                   "vocab 32,000), tiny (the tests'); the run's first line gives its output layer's share of the "
                   "weights a token reads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (skipped when torch sees no GPU)")
    p.add_argument("--requests", type=int, help="R (default 24 quick, 32 full)")
    p.add_argument("--system", type=int, help="S, the system prompt's tokens (default 2048; full: a sweep)")
    p.add_argument("--user", type=int, default=64, help="U, tokens of each user turn")
    p.add_argument("--new-tokens", type=int, default=32, help="G, greedy new tokens per request")
    p.add_argument("--workers", type=int, help="W decode worker processes (default 2; full: a sweep)")
    p.add_argument("--second-every", type=int, default=4,
                   help="every K-th request is the next turn of an earlier request (0: none)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each mode, alternated (figures: median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store-prefix", default=f"serve{os.getpid() % 1_000_000}",
                   help="names of the run's stores start with this (at most 19 characters)")
    a = p.parse_args(argv)
    try:
        import torch
        from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging
    except ImportError as e:
        print(f"bench_serve: needs torch and transformers ({e}): pip install 'shmkv[transformers]'")
        return 1
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_serve: --device cuda: torch sees no GPU here, skipped")
        return 0
    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    sizes = [(a.system or 2048, a.workers or 2)]
    if not a.quick and a.system is None and a.workers is None:  # the full sweep, headline first
        sizes += [(s, 2) for s in (256, 1024, 4096)] + [(2048, w) for w in (1, 4)]
    a.requests = a.requests or (24 if a.quick else 32)
    tmp = tempfile.mkdtemp(prefix="bench_serve-")
    stack = Stack(tmp)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "torchinductor"))
    try:
        tokenizer = None
        if a.model:
            model_dir = a.model
            tokenizer = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
            config = AutoConfig.from_pretrained(a.model, local_files_only=True)
        else:
            torch.manual_seed(a.seed)
            config = LlamaConfig(max_position_embeddings=16384, initializer_range=0.2, bos_token_id=1,
                                 eos_token_id=None, pad_token_id=0, **MODELS[a.size])
            model = LlamaForCausalLM._from_config(config, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
            model_dir = os.path.join(tmp, "model")
            model.save_pretrained(model_dir)  # the workers load the same weights
            config, model = model.config, None
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"torch {torch.__version__}, transformers {_version('transformers')}, device {a.device}; "
              f"model {a.model or 'random Llama ' + a.size}: {config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}, vocab {config.vocab_size}{_share_note(config)}; R = {a.requests}, U = {a.user}, "
              f"G = {a.new_tokens}, every {a.second_every or 'no'}th a second turn", flush=True)
        points = []
        for s, w in sizes:
            a.system, a.workers = s, w
            res = point(stack, a, config, model_dir, tokenizer)
            report(res)
            points.append(res)
    except KeyboardInterrupt:
        print("bench_serve: interrupted; its workers, stores and files are removed", file=sys.stderr)
        return 130
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    head = points[0]
    for k, (op, goal) in GOALS.items():
        v = head[k]
        met = v == goal if op == "==" else (v <= goal if op == "<=" else v >= goal)
        print(f"  goal {k} {op} {goal}: {v if isinstance(v, bool) else round(v, 3)} {'met' if met else 'MISSED'}")
    if a.plot:
        plot(points, a.plot)
        print(f"plot: {a.plot}")
    if a.json:
        out = {k: v for k, v in head.items() if k not in MODES}
        for m in MODES:
            out.update({f"{m}_{k}": v for k, v in head[m].items() if k != "ttft_ms"})
        out["points"] = [{k: v for k, v in r.items() if k not in MODES} for r in points]
        print(json.dumps(out))
    return 0


def bench_serve(quick: bool) -> dict[str, float]:
    """The ``serve`` scenario of ``shmkv bench`` (opt-in: ``--only serve``): this benchmark in a child
    process, ``python -m shmkv.cli.bench.serve --json [--quick]``, its progress lines passed through;
    the figures of the last JSON line that are numbers (same_tokens as 1.0 or 0.0, not the points)."""
    import subprocess

    import shmkv

    root = os.path.dirname(os.path.dirname(os.path.abspath(shmkv.__file__)))  # the child imports this shmkv
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "shmkv.cli.bench.serve", "--json", *(["--quick"] if quick else [])]
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as child:
        assert child.stdout is not None
        try:
            for line in child.stdout:
                lines.append(line)
                if not line.startswith("{"):
                    print(f"  {line.rstrip()}", flush=True)
        except KeyboardInterrupt:  # the child had the same Ctrl-C: it removes its workers, stores and files
            try:
                child.wait(120)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
    if child.returncode or not lines:
        raise RuntimeError(f"the serve scenario (python -m shmkv.cli.bench.serve) failed ({child.returncode}); "
                           "its output is above")
    return {k: float(v) for k, v in json.loads(lines[-1]).items() if isinstance(v, (int, float))}


def output_share(config: Any) -> float | None:
    """The output layer's share of the weights a decode step reads (the embedding table is looked up,
    not read), from a Llama-family config: what decides how much of a request decoding is. None for
    a config without those fields (another family: --model PATH takes any causal LM)."""
    try:
        h, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
        mlp, vocab = config.intermediate_size, config.vocab_size
    except AttributeError:
        return None
    hd = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    layer = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * mlp
    return vocab * h / (vocab * h + layers * layer)


def _share_note(config: Any) -> str:
    share = output_share(config)
    return "" if share is None else f" (the output layer {share:.0%} of the weights a token reads)"


def _version(module: str) -> str:
    from importlib.metadata import version

    return version(module)


def plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = points[0]
    sweep = len(points) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 3, figsize=(15, 8.5 if sweep else 4.2), squeeze=False)
    colors = {"baseline": "tab:gray", "shmkv": "tab:blue", "warm": "tab:green"}
    ax = axes[0][0]
    for m in MODES:
        xs = sorted(head[m]["ttft_ms"])
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=colors[m], label=m)
    ax.set(xscale="log", xlabel="time to first token (ms, log)", ylabel="fraction of requests",
           title=f"TTFT, S = {head['system']}, W = {head['workers']}")
    ax.legend()
    for ax, key, label in ((axes[0][1], "requests_per_s", "requests / s"),
                           (axes[0][2], "pss_peak_mib", "worker memory, peak Pss (MiB)")):
        vals = [head[m][key] for m in MODES]
        ax.bar(MODES, vals, color=[colors[m] for m in MODES])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}" if v < 10 else f"{v:.0f}", ha="center", va="bottom")
        ax.set(title=label)
    if sweep:
        by_s = sorted((r for r in points if r["workers"] == head["workers"]), key=lambda r: r["system"])
        by_w = sorted((r for r in points if r["system"] == head["system"]), key=lambda r: r["workers"])
        for ax, rows, x, xl in ((axes[1][0], by_s, "system", "system prompt S (tokens), W = 2"),
                                (axes[1][1], by_w, "workers", "workers W, S = 2048")):
            ax.plot([r[x] for r in rows], [1 / r["ttft_p50_ratio"] for r in rows], "o-", label="TTFT p50 speed-up")
            ax.plot([r[x] for r in rows], [r["throughput_ratio"] for r in rows], "s-", label="throughput ratio")
            ax.set(xlabel=xl, ylabel="shmkv vs baseline (x)", xscale="log" if x == "system" else "linear")
            ax.legend()
        ax = axes[1][2]
        ax.plot([r["system"] for r in by_s], [r["pss_ratio"] for r in by_s], "o-")
        ax.set(xlabel="system prompt S (tokens), W = 2", ylabel="Pss shmkv / baseline", xscale="log",
               title="worker memory ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
