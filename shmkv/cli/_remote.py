"""``shmkv push`` and ``shmkv tier``: the remote tier's commands (registered by shmkv.cli).

    shmkv push NAME URL [--seq ID[,ID...]] [--namespace NS] [--chunk-tokens N] [--cluster] [--json]
    shmkv tier URL [--namespace NS] [--cluster] [--json]

``tier`` walks the keys with SCAN (never KEYS, which blocks a busy server) and
sums STRLEN per namespace and layout fingerprint.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shmkv.cli._args import count_arg, ids_arg, seconds_arg
from shmkv._engine.prefixes.hashes import HASH_VERSION


def add_cli(sub: Any) -> None:
    """Register ``push`` and ``tier`` on shmkv.cli's subparsers."""
    sp = sub.add_parser("push", help="upload a store's sequences to a Redis tier (whole chunks not there yet)",
                        description="upload a store's sequences to a Redis tier (whole chunks not there yet)")
    sp.set_defaults(fn=_cmd_push)
    sp.add_argument("name", help="store name")
    sp.add_argument("url", help="redis://host:port/db (any node of a cluster with --cluster)")
    sp.add_argument("--seq", type=ids_arg, help="comma-separated sequence ids (default: all)")
    _common(sp)
    sp.add_argument("--chunk-tokens", type=count_arg(1), default=256, help="tokens a chunk (default 256)")
    sp = sub.add_parser("tier", help="what a Redis tier holds: chunks, bytes, namespaces",
                        description="what a Redis tier holds: chunks, bytes, namespaces (SCAN, never KEYS)")
    sp.set_defaults(fn=_cmd_tier)
    sp.add_argument("url", help="redis://host:port/db (any node of a cluster with --cluster)")
    _common(sp)


def _common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--namespace", help="key namespace (push: default 'default'; tier: default all)")
    sp.add_argument("--cluster", action="store_true", help="the URL is a node of a Redis Cluster")
    sp.add_argument("--timeout", type=seconds_arg, default=2.0, help="seconds per socket operation (default 2)")
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")


def _cmd_push(a: argparse.Namespace) -> int:
    from shmkv.store._store import attach
    from shmkv.remote import RemoteTier

    tier = RemoteTier(a.url, namespace=a.namespace or "default", chunk_tokens=a.chunk_tokens,
                      cluster=a.cluster, timeout=a.timeout)
    store = attach(a.name, readonly=True)
    try:
        ids = a.seq if a.seq else [i.id for i in store.sequences()]
        out = {str(i): tier.push(store, i) for i in ids}
    finally:
        store.close()
        tier.close()
    st = tier.stats()
    if a.json:
        print(json.dumps({"store": a.name, "tier": repr(tier), "chunks_written": out,
                          "bytes_written": st.bytes_pushed}))
    else:
        for i, n in out.items():
            print(f"sequence {i}: {n} chunks written")
        print(f"{sum(out.values())} chunks, {st.bytes_pushed / 2**20:.1f} MiB to {tier!r}")
    return 0


def _cmd_tier(a: argparse.Namespace) -> int:
    from shmkv.remote import RemoteTier, with_client
    from shmkv.remote._client import redact

    tier = RemoteTier(a.url, namespace=a.namespace or "default", cluster=a.cluster, timeout=a.timeout)
    pattern = f"{a.namespace}:shmkv:*" if a.namespace else "*:shmkv:*"
    try:
        summary = with_client(tier, lambda r: _scan(r, pattern))
    finally:
        tier.close()
    url = redact(a.url) + (" (cluster)" if a.cluster else "")
    if a.json:
        print(json.dumps({"url": url, **summary}))
        return 0
    print(f"{url}: {summary['chunks']} chunks, {summary['bytes'] / 2**20:.1f} MiB")
    for ns, d in sorted(summary["namespaces"].items()):
        print(f"  {ns}: {d['chunks']} chunks, {d['bytes'] / 2**20:.1f} MiB")
        for fp, lay in sorted(d["layouts"].items()):
            f = lay["layout"]
            what = (f"{f['layers']} layers x {f['kv_heads']} x {f['head_dim']} {f['dtype']}, "
                    f"{f['chunk_tokens']} tokens a chunk" if f else "unreadable header")
            print(f"    {fp}: {lay['chunks']} chunks, {lay['bytes'] / 2**20:.1f} MiB ({what})")
    if summary["other_versions"]:
        print(f"  ({summary['other_versions']} keys of another hash version)", file=sys.stderr)
    return 0


def _scan(r: Any, pattern: str) -> dict[str, Any]:
    namespaces: dict[str, dict[str, Any]] = {}
    chunks = total = other = 0
    batch: list[bytes] = []

    def flush() -> None:
        nonlocal chunks, total
        if not batch:
            return
        pipe = r.pipeline(transaction=False)
        for k in batch:
            pipe.strlen(k)
        for k, n in zip(batch, pipe.execute(), strict=True):
            parts = k.decode(errors="replace").split(":")  # {ns}:shmkv:{fp}:{version}:{hash}
            ns, fp = ":".join(parts[:-4]), parts[-3]
            d = namespaces.setdefault(ns, {"chunks": 0, "bytes": 0, "layouts": {}})
            d["chunks"] += 1
            d["bytes"] += int(n)
            lay = d["layouts"].setdefault(fp, {"chunks": 0, "bytes": 0, "layout": None, "_key": k})
            lay["chunks"] += 1
            lay["bytes"] += int(n)
            chunks += 1
            total += int(n)
        batch.clear()

    for key in r.scan_iter(match=pattern, count=1000):
        parts = key.decode(errors="replace").split(":")
        if len(parts) < 5 or parts[-4] != "shmkv":
            continue
        if parts[-2] != str(HASH_VERSION):
            other += 1
            continue
        batch.append(key)
        if len(batch) >= 1000:
            flush()
    flush()
    # What each fingerprint stands for, from the header of one of its chunks (GETRANGE: the header only).
    for d in namespaces.values():
        for lay in d["layouts"].values():
            lay["layout"] = _layout_of(r.getrange(lay.pop("_key"), 0, 65535))
    return {"chunks": chunks, "bytes": total, "namespaces": namespaces, "other_versions": other}


def _layout_of(head: bytes) -> dict[str, Any] | None:
    """The layout fingerprint in a chunk's header, or None if it cannot be read."""
    import msgpack

    from shmkv.remote._wire import FIXED, MAGIC

    try:
        magic, _, _, hlen, _ = FIXED.unpack_from(head, 0)
        if magic != MAGIC:
            return None
        hdr = msgpack.unpackb(head[FIXED.size : FIXED.size + hlen])
        fp = hdr["fp"]
        return fp if isinstance(fp, dict) else None
    except Exception:  # a damaged or foreign value: shown as unknown
        return None
