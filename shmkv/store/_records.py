"""What a store reports about itself: ``SequenceInfo`` (``store.sequences()``), ``StoreStats``
(``store.stats()``) and the live clients (``store.clients()``), each read from the engine at one
moment."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

from shmkv._engine.engine import Engine

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
    return [pid for pid, key in e.rows.client_rows() if e.alive(key)]


_BY_ID = operator.attrgetter("id")  # (a C call a row, where a lambda is a Python one)


class _Listed:
    """A ``SequenceInfo`` in the making: the same slots in the same order, set by plain attribute
    stores, then switched to ``SequenceInfo`` (Python checks that the layouts match). The
    generated ``__init__`` of the frozen class sets each field through ``object.__setattr__``,
    three times the instructions, and a listing makes one record a live row."""

    __slots__ = tuple(f.name for f in fields(SequenceInfo))

    def __init__(self, values: tuple[int, int, int, int, int, bool, int, bool]) -> None:
        (self.id, self.length, self.capacity, self.start, self.lease_pid, self.lease_alive, self.generation,
         self.finished) = values


def _sequence_info(values: tuple[int, int, int, int, int, bool, int, bool]) -> SequenceInfo:
    """The ``SequenceInfo`` of its fields' values, in their order."""
    info = _Listed(values)
    info.__class__ = SequenceInfo  # type: ignore[assignment]
    return info  # type: ignore[return-value]


def sequence_infos(e: Engine) -> list[SequenceInfo]:
    """``Store.sequences``: the live sequences, in id order."""
    e.check_open()
    out = []
    asked: dict[int, bool] = {}  # client key -> alive: one question per writer, however many leases
    for seq_id, length, capacity, start, lease_pid, key, generation, finished in e.rows.listed_sequences():
        alive = False
        if lease_pid:
            known = asked.get(key)
            alive = asked[key] = e.alive(key) if known is None else known
        out.append(_sequence_info((seq_id, length, capacity, start, lease_pid, alive, generation, finished)))
    return sorted(out, key=_BY_ID)


def store_stats(e: Engine, bytes_per_token: int) -> StoreStats:
    """``Store.stats``: occupancy (sequences, tokens, free cells and bytes)."""
    e.check_open()
    table = e.rows.occupancy()
    gaps = e.free_ranges()
    bpt = bytes_per_token
    tokens, reserved, enc_tokens, kept = table.tokens, table.reserved, table.encoder_tokens, table.window_tokens
    enc_bpt = e.kv_bytes(e.layout.layers)  # an encoder token has every layer
    wbytes = e.kv_bytes(len(e.layout.bounded))  # per token the bounded layers keep
    shared, span_cells = e.shared_cells()
    retained = e.retained_cells()
    held = e.held_cells() if shared or retained else reserved  # a span's cells count once
    bytes_used = tokens * bpt + kept * wbytes + enc_tokens * enc_bpt
    # the K/V of tokens read from a span are held once, by the span (also when its donor is gone)
    bytes_held = bytes_used - (tokens - e.committed_held()) * (bpt - 16) if shared else bytes_used
    counters = e.rows.counters()
    return StoreStats(
        name=e.name,
        sequences=table.sequences,
        max_seqs=e.layout.max_seqs,
        tokens=tokens,
        reserved_tokens=reserved,
        max_tokens=e.layout.max_tokens,
        free_tokens=max(0, e.free_tokens(gaps)),  # what max_tokens still holds (the arena has slack)
        largest_free_range=max(0, min(max((s for _, s in gaps), default=0), e.free_tokens(gaps))),
        bytes_per_token=bpt,
        bytes_used=bytes_used,
        bytes_reserved=held * (bpt - 16) + reserved * 16 + table.sequences * 2 * e.layout.window_cells * wbytes
        + table.encoder_cells * enc_bpt,
        encoder_tokens=enc_tokens,
        window_tokens=kept,
        clients=len(live_clients(e)),
        generation=counters.generation,
        finished=table.finished,
        prefix_hits=counters.prefix_hits,
        prefix_misses=counters.prefix_misses,
        prefix_tokens_reused=counters.prefix_tokens_reused,
        evictions=counters.evictions,
        shared_tokens=shared,
        bytes_shared=shared * (bpt - 16),
        span_cells=span_cells,
        bytes_held=bytes_held,
        retained_cells=retained,
    )
