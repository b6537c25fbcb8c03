"""The header segment: the single source of truth of a store.

Every process reads the layout and the tables from here; nothing about a store
lives only in a process. All fields are little-endian int64 words (8-byte
aligned, so a single word is read and written atomically on every platform we
support), viewed through numpy.

Header segment ``/dev/shm/skv_NAME.h``::

    byte offset          words  field
    ------------------   -----  ---------------------------------------------
    0                    1      magic  b"SHMKV\\0HD"  (written last at create)
    8                    1      version (FORMAT_VERSION)
    16                   1      header segment size in bytes
    24                   1      data segment size in bytes
    32                   1      store generation (bumped by every structural op)
    40                   1      layers
    48                   1      kv_heads
    56                   1      head_dim
    64                   1      dtype code (see _dtypes)
    72                   1      max_tokens (token cells ranges and spans may take in all; the arena: more)
    80                   1      max_seqs (rows of the sequence table)
    88                   1      max_clients (rows of the client table)
    96                   1      creator pid
    104                  1      creator's client key (see liveness: slot 0's key at create; the
                                creator is alive while slot 0's row holds it and its byte is locked)
    112                  1      persistent (0/1)
    120                  1      next sequence id (create never reuses an id; see ID below)
    128                  1      window (sliding layers; 0 = none)
    136                  1      chunk (chunked layers; 0 = none)
    144                  1      memory (extra tokens kept by sliding layers)
    152                  1      layout checksum (crc32 of the fixed words 5..14, 16..18, 20, 21, layer kinds)
    160                  1      store identity: random, nonzero, drawn at create. A process removes a
                                store by its close/exit/unlink only while the segment still holds the
                                identity it saw (the name may be a newer store by then)
    168                  1      test-session tag: the creator's SHMKV_PYTEST_SESSION (hex), 0 when unset;
                                the pytest plugin judges only stores carrying its own session's tag
    176 .. 255                  reserved (zero)
    256                  1      prefix_hits      (creates with a prefix that reused tokens; all processes)
    264                  1      prefix_misses    (creates with a prefix that reused none)
    272                  1      prefix_tokens_reused
    280                  1      evictions        (finished sequences evicted to make room)
    288                  1      recency clock    (bumped under the lock; rows take its value as their recency)
    296                  1      prefix index slots (a power of two; see _prefix)
    304                  1      prefix index slots in use (valid or not; a rebuild recounts)
    312 .. 319                  reserved (zero)
    320                  1      undo entries: rows the structural operation in progress changed
                                (0: none in progress; see "Crash recovery" below)
    328                  1      pid of the process whose operation it is
    336                  1      births: rows made live, ever (a row's incarnation: GEN bits 40.., see journal.py)
    344                  1      recoveries: operations of dead processes rolled back, ever
    352                  1      allocation counter: bumped (lock held) by every change of a row's range or
                                state and by recovery; a process's free-range cache is valid at its value
    360                  1      span epoch: odd while a transaction changes shared prefix pages (spans/mappings.py),
                                bumped to even when it ends; a process re-maps when its copy is stale
    368                  1      page mark: no K/V or scale pages at or above it (free_ranges.py); 376.. zero
    512                  L bytes  layer kinds, one byte a layer (0 full, 1 sliding, 2 chunked),
                                  padded to 8 bytes
    SEQ_OFF              19 x max_seqs    sequence table, one 152-byte row a sequence
    CLIENT_OFF           4 x max_clients  client table, one 32-byte row a process
    INDEX_OFF            4 x index slots  prefix index, one 32-byte entry a slot (see ``_engine/prefixes/index.py``)
    META_OFF             65 x max_seqs    per-sequence metadata (seq.meta), one 520-byte record a row:
                                          a word with the msgpack length, then up to META_BYTES bytes
    UNDO_OFF             85 x max_seqs    undo log: one entry per row changed by the structural operation
                                          in progress: slot (bit 32 set: the meta words are logged too),
                                          its 19 row words and its 65 meta words as they were before
    WAIT_OFF             1 x max_seqs     waiters: threads sleeping in Sequence.wait on the row, changed
                                          atomically (no lock); a commit wakes them if nonzero (_sequence/waiting.py)

Sequence row (int64 words)::

    0 STATE        0 free slot, 1 live sequence, 2 encoder cache of a sequence
    1 ID           sequence id; a restore brings a snapshot's back as a new incarnation (GEN, journal.py)
    2 START        first token cell of the sequence's range
    3 CAPACITY     cells in the range
    4 LENGTH       committed tokens; published by the lease holder after the data
    5 GEN          seqlock generation: odd while a structural op is changing the
                   row or its cells, even otherwise; bits 40.. the row's incarnation (journal.py)
    6 LEASE_PID    pid holding the write lease (0 = none)
    7 LEASE_CLIENT the holder's client key (see liveness): the lease is alive while its slot's
                   byte is locked and the slot's row holds this key (pids are for display only)
    8 LEASE_TOKEN  random id of the handle holding the lease inside that process
    9 WIN_OFF      index of the oldest token the bounded (sliding, chunked) layers still hold;
                   they hold tokens WIN_OFF..LENGTH-1 in the sequence slot's window buffer
    10 ENC_SLOT    1 + the slot of this sequence's encoder (cross-attention) row, 0 = none.
                   An encoder row has STATE 2 and ID = its sequence's id; its range holds
                   position-independent K/V of every layer (LENGTH tokens)
    11 FLAGS       bit 0 FINISHED: done, kept as a cached prefix, evictable (seq.finish());
                   bit 1 NOINDEX: blocks from IDX_BLOCKS on cannot be indexed (a token id -1, or
                   tokens moved by remove/shift_left) until a truncate below them;
                   bit 2 DISPLACER: an index entry of this row replaced an older holder (``prefixes/index.py``);
                   bit 4 STANDIN: its index entries stand for rows copied from it (see ``_engine/prefixes/index.py``);
                   bits 8..10 LEADS: how many of its leads (first 1, 2, 4, 8 tokens: prefixes/hashes.py LEAD)
                   are in the prefix index
    12 RECENCY     the recency clock's value at the last use (create, reuse as donor, finish)
    13 IDX_BLOCKS  whole 16-token blocks of this sequence that are in the prefix index
    14 CLEAN       tokens [0, CLEAN) are a faithful computation from position 0 (a donor may
                   give them); -1 = all of them. remove() lowers it: moved keys were re-rotated
    15 WBUF        which of the slot's two window buffers the bounded layers use (0 or 1)
    16 SPAN_PHYS   a borrower's first SPAN_CELLS cells of every full layer's K, V (int8 scales) are
    17 SPAN_CELLS  the pages of cells SPAN_PHYS.. (_engine/spans/mappings.py); FLAGS bit 3 LENT: may be lent
    18 SPAN_TAKEN  cells SPAN_PHYS.. kept taken, >= SPAN_CELLS: for views after a truncate inside the span

Client row: pid (for display), client key (see liveness; the row belongs to whoever holds the
slot's byte of the liveness file), flags (1 = read-write), reserved.

Data segment ``/dev/shm/skv_NAME.d`` (each region page-aligned, and each layer of K, V and the
scales too: ``layer_stride`` and ``scale_stride`` are whole pages, so ``page_unit`` cells from a
multiple of ``page_unit`` are whole pages of every per-layer array, docs/design.md §11; ``cells``: Offsets.cells)::

    K          [layers, cells, kv_heads, head_dim]  storage dtype
    V          [layers, cells, kv_heads, head_dim]  (bfloat16: uint16 bits; int8: codes)
    tokens     [cells] int64   token id per cell (-1 = none given)
    positions  [cells] int64   position per cell
    hashes     [cells] int64   at the last cell of each whole 16-token block of a sequence:
                                    the chained prefix hash of tokens 0..that cell (prefixes/hashes.py);
                                    at cell j - 1 of a sequence for each indexed lead j (1, 2, 4, 8):
                                    the lead hash of its first j tokens
    WK, WV     [bounded layers, 2 * max_seqs * window_cells, kv_heads, head_dim]: sliding and
               chunked layers keep their recent tokens here, in one of two buffers per sequence
               slot ((2 * slot + WBUF) * window_cells ...); a structural change writes the other
               buffer and switches WBUF (crash recovery). Their slices of K and V above stay
               unused (no pages)
    K scales   [layers, cells, kv_heads] float32   (int8 stores only)
    V scales   [layers, cells, kv_heads] float32   (int8 stores only)

The free ranges are not stored: they are the gaps between the live rows' ranges and spans,
computed under the store lock (a crash half-way through an allocation cannot leak cells).
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from shmkv._engine.table import dtypes as _dtypes
from shmkv.errors import CorruptStoreError, InvalidArgumentError, LayoutMismatchError

MAGIC = int.from_bytes(b"SHMKV\0HD", "little")
# 2: store identity and session tag (words 20, 21); prefix cache (counters, row flags, index, hashes region)
# 3: leads in the prefix index (row FLAGS bits 8..10, lead entries, a larger index); liveness by
#    client keys (creator word 13, lease word 7, client row word 1) and the liveness file
# 4: waiter counts (WAIT_OFF), the allocation counter (word 44); 5: shared prefix pages (row words 16, 17;
#    FLAGS bit 3; the span epoch, word 45); 6: lazy pages (holes), stand-ins (FLAGS bit 4), page mark (word 46),
#    lent past a length; 7: row word 18 (a span's cells kept taken for views after a truncate inside it) and
#    a data arena of Offsets.cells cells (max_tokens and the alignment slack)
FORMAT_VERSION = 7

# fixed block word indices
W_MAGIC, W_VERSION, W_HEADER_BYTES, W_DATA_BYTES, W_GENERATION = 0, 1, 2, 3, 4
W_LAYERS, W_KV_HEADS, W_HEAD_DIM, W_DTYPE, W_MAX_TOKENS = 5, 6, 7, 8, 9
W_MAX_SEQS, W_MAX_CLIENTS, W_CREATOR_PID, W_CREATOR_CLIENT = 10, 11, 12, 13
W_PERSISTENT, W_NEXT_ID, W_WINDOW, W_CHUNK, W_MEMORY, W_CHECKSUM = 14, 15, 16, 17, 18, 19
W_PREFIX_HITS, W_PREFIX_MISSES, W_PREFIX_REUSED, W_EVICTIONS, W_CLOCK, W_INDEX_SLOTS = 32, 33, 34, 35, 36, 37
W_INDEX_USED, W_UNDO_COUNT, W_UNDO_PID, W_BIRTHS, W_RECOVERIES, W_ALLOCS, W_SPANS = 38, 40, 41, 42, 43, 44, 45
W_IDENTITY, W_SESSION, W_PAGE_MARK = 20, 21, 46
FIXED_BYTES = 512
LAYER_KINDS_OFF = 512

# sequence row columns
STATE, ID, START, CAPACITY, LENGTH, GEN, LEASE_PID, LEASE_CLIENT, LEASE_TOKEN, WIN_OFF, ENC_SLOT = range(11)
FLAGS, RECENCY, IDX_BLOCKS, CLEAN, WBUF, SPAN_PHYS, SPAN_CELLS, SPAN_TAKEN = 11, 12, 13, 14, 15, 16, 17, 18
FINISHED, NOINDEX, DISPLACER, LENT, STANDIN = 1, 2, 4, 8, 16  # FLAGS bits
LEADS_SHIFT, LEADS_MASK = 8, 7 << 8  # FLAGS bits 8..10: leads indexed (0..len(LEAD))


def leads(flags: int) -> int:
    """Leads a row has in the prefix index, from its FLAGS word."""
    return (flags & LEADS_MASK) >> LEADS_SHIFT


def with_leads(flags: int, levels: int) -> int:
    """``flags`` with its LEADS bits set to ``levels``."""
    return (flags & ~LEADS_MASK) | (levels << LEADS_SHIFT)
LIVE, ENCODER = 1, 2  # STATE values (0: free slot)
SEQ_WORDS = 19
# client row columns
C_PID, C_KEY, C_FLAGS = 0, 1, 2
CLIENT_WORDS = 4
INDEX_WORDS = 4  # prefix index entry: hash, sequence id, slot, block
META_BYTES = 512  # packed seq.meta at most
META_RECORD = 8 + META_BYTES
UNDO_WORDS = 1 + SEQ_WORDS + META_RECORD // 8  # slot, row words, meta words


def index_slots(layout: Layout) -> int:
    """Entries of the prefix index: a power of two, at least twice the entries that can be valid
    (a block's and up to four leads a sequence: 4 + 1 a row keeps the old slack of one a row)."""
    need = 2 * (layout.max_tokens // 16 + 5 * layout.max_seqs)
    return max(64, 1 << (need - 1).bit_length())

LAYER_KINDS = ("full", "sliding", "chunked")
MAX_LAYERS = 4096
MAX_DIM = 1 << 20
MAX_STORE_BYTES = 1 << 46  # 64 TiB of data segment: below x86-64's 128 TiB of user address space


@functools.cache
def _bounded(layer_types: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(layer_types) if k != "full")


@functools.cache
def _keep(layer_types: tuple[str, ...], window: int, chunk: int) -> int:
    return max(window - 1 if "sliding" in layer_types else 0, chunk - 1 if "chunked" in layer_types else 0)


# (a frozen slots dataclass has no cached properties: the two above, asked on structural paths, are cached)
@dataclass(frozen=True, slots=True)
class Layout:
    """The geometry and limits of a store; identical in every attached process."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    max_tokens: int
    max_seqs: int
    layer_types: tuple[str, ...]
    window: int = 0
    chunk: int = 0
    memory: int = 0

    @property
    def geometry(self) -> tuple[int, int, int, str]:
        """What a snapshot must match: layers, kv_heads, head_dim, dtype."""
        return (self.layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def cell_items(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def bounded(self) -> tuple[int, ...]:
        """Indices of the sliding and chunked layers: they keep a bounded number of tokens."""
        return _bounded(self.layer_types)

    @property
    def keep(self) -> int:
        """Tokens before a new one that bounded layers must still hold to resume there."""
        return _keep(self.layer_types, self.window, self.chunk)

    def resume_from(self, n: int) -> int:
        """The oldest token a new token at position ``n`` needs on the bounded layers: the first of its
        window (sliding, ``window - 1`` before it) or of its chunk (chunked). A sequence whose bounded
        layers hold tokens from ``w`` on can resume at ``n`` iff ``w <= resume_from(n)``; ``n`` if none is bounded."""
        first = n
        if "sliding" in self.layer_types:
            first = min(first, max(0, n - self.window + 1))
        if "chunked" in self.layer_types:
            first = min(first, n - n % self.chunk)
        return first

    @property
    def step(self) -> int:
        """Most new tokens a bounded layer takes between commits (``memory``; default max(keep+1, 64))."""
        return self.memory or max(self.keep + 1, 64)

    @property
    def window_cells(self) -> int:
        """Cells of one sequence's buffer in each bounded layer (0 without bounded layers)."""
        return self.keep + self.step if self.bounded else 0


def _positive(name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name}={value!r} must be an int between 1 and {limit}")
    v = int(value)
    if not 1 <= v <= limit:
        raise InvalidArgumentError(f"{name}={v} must be between 1 and {limit}")
    return v


def make_layout(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    max_tokens: int,
    max_seqs: int,
    layer_types: list[str] | tuple[str, ...] | None = None,
    window: int | None = None,
    chunk: int | None = None,
    memory: int | None = None,
) -> Layout:
    """Validate create() arguments into a Layout, naming any bad value."""
    layers = _positive("layers", layers, MAX_LAYERS)
    kv_heads = _positive("kv_heads", kv_heads, MAX_DIM)
    head_dim = _positive("head_dim", head_dim, MAX_DIM)
    max_tokens = _positive("max_tokens", max_tokens, 1 << 40)
    max_seqs = _positive("max_seqs", max_seqs, 1 << 20)
    if dtype is None:  # numpy would read None as float64
        raise InvalidArgumentError(f"dtype=None: name a storage dtype, one of {sorted(_dtypes._TABLE)}")
    dtype = _dtypes.canonical(dtype)
    if layer_types is None:
        layer_types = ("full",) * layers
    if isinstance(layer_types, str) or len(layer_types) != layers:
        raise InvalidArgumentError(
            f"layer_types={layer_types!r} must list one kind per layer ({layers} layers), "
            f"each one of {LAYER_KINDS}"
        )
    for i, kind in enumerate(layer_types):
        if kind not in LAYER_KINDS:
            raise InvalidArgumentError(f"layer_types[{i}]={kind!r} is not one of {LAYER_KINDS}")
    kinds = tuple(layer_types)
    for kind, value, what in (("sliding", window, "window"), ("chunked", chunk, "chunk")):
        if kind in kinds:
            _positive(what, value, 1 << 30)
        elif value:
            raise InvalidArgumentError(f"{what}={value!r} given but no layer is {kind!r} (layer_types={list(kinds)})")
    bounded = any(k != "full" for k in kinds)
    if memory:  # None or 0: the default
        if not bounded:
            raise InvalidArgumentError(f"memory={memory!r} given but no layer is 'sliding' or 'chunked'")
        _positive("memory", memory, 1 << 30)
    if bounded and dtype not in _dtypes.PLAIN:
        from shmkv.errors import NotSupportedError

        raise NotSupportedError(
            f"sliding and chunked layers are stored as plain floats, not dtype={dtype!r}: use dtype='float16', "
            "'float32' or 'float64' (int8 and bfloat16 stores hold full-attention layers only)"
        )
    return Layout(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        max_tokens=max_tokens,
        max_seqs=max_seqs,
        layer_types=kinds,
        window=int(window or 0),
        chunk=int(chunk or 0),
        memory=int(memory or 0),
    )


def _align(n: int, to: int = 8) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class Offsets:
    """Byte offsets of the tables and regions, derived from a Layout."""

    seq_off: int
    client_off: int
    index_off: int
    index_slots: int
    meta_off: int
    undo_off: int
    wait_off: int
    header_bytes: int
    k_off: int
    v_off: int
    tokens_off: int
    positions_off: int
    hashes_off: int
    wk_off: int  # bounded layers' K buffers: [n_bounded, max_seqs * window_cells, kv_heads, head_dim]
    wv_off: int
    w_stride: int  # bytes between bounded layers inside a window region
    ks_off: int  # int8 scales of K (0 bytes for other dtypes)
    vs_off: int
    scale_stride: int  # bytes between layers inside a scales region
    data_bytes: int
    layer_stride: int  # bytes between layers inside K or V (a whole number of pages)
    cell_bytes: int  # bytes of one token of one layer (kv_heads * head_dim * itemsize)
    page_unit: int  # the fewest cells whose bytes fill whole pages in every per-layer array (§11)
    cells: int  # of the data arena's arrays: max_tokens and the slack alignment may leave unused (offsets)


@functools.lru_cache(maxsize=256)  # (an attach asks three times: header check, segment size, engine)
def offsets(layout: Layout, max_clients: int) -> Offsets:
    seq_off = LAYER_KINDS_OFF + _align(layout.layers)
    client_off = seq_off + layout.max_seqs * SEQ_WORDS * 8
    index_off = client_off + max_clients * CLIENT_WORDS * 8
    slots = index_slots(layout)
    meta_off = index_off + slots * INDEX_WORDS * 8
    undo_off = meta_off + layout.max_seqs * META_RECORD
    header_bytes = (wait_off := undo_off + layout.max_seqs * UNDO_WORDS * 8) + layout.max_seqs * 8
    page, k_off = mmap.PAGESIZE, 0  # each per-layer array starts on a page (docs/design.md §11, the module docstring)
    cell_bytes, scaled = layout.cell_items * _dtypes.itemsize(layout.dtype), layout.dtype == "int8"
    unit = math.lcm(page // math.gcd(page, cell_bytes), page // math.gcd(page, layout.kv_heads * 4) if scaled else 1)
    # slack: < unit cells before each range on a unit (one of >= unit cells), so max_tokens tokens fit
    # however aligned; ranges and spans take <= max_tokens cells (Arena.free_tokens); unused: no pages
    cells = layout.max_tokens + min(layout.max_seqs, layout.max_tokens // unit) * (unit - 1)
    layer_stride = _align(cells * cell_bytes, page)
    v_off = _align(k_off + layout.layers * layer_stride, page)
    tokens_off = _align(v_off + layout.layers * layer_stride, page)
    positions_off = _align(tokens_off + cells * 8, page)
    scale_stride = _align(cells * layout.kv_heads * 4, page) if scaled else 0
    w_stride = 2 * layout.max_seqs * layout.window_cells * cell_bytes  # two buffers a slot
    hashes_off = _align(positions_off + cells * 8, page)
    wk_off = _align(hashes_off + cells * 8, page)
    wv_off = _align(wk_off + len(layout.bounded) * w_stride, page)
    ks_off = _align(wv_off + len(layout.bounded) * w_stride, page)
    vs_off = _align(ks_off + layout.layers * scale_stride, page)
    data_bytes = _align(vs_off + layout.layers * scale_stride, page)
    return Offsets(seq_off, client_off, index_off, slots, meta_off, undo_off, wait_off, header_bytes, k_off, v_off,
                   tokens_off, positions_off, hashes_off, wk_off, wv_off, w_stride, ks_off, vs_off,
                   scale_stride, data_bytes, layer_stride, cell_bytes, unit, cells)


_CHECKED_WORDS = [W_LAYERS, W_KV_HEADS, W_HEAD_DIM, W_DTYPE, W_MAX_TOKENS, W_MAX_SEQS, W_MAX_CLIENTS,
                  W_CREATOR_PID, W_CREATOR_CLIENT, W_PERSISTENT, W_WINDOW, W_CHUNK, W_MEMORY, W_IDENTITY, W_SESSION]
_CHECKED_BYTES = struct.Struct(f"={len(_CHECKED_WORDS)}q")  # (their int64 bytes, as the header holds them)


def _checksum(words: np.ndarray | list[int], kinds: bytes) -> int:
    # only words that never change after create (not the generation or next id); an array or its list
    return zlib.crc32(kinds, zlib.crc32(_CHECKED_BYTES.pack(*[int(words[i]) for i in _CHECKED_WORDS])))


def write(words: np.ndarray, raw: np.ndarray, layout: Layout, off: Offsets, *, max_clients: int,
          creator_pid: int, creator_client: int, persistent: bool, identity: int, session: int = 0) -> None:
    """Fill a zeroed header; the magic word goes last so attachers never see half of it."""
    words[W_VERSION] = FORMAT_VERSION
    words[W_HEADER_BYTES] = off.header_bytes
    words[W_DATA_BYTES] = off.data_bytes
    words[W_LAYERS] = layout.layers
    words[W_KV_HEADS] = layout.kv_heads
    words[W_HEAD_DIM] = layout.head_dim
    words[W_DTYPE] = _dtypes.code(layout.dtype)
    words[W_MAX_TOKENS] = layout.max_tokens
    words[W_MAX_SEQS] = layout.max_seqs
    words[W_MAX_CLIENTS] = max_clients
    words[W_CREATOR_PID] = creator_pid
    words[W_CREATOR_CLIENT] = creator_client
    words[W_PERSISTENT] = int(persistent)
    words[W_NEXT_ID] = 1
    words[W_WINDOW] = layout.window
    words[W_CHUNK] = layout.chunk
    words[W_MEMORY] = layout.memory
    words[W_INDEX_SLOTS] = off.index_slots
    words[W_IDENTITY] = identity
    words[W_SESSION] = session
    kinds = bytes(LAYER_KINDS.index(k) for k in layout.layer_types)
    raw[LAYER_KINDS_OFF : LAYER_KINDS_OFF + len(kinds)] = np.frombuffer(kinds, np.uint8)
    words[W_CHECKSUM] = _checksum(words, kinds)
    words[W_MAGIC] = MAGIC


def read(words: np.ndarray, raw: np.ndarray, segment_size: int, name: str) -> tuple[Layout, int]:
    """Decode and check a header; return its Layout and max_clients.

    Raises CorruptStoreError for anything that is not an intact shmkv header.
    """
    if segment_size < FIXED_BYTES:
        raise CorruptStoreError(f"segment {name!r} is {segment_size} bytes, too small for a shmkv header")
    w = words.tolist()  # (Python ints, read once: what follows decides from this copy)
    if w[W_MAGIC] != MAGIC:
        raise CorruptStoreError(f"segment {name!r} is not a shmkv store (bad magic)")
    version = w[W_VERSION]
    if version != FORMAT_VERSION:
        raise CorruptStoreError(f"store {name!r} has header version {version}; this shmkv reads version "
                                f"{FORMAT_VERSION}: open it with the shmkv that made it, or remove it "
                                f"(shmkv rm {name}) and create it again")
    layers = w[W_LAYERS]
    if not 1 <= layers <= MAX_LAYERS or LAYER_KINDS_OFF + layers > segment_size:
        raise CorruptStoreError(f"store {name!r} header is damaged (layers={layers})")
    kinds = raw[LAYER_KINDS_OFF : LAYER_KINDS_OFF + layers].tobytes()
    if _checksum(w, kinds) != w[W_CHECKSUM]:
        raise CorruptStoreError(f"store {name!r} header is damaged (layout checksum mismatch)")
    try:
        layer_types = tuple(LAYER_KINDS[b] for b in kinds)
        dtype = _dtypes.from_code(w[W_DTYPE])
    except (IndexError, KeyError, ValueError):
        raise CorruptStoreError(f"store {name!r} header is damaged (layer kinds or dtype)") from None
    layout = Layout(layers=layers, kv_heads=w[W_KV_HEADS], head_dim=w[W_HEAD_DIM], dtype=dtype,
                    max_tokens=w[W_MAX_TOKENS], max_seqs=w[W_MAX_SEQS], layer_types=layer_types,
                    window=w[W_WINDOW], chunk=w[W_CHUNK], memory=w[W_MEMORY])
    max_clients = w[W_MAX_CLIENTS]
    off = offsets(layout, max_clients)
    if off.header_bytes != w[W_HEADER_BYTES] or off.header_bytes > segment_size:
        raise CorruptStoreError(
            f"store {name!r} header is damaged (tables need {off.header_bytes} bytes, "
            f"segment has {segment_size})"
        )
    if off.data_bytes != w[W_DATA_BYTES]:
        raise CorruptStoreError(f"store {name!r} header is damaged (data size mismatch)")
    return layout, max_clients


def check_same(expected: Layout, actual: Layout, what: str) -> None:
    if expected != actual:
        diffs = [
            f"{f}: {getattr(expected, f)!r} != {getattr(actual, f)!r}"
            for f in Layout.__dataclass_fields__
            if getattr(expected, f) != getattr(actual, f)
        ]
        raise LayoutMismatchError(f"{what} layouts differ ({'; '.join(diffs)})")
