#!/usr/bin/env python3
"""Prefix-cache benchmark: lookup cost against the number of cached sequences,
and time to first token with and without reuse. Prints JSON on its last line.

- prefix_lookup_us_16 / _1000: median of store.match_prefix() of a 300-token prompt whose first
  250 tokens some cached sequence holds, with 16 and with 1000 finished sequences cached (goal:
  under 50 us + 1 us per 16 tokens, and flat).
- prefix_ttft_ratio: time to first token of the demo's model for a request whose system prompt
  (250 of its 300 tokens) is cached, over the same request computed from scratch in the same run,
  interleaved (create_sequence + prefill of the rest + logits).
- stitched_read_ratio: reading every layer's K of a 2,112-token stitched view (a donor's first
  2,048 cells and 64 cells of another range, mapped into one contiguous array) over
  reading a plain view of the same number of bytes, interleaved (goal >= 0.9); stitch_build_us:
  building and unmapping one such layer view (8 KV heads x 128 dims, float16).
- prefix_memory_ratio (goal <= 1.25): 32 requests (8 with
  --quick) whose prompts share a 2,048-token system prompt, 8 layers x 8 KV heads x 128 dims,
  float16, each created with prefix= and extended by 32 tokens of its own: the data segment's
  allocated bytes (st_blocks) over the bytes of the distinct tokens. prefix_request_vs_extend1
  (goal <= 20): median create_sequence(prefix=) over the cached prefix / median one-token extend
  (append every layer + commit) of the same store.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import shmkv
from shmkv.cli import _model

try:  # (tools/bench_against.py runs this harness against older trees, which kept it in _engine)
    from shmkv._engine.spans import stitch
except ImportError:
    from shmkv._engine import stitch  # type: ignore[no-redef,attr-defined]
from shmkv.store._store import engine_of
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


def _stitched_read(reps: int) -> tuple[float, float]:
    """(plain time / stitched time of reading every layer's K, us to build + unmap one layer view)."""
    L, H, D, m, own = 8, 8, 128, 2048, 64
    store = shmkv.create(unique_name("bs"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                         max_tokens=2 * (m + own) + 1024, max_seqs=4)
    try:
        rng = np.random.default_rng(4)
        donor = store.create_sequence(capacity=m + own)
        donor.extend(rng.standard_normal((L, m + own, H, D)).astype(np.float16),
                     rng.standard_normal((L, m + own, H, D)).astype(np.float16))
        mine = store.create_sequence(capacity=own)
        mine.extend(rng.standard_normal((L, own, H, D)).astype(np.float16),
                    rng.standard_normal((L, own, H, D)).astype(np.float16))
        shares = engine_of(store).shares
        dbase, fd = shares.base, shares.fd  # the data segment's address and a descriptor of it
        cb = H * D * 2

        def pieces(layer: int) -> list[tuple[int, int]]:
            d = donor.keys(layer).ctypes.data - dbase
            o = mine.keys(layer).ctypes.data - dbase
            return [(d, m * cb), (o, own * cb)]

        views = [stitch.Stitch(fd, pieces(i)).array(np.float16, (m + own, H, D)) for i in range(L)]
        plain = [donor.keys(i) for i in range(L)]
        for i in range(L):  # the stitch reads what the two ranges hold
            assert np.array_equal(views[i][:m], plain[i][:m]) and np.array_equal(views[i][m:], mine.keys(i))

        def read(arrs: list[np.ndarray]) -> None:  # every byte, memory-bound (as 8-byte words)
            for a in arrs:
                a.reshape(-1).view(np.uint64).max()

        times: dict[str, list[float]] = {"plain": [], "stitched": []}
        for r in range(reps):
            for k in (("plain", "stitched") if r % 2 else ("stitched", "plain")):
                arrs = plain if k == "plain" else views
                t0 = time.perf_counter()
                read(arrs)
                times[k].append(time.perf_counter() - t0)
        build = []
        for r in range(reps * 10):
            t0 = time.perf_counter()
            v = stitch.Stitch(fd, pieces(r % L)).array(np.float16, (m + own, H, D))
            del v  # unmapped here: the last array over it is gone
            build.append(time.perf_counter() - t0)
        del views
        return statistics.median(times["plain"]) / statistics.median(times["stitched"]), statistics.median(build) * 1e6
    finally:
        store.close()


def _prefix_sharing(requests: int) -> tuple[float, float, float, float]:
    """(prefix_memory_ratio, prefix_request_vs_extend1, create ms, extend1 us) of the scenario above."""
    L, H, D, system_n, own = 8, 8, 128, 2048, 32
    store = shmkv.create(unique_name("bm"), layers=L, kv_heads=H, head_dim=D, dtype="float16",
                         max_tokens=(requests + 1) * (system_n + own + 64), max_seqs=requests + 4)
    try:
        fd = engine_of(store).shares.fd  # the data segment: its allocated blocks are the memory it holds
        empty = os.fstat(fd).st_blocks * 512
        rng = np.random.default_rng(5)
        system = rng.integers(0, 30_000, system_n)
        kv = rng.standard_normal((L, system_n + own, H, D)).astype(np.float16)
        donor = store.create_sequence(capacity=system_n)
        donor.extend(kv[:, :system_n], kv[:, :system_n], tokens=system)
        donor.finish()
        creates, seqs = [], []
        for _ in range(requests):
            p = np.concatenate([system, rng.integers(30_000, 40_000, own)])
            t0 = time.perf_counter()
            seq = store.create_sequence(capacity=system_n + own + 32, prefix=p)
            creates.append(time.perf_counter() - t0)
            assert len(seq) == system_n, len(seq)
            seq.extend(kv[:, system_n:], kv[:, system_n:], tokens=p[system_n:])
            seqs.append(seq)
        held = os.fstat(fd).st_blocks * 512 - empty
        distinct = (system_n + requests * own) * store.bytes_per_token
        one = kv[:, :1]
        steps = []
        s = seqs[-1]
        for _ in range(31):
            t0 = time.perf_counter()
            for layer in range(L):
                s.append(layer, one[layer], one[layer])
            s.commit(tokens=[1])
            steps.append(time.perf_counter() - t0)
        c, e = statistics.median(creates), statistics.median(steps)
        return held / distinct, c / e, c * 1e3, e * 1e6
    finally:
        store.close()


def run(quick: bool) -> dict[str, float]:
    res = {"prefix_lookup_us_16": _lookup_us(16, 200 if quick else 2000),
           "prefix_lookup_us_1000": _lookup_us(1000, 200 if quick else 2000)}
    w, wo = _ttft_ratio(5 if quick else 20)
    res.update(prefix_ttft_ms=w * 1e3, noprefix_ttft_ms=wo * 1e3, prefix_ttft_ratio=w / wo)
    ratio, build_us = _stitched_read(21 if quick else 61)
    res.update(stitched_read_ratio=ratio, stitch_build_us=build_us)
    mem, vs, create_ms, extend1_us = _prefix_sharing(8 if quick else 32)
    res.update(prefix_memory_ratio=mem, prefix_request_vs_extend1=vs, prefix_request_ms=create_ms,
               extend1_us=extend1_us)
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
