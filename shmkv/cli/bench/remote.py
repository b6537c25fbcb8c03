#!/usr/bin/env python3
"""Remote tier benchmark: push and pull against redis-py on the same server, same run.

A 2048-token, 16-layer float16 context (8 KV heads of 128: 128 MiB, as the other scenarios) is
pushed to and pulled from a throwaway redis-server on a free loopback port
(or --url, a server you own: its keys under the namespace are overwritten).

- push: ``tier.push(store, seq_id)`` into an empty namespace (EXISTS, then SET under
  pending keys and RENAMENX, pipelined; the chunk values gathered from shared memory, checksummed) against a
  pipelined SET of byte strings of the same sizes, already built;
- pull: ``tier.pull(seq, tokens)`` into a fresh sequence (pipelined GET, checksum,
  header check, the K/V written into the store) against a pipelined GET of the
  same keys (bytes received, nothing else).

The two sides alternate, ``--repeats`` times; medians. Ratios are baseline time /
shmkv time (1.0: as fast as redis-py alone; goal >= 0.7). Prints JSON with
``remote_pull_ratio`` and ``remote_push_ratio`` (and the times, MB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import shmkv
from shmkv.testing._redis import RedisServer
from shmkv.remote import RemoteTier
from shmkv.testing import unique_name


def run(url: str | None = None, *, tokens: int = 2048, layers: int = 16, kv_heads: int = 8, head_dim: int = 128,
        chunk_tokens: int = 256, repeats: int = 5) -> dict[str, Any]:
    import redis

    server = RedisServer() if url is None else None
    url = url or server.url  # type: ignore[union-attr]
    r = redis.Redis.from_url(url, socket_timeout=60)
    tier = RemoteTier(url, namespace="bench", chunk_tokens=chunk_tokens, timeout=60)
    a = shmkv.create(unique_name("rba"), layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype="float16",
                     max_tokens=tokens + 64, max_seqs=4)
    b = shmkv.create(unique_name("rbb"), layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype="float16",
                     max_tokens=tokens + 64, max_seqs=4)
    try:
        rng = np.random.default_rng(0)
        toks = rng.integers(0, 50_000, tokens)
        seq = a.create_sequence(capacity=tokens)
        for i in range(0, tokens, 256):  # 256 tokens at a time: bounded temporary memory
            n = min(256, tokens - i)
            kv = rng.standard_normal((2, layers, n, kv_heads, head_dim)).astype(np.float16)
            seq.extend(kv[0], kv[1], tokens=toks[i : i + n])
        prompt = np.concatenate([toks, [1]])  # one more token: the len - 1 cap lets all `tokens` be pulled
        chunks = tokens // chunk_tokens

        def clear() -> None:
            keys = list(r.scan_iter(match="bench:*", count=1000)) + list(r.scan_iter(match="base:*", count=1000))
            if keys:
                r.delete(*keys)

        assert tier.push(a, seq.id) == chunks
        keys = [tier.key(a.layout, toks[: (i + 1) * chunk_tokens]) for i in range(chunks)]
        blobs = [bytes(r.get(k)) for k in keys]  # type: ignore[arg-type]  # the same bytes, as the baseline's values
        nbytes = sum(len(x) for x in blobs)

        def push() -> float:
            clear()
            t = time.perf_counter()
            assert tier.push(a, seq.id) == chunks
            return time.perf_counter() - t

        def base_set() -> float:
            r.delete(*[f"base:{i}" for i in range(chunks)])
            t = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for i, blob in enumerate(blobs):
                pipe.set(f"base:{i}", blob)
            pipe.execute()
            return time.perf_counter() - t

        def pull() -> float:
            s = b.create_sequence(capacity=tokens)
            try:
                t = time.perf_counter()
                assert tier.pull(s, prompt) == tokens
                return time.perf_counter() - t
            finally:
                s.free()

        def base_get() -> float:
            t = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            got = pipe.execute()
            dt = time.perf_counter() - t
            assert sum(len(x) for x in got) == nbytes
            return dt

        pull()  # warm: pages of store b, connections
        base_get()
        t_push, t_set, t_pull, t_get = [], [], [], []
        for _ in range(repeats):
            t_set.append(base_set())
            t_push.append(push())
            t_get.append(base_get())
            t_pull.append(pull())
        med = {k: statistics.median(v) for k, v in
               {"push": t_push, "set": t_set, "pull": t_pull, "get": t_get}.items()}
        clear()
        return {
            "remote_bytes": nbytes,
            "remote_chunks": chunks,
            "remote_push_ms": med["push"] * 1e3,
            "remote_set_ms": med["set"] * 1e3,
            "remote_pull_ms": med["pull"] * 1e3,
            "remote_get_ms": med["get"] * 1e3,
            "remote_push_mbps": nbytes / med["push"] / 1e6,
            "remote_pull_mbps": nbytes / med["pull"] / 1e6,
            "remote_push_ratio": med["set"] / med["push"],
            "remote_pull_ratio": med["get"] / med["pull"],
        }
    finally:
        tier.close()
        r.close()
        for st in (a, b):
            st.close()
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="an existing Redis you own (default: a throwaway redis-server on loopback)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 repeats")
    a = p.parse_args(argv)
    res = run(a.url, tokens=a.tokens, layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim,
              chunk_tokens=a.chunk_tokens, repeats=3 if a.quick else a.repeats)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
