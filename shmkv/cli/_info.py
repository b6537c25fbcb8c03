"""What ``shmkv info`` and ``watch`` show of a store, and the progress bar of ``save`` and ``load``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from shmkv.cli._words import count, size
from shmkv.errors import ShmkvError
from shmkv.store._store import Store, engine_of


class ProgressBar:
    """A progress bar on stderr, shown only on a terminal (or when forced)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:4.0%} {size(done)} of {size(total)}  ")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def info_of(store: Store, first: int = 8) -> dict[str, Any]:
    lay = store.layout
    seqs = []
    for info in store.sequences():
        try:
            handle = store.sequence(info.id)
            toks = handle.tokens[:first].tolist()
            meta = handle.meta
        except ShmkvError:
            continue  # freed meanwhile
        seqs.append({"id": info.id, "length": info.length, "capacity": info.capacity, "start": info.start,
                     "lease_pid": info.lease_pid, "lease_alive": info.lease_alive, "finished": info.finished,
                     "meta": meta, "first_tokens": toks})
    st = store.stats()
    return {
        "name": store.name,
        "capacity_bytes": os.fstat(engine_of(store).shares.fd).st_size,  # the data segment: what the store can hold
        "layout": {"layers": lay.layers, "kv_heads": lay.kv_heads, "head_dim": lay.head_dim,
                   "dtype": lay.dtype, "max_tokens": lay.max_tokens, "max_seqs": lay.max_seqs,
                   "layer_types": list(lay.layer_types), "window": lay.window, "chunk": lay.chunk},
        "persistent": store.persistent,
        "stats": {k: getattr(st, k) for k in st.__dataclass_fields__},
        "sequences": seqs,
    }


def print_info(d: dict[str, Any]) -> None:
    lay: dict[str, Any] = d["layout"]
    st: dict[str, Any] = d["stats"]
    print(f"store {d['name']}: layers={lay['layers']} kv_heads={lay['kv_heads']} head_dim={lay['head_dim']} "
          f"dtype={lay['dtype']} max_tokens={lay['max_tokens']} max_seqs={lay['max_seqs']}"
          f"{' persistent' if d['persistent'] else ''}")
    print(f"  {count(st['sequences'], 'sequence')} holding {count(st['tokens'], 'token')} ({size(st['bytes_used'])}); "
          f"capacity {count(lay['max_tokens'], 'token')} ({size(d['capacity_bytes'])} of shared memory), "
          f"{st['free_tokens']:,} of them free; "
          f"{_plural(st['clients'], 'read-write client')}")
    print(f"  prefix cache: {st['prefix_hits']} hits, {st['prefix_misses']} misses, "
          f"{st['prefix_tokens_reused']} tokens reused; {st['finished']} finished (cached, evictable), "
          f"{st['evictions']} evicted")
    if st["shared_tokens"]:  # shared prefix pages: tokens read in place from another sequence's pages
        held, once = st["bytes_held"], st["span_cells"] * (st["bytes_per_token"] - 16)
        print(f"  shared prefix pages: {count(st['shared_tokens'], 'token')} read in place from "
              f"{st['span_cells']:,} shared cells ({size(once)} held once); {size(held)} held in all for "
              f"{size(st['bytes_used'])} of tokens (sharing ratio {st['bytes_used'] / held if held > 0 else 0:.2f})")
    if st["retained_cells"]:  # span cells kept for views of borrowers truncated inside their spans
        print(f"  {st['retained_cells']:,} span cells retained for views of truncated borrowers (freed with them)")
    if d["sequences"]:
        print(f"  {'id':>6} {'length':>8} {'capacity':>8}  {'lease':<14} {'state':<9} first tokens")
        for s in d["sequences"]:
            lease = "-" if not s["lease_pid"] else f"{s['lease_pid']} {'alive' if s['lease_alive'] else 'dead'}"
            state = "finished" if s["finished"] else "live"
            meta = f"  meta {json.dumps(s['meta'], default=repr)}" if s["meta"] else ""
            toks = s["first_tokens"]
            shown = "no token ids" if toks and all(t == -1 for t in toks) else toks
            print(f"  {s['id']:>6} {s['length']:>8} {s['capacity']:>8}  {lease:<14} {state:<9} {shown}{meta}")
