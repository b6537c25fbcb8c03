"""What a store reports about itself: ``SequenceInfo`` (``store.sequences()``), ``StoreStats``
(``store.stats()``) and the live clients (``store.clients()``), each read from the engine at one
moment."""

from __future__ import annotations

from dataclasses import dataclass, field

from shmkv._engine import header as _header
from shmkv._engine.engine import Engine
from shmkv._engine.header import (
    CAPACITY,
    ENCODER,
    FINISHED,
    FLAGS,
    GEN,
    ID,
    LEASE_CLIENT,
    LEASE_PID,
    LENGTH,
    LIVE,
    START,
    STATE,
    WIN_OFF,
)

__all__ = ["SequenceInfo", "StoreStats", "live_clients", "sequence_infos", "store_stats"]


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """One row of the sequence table, as read at one moment."""

    id: int
    length: int
    capacity: int
    start: int
    lease_pid: int
    lease_alive: bool
    generation: int = field(repr=False)  # a change counter of the row, not a figure to read
    finished: bool = False  # seq.finish(): a cached prefix, evictable


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Occupancy of a store at one moment (``store.stats()``)."""

    name: str
    sequences: int
    max_seqs: int
    tokens: int  # committed tokens over all sequences
    reserved_tokens: int  # cells owned by sequence ranges
    max_tokens: int
    free_tokens: int
    largest_free_range: int
    bytes_per_token: int  # K and V of every layer, plus token id and position
    bytes_used: int  # committed tokens x bytes_per_token
    bytes_reserved: int  # reserved cells x bytes_per_token, plus the sliding/chunked buffers
    clients: int
    generation: int
    window_tokens: int = 0  # tokens the sliding/chunked layers hold, over all sequences (bounded)
    encoder_tokens: int = 0  # tokens in encoder (cross-attention) caches
    finished: int = 0  # finished sequences: cached prefixes, evictable
    prefix_hits: int = 0  # create_sequence(prefix=) calls that reused tokens, by every process
    prefix_misses: int = 0  # ... that reused none
    prefix_tokens_reused: int = 0
    evictions: int = 0  # finished sequences evicted to make room
    shared_tokens: int = 0  # tokens sequences read from another's pages (shared prefix pages, docs/design.md §11)
    bytes_shared: int = 0  # K/V bytes those tokens would take as copies: held once, by the span
    span_cells: int = 0  # distinct physical cells the spans cover (a span counted once)
    bytes_held: int = 0  # what bytes_used really holds: a span's committed bytes once (ratio: used / held)
    # span cells kept for views of a borrower truncated inside its span (docs/stores.md, what invalidates a view):
    # taken by no range, reused once that borrower is freed or moves; at most what it borrowed
    retained_cells: int = 0


def live_clients(e: Engine) -> list[int]:
    """``Store.clients``: pids of the live read-write attachments (one per attachment)."""
    e.check_open()
    out = []
    for pid, key, _flags, _ in e.clients_np.tolist():
        if pid and key > 0 and e.alive(key):
            out.append(pid)
    return out


def sequence_infos(e: Engine) -> list[SequenceInfo]:
    """``Store.sequences``: the live sequences, in id order."""
    e.check_open()
    out = []
    table = e.listed_rows()
    asked: dict[int, bool] = {}  # client key -> alive: one question per writer, however many leases
    for r in table:
        if r[STATE] != LIVE:
            continue
        key, alive = r[LEASE_CLIENT], False
        if r[LEASE_PID]:
            known = asked.get(key)
            alive = asked[key] = e.alive(key) if known is None else known
        out.append(SequenceInfo(r[ID], r[LENGTH], r[CAPACITY], r[START], r[LEASE_PID], alive, r[GEN],
                                bool(r[FLAGS] & FINISHED)))
    return sorted(out, key=lambda s: s.id)


def store_stats(e: Engine, bytes_per_token: int) -> StoreStats:
    """``Store.stats``: occupancy (sequences, tokens, free cells and bytes)."""
    e.check_open()
    e.check_open()
    t = e.table_np
    live = t[t[:, STATE] == LIVE]
    encoders = t[t[:, STATE] == ENCODER]
    gaps = e.free_ranges()
    bpt = bytes_per_token
    tokens = int(live[:, LENGTH].sum())
    reserved = int(live[:, CAPACITY].sum())
    enc_tokens = int(encoders[:, LENGTH].sum())
    enc_bpt = e.kv_bytes(e.layout.layers)  # an encoder token has every layer
    kept = int((live[:, LENGTH] - live[:, WIN_OFF]).sum()) if e.layout.bounded else 0
    wbytes = e.kv_bytes(len(e.layout.bounded))  # per token the bounded layers keep
    shared, span_cells = e.shared_cells()
    retained = e.retained_cells()
    held = e.held_cells() if shared or retained else reserved  # a span's cells count once
    bytes_used = tokens * bpt + kept * wbytes + enc_tokens * enc_bpt
    # the K/V of tokens read from a span are held once, by the span (also when its donor is gone)
    bytes_held = bytes_used - (tokens - e.committed_held()) * (bpt - 16) if shared else bytes_used
    return StoreStats(
        name=e.name,
        sequences=int(live.shape[0]),
        max_seqs=e.layout.max_seqs,
        tokens=tokens,
        reserved_tokens=reserved,
        max_tokens=e.layout.max_tokens,
        free_tokens=max(0, e.free_tokens(gaps)),  # what max_tokens still holds (the arena has slack)
        largest_free_range=max(0, min(max((s for _, s in gaps), default=0), e.free_tokens(gaps))),
        bytes_per_token=bpt,
        bytes_used=bytes_used,
        bytes_reserved=held * (bpt - 16) + reserved * 16 + int(live.shape[0]) * 2 * e.layout.window_cells * wbytes
        + int(encoders[:, CAPACITY].sum()) * enc_bpt,
        encoder_tokens=enc_tokens,
        window_tokens=kept,
        clients=len(live_clients(e)),
        generation=int(e.hdr[_header.W_GENERATION]),
        finished=int(((live[:, FLAGS] & FINISHED) != 0).sum()),
        prefix_hits=int(e.hdr[_header.W_PREFIX_HITS]),
        prefix_misses=int(e.hdr[_header.W_PREFIX_MISSES]),
        prefix_tokens_reused=int(e.hdr[_header.W_PREFIX_REUSED]),
        evictions=int(e.hdr[_header.W_EVICTIONS]),
        shared_tokens=shared,
        bytes_shared=shared * (bpt - 16),
        span_cells=span_cells,
        bytes_held=bytes_held,
        retained_cells=retained,
    )
