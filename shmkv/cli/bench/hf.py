#!/usr/bin/env python3
"""hf_generate_ratio: model.generate() with ShmkvCache vs transformers' DynamicCache.

The same random-weight Llama (built from a config, nothing downloaded) generates
256 new tokens greedily at batch 1 and batch 4, once with each cache, alternately
(median of the repeats), in this run. The ratio is ShmkvCache time / DynamicCache
time; the goal: at most 1.1 at batch 1 and 1.3 at batch 4.

    python -m shmkv.cli.bench.hf [--quick] [--json] [--tokens 256] [--repeats 5] [--model small|tiny] [--threads 1]

The last line with --json is one JSON object: hf_generate_ratio (batch 1),
hf_generate_ratio_b4, and the medians in ms. Needs ``pip install 'shmkv[transformers]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    # tiny: the tests' model (the cache's own overhead dominates); small: closer to a real
    # decoder's ratio of compute to per-layer bookkeeping
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}


NOT_IN_THIS_SHMKV = 3  # the exit status when the shmkv imported lacks what this benchmark uses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 repeats, 64 tokens")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: steadier on a shared machine; both caches get the same)")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.repeats = min(a.tokens, 64), 2

    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    try:
        from shmkv.transformers import ShmkvCache, cache_keyword
    except ImportError as e:  # an older shmkv (tools/bench_against.py runs this file against older trees)
        print(f"bench_hf: this shmkv cannot run it: {e}", file=sys.stderr)
        return NOT_IN_THIS_SHMKV

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, max_position_embeddings=4096, eos_token_id=None, pad_token_id=0,
                         **MODELS[a.model])
    model = LlamaForCausalLM._from_config(config, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    kw_cache = cache_keyword(model)  # cache= (transformers >= 5.24) or past_key_values=
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__} ({a.threads} threads), model {a.model}, {a.tokens} new tokens, "
          f"{a.repeats} repeats")
    results: dict[str, float] = {}
    owner = ShmkvCache.from_config(config, dtype="float32", max_tokens=16 * (a.prompt + a.tokens + 64))
    try:
        for batch in (1, 4):
            ids = torch.randint(3, config.vocab_size, (batch, a.prompt), generator=torch.Generator().manual_seed(1))
            kw: dict[str, Any] = dict(max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)

            def run_dynamic(ids: Any = ids, kw: dict[str, Any] = kw) -> Any:
                with torch.no_grad():
                    return model.generate(ids, **{kw_cache: DynamicCache()}, **kw)

            def run_shmkv(ids: Any = ids, kw: dict[str, Any] = kw) -> Any:
                cache = ShmkvCache(owner.store)
                try:
                    with torch.no_grad():
                        return model.generate(ids, **{kw_cache: cache}, **kw)
                finally:
                    cache.free()

            # same tokens, or the comparison is meaningless
            if not torch.equal(run_dynamic(), run_shmkv()):
                print("bench_hf: ShmkvCache generated other tokens than DynamicCache", file=sys.stderr)
                return 1
            td: list[float] = []
            ts: list[float] = []
            for _ in range(a.repeats):  # interleaved: drift on a shared machine hits both
                for fn, out in ((run_dynamic, td), (run_shmkv, ts)):
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)
            d, s = statistics.median(td), statistics.median(ts)
            suffix = "" if batch == 1 else f"_b{batch}"
            results[f"hf_dynamic_ms{suffix}"] = d * 1e3
            results[f"hf_shmkv_ms{suffix}"] = s * 1e3
            results[f"hf_generate_ratio{suffix}"] = s / d
            goal = 1.1 if batch == 1 else 1.3
            print(f"  batch {batch}: DynamicCache {d * 1e3:9.1f} ms   ShmkvCache {s * 1e3:9.1f} ms   "
                  f"ratio {s / d:.3f}   goal <= {goal}: {'met' if s / d <= goal else 'MISSED'}")
    finally:
        owner.close()
    if a.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the bench's Ctrl-C reaches this process too: the bench says it
        sys.exit(130)
