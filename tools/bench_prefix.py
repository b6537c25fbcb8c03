#!/usr/bin/env python3
"""Prefix-cache benchmark (DESIGN §7, §8): lookup cost against the number of cached sequences,
and time to first token with and without reuse. Prints JSON on its last line.

- prefix_lookup_us_16 / _1000: median of store.match_prefix() of a 300-token prompt whose first
  250 tokens some cached sequence holds, with 16 and with 1000 finished sequences cached (goal:
  under 50 us + 1 us per 16 tokens, and flat).
- prefix_ttft_ratio: time to first token of the demo's model for a request whose system prompt
  (250 of its 300 tokens) is cached, over the same request computed from scratch in the same run,
  interleaved (create_sequence + prefill of the rest + logits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import shmkv
from shmkv.cli import _model
from shmkv.testing import unique_name


def _lookup_us(cached: int, reps: int) -> float:
    rng = np.random.default_rng(cached)
    store = shmkv.create(unique_name("bp"), layers=2, kv_heads=2, head_dim=4, dtype="float16",
                         max_tokens=cached * 304 + 1024, max_seqs=cached + 8)
    try:
        k = np.zeros((2, 300, 2, 4), np.float16)
        prompts = [rng.integers(0, 30_000, 300) for _ in range(cached)]
        for p in prompts:
            s = store.create_sequence(capacity=300)
            s.extend(k, k, tokens=p)
            s.finish()
        q = np.concatenate([prompts[cached // 2][:250], rng.integers(30_000, 40_000, 50)])
        assert store.match_prefix(q) == 250
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            store.match_prefix(q)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    finally:
        store.close()


def _ttft_ratio(reps: int) -> tuple[float, float]:
    model = _model.Model()
    cfg = model.cfg
    rng = np.random.default_rng(3)
    system = rng.integers(0, 256, 250)
    store = shmkv.create(unique_name("bt"), layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                         dtype="float32", max_tokens=4096, max_seqs=16)
    try:
        donor = store.create_sequence(capacity=320)
        model.forward(_model.SeqCache(donor), system, np.arange(250))
        donor.commit(tokens=system)
        donor.finish()

        def request(prefix: bool) -> float:
            p = np.concatenate([system, rng.integers(0, 256, 50)])
            t0 = time.perf_counter()
            seq = store.create_sequence(capacity=320, prefix=p if prefix else None)
            n = len(seq)
            model.forward(_model.SeqCache(seq), p[n:], np.arange(n, len(p)))
            seq.commit(tokens=p[n:])
            dt = time.perf_counter() - t0
            seq.free()
            return dt

        with_, without = [], []
        for _ in range(reps):
            with_.append(request(True))
            without.append(request(False))
        return statistics.median(with_), statistics.median(without)
    finally:
        store.close()


def run(quick: bool) -> dict[str, float]:
    res = {"prefix_lookup_us_16": _lookup_us(16, 200 if quick else 2000),
           "prefix_lookup_us_1000": _lookup_us(1000, 200 if quick else 2000)}
    w, wo = _ttft_ratio(5 if quick else 20)
    res.update(prefix_ttft_ms=w * 1e3, noprefix_ttft_ms=wo * 1e3, prefix_ttft_ratio=w / wo)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick)
    for k, v in res.items():
        print(f"  {k:<24} {v:10.3f}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
