"""The prefix index: which sequences hold the prefix a chained block hash names (docs/design.md §8).

Layout: an open-addressing table in the header segment, ``INDEX_WORDS`` int64 words an entry::

    word  field
    0     hash    chained hash of tokens [0, (block + 1) * 16) (see hashes.py); 0 = empty slot
    1     id      sequence id of the holder
    2     slot    the holder's row in the sequence table
    3     block   which block of the holder (the hash names its first block + 1 blocks);
                  bit 62 (DISPLACED): this entry took the place of an older holder of its hash;
                  bit 61 (LEADMARK): a lead entry, the low bits are j (the hash names the
                  holder's first j tokens, j in LEAD = 1, 2, 4, 8; see hashes.lead_hash)

Leads make the cache token-granular from token 0: a prompt whose shared prefix is shorter than
one block is found through the holders of its longest lead (verified and extended token by
token like a block hit). A lead entry is valid while its holder row is live with that id, has
the lead indexed (FLAGS bits LEADS: lead j is the ``lead_levels(j)``-th) and the hashes region
holds the same hash at the holder's cell j - 1 (cells no block hash uses: those sit at 15, 31..).

Linear probing from ``hash & (slots - 1)``. Entries are never deleted one by one: an entry is
*valid* while its holder row is live with that id, has the block indexed (``block <
IDX_BLOCKS``) and the hashes region holds the same hash at the block's last cell. So free,
eviction, truncate and moves cost the index nothing; an insert reuses an invalid entry along its
probe, and a rebuild (under the lock) drops every invalid one when the table fills to 3/4.

At most ``DUP`` holders a hash: a new holder replaces the least recently used one, so the index
keeps the most recent holders of a shared prefix (a system prompt held by hundreds of finished
requests costs ``DUP`` entries a block), and those are the last that LRU eviction takes.
The holder replaced keeps its entries for its other blocks, so once every entry of that hash is
gone, its later blocks would be out of reach of the lookup (which needs the shorter prefixes
held to go on to longer ones). So the entry that replaced it is marked DISPLACED (and its row
DISPLACER), and freeing a row with such entries passes the mark on: to the hash's other valid
entries if there are any, else to a live holder found in the sequence table, which gets the
entry back (``displaced_by`` / ``rehome``).

A sequence whose prefix was copied from another's (a reuse: ``create_sequence(prefix=)``, also
``copy_prefix`` and ``fork``) gets no entries for the blocks and leads it copied (inserting one per
block was most of the time of a create over a cached prefix): it holds the same hashes
as its source, which is marked STANDIN (its entries stand for theirs, as if each were DISPLACED).
Before a row that stands for others stops holding blocks (freed or evicted: ``Arena.free_row``;
truncated, rewritten by remove, shift_left, copy_prefix or a restore: ``Arena.unindexing``), the
holders of what it loses get entries (``rehome``, which finds them in the sequence table): so every
block a live row has indexed keeps a valid entry or one that stands for it, and a crash half-way
leaves the row still holding (and standing for) what is not yet rehomed.

Concurrency: entries change only under the store lock. Readers (``match_prefix`` on any
attachment, read-only too) take no lock: they may see a torn or stale entry, so every hit is
verified against the holder's stored token ids and positions, under the holder row's seqlock,
before it counts. A lookup costs one hash a block of the prompt plus a binary search over blocks:
the same with ten or ten thousand cached sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shmkv._engine.locking import crash as _crash
from shmkv._engine.table.header import (
    CLEAN,
    DISPLACER,
    ENC_SLOT,
    FLAGS,
    GEN,
    ID,
    IDX_BLOCKS,
    INDEX_WORDS,
    LEADS_MASK,
    LEADS_SHIFT,
    leads,
    with_leads,
    LENGTH,
    LIVE,
    RECENCY,
    SEQ_WORDS,
    START,
    STANDIN,
    STATE,
    WIN_OFF,
    Layout,
)
from shmkv._engine.prefixes.hashes import (BLOCK, LEAD, ROOT, PrefixHash, as_tokens, block_hashes, lead_hash,
                                                lead_levels)
from shmkv._engine.prefixes.scan import LEADMARK, copies, table_holders
from shmkv._engine.table.seqlock import VERIFY, seqlocked

DUP = 4  # holders kept a hash
DISPLACED = 1 << 62  # in an entry's block word: it replaced an older holder of its hash
COVERS = DISPLACER | STANDIN  # row FLAGS: its entries may stand for other holders
_LEAD_LEVEL = {j: i + 1 for i, j in enumerate(LEAD)}


def _miss() -> int:
    """A donor whose row stayed odd through VERIFY's tries: not a donor now."""
    return 0


class PrefixIndex:
    """Typed access to the index table, the sequence rows it points into and the hashes region.

    ``table`` and ``rows`` are int64 memoryviews (item reads give Python ints, fast); ``tokens``,
    ``positions`` and ``hashes`` numpy views of the data segment.
    """

    def __init__(self, table: memoryview, rows: memoryview, tokens: np.ndarray, positions: np.ndarray,
                 hashes: np.ndarray, *, layout: Layout) -> None:
        self._t = table
        self._slots = len(table) // INDEX_WORDS
        self._mask = self._slots - 1
        self._rows = rows
        self._tokens = tokens
        self._positions = positions
        self._hashes = hashes
        self._layout = layout
        self._bounded = bool(layout.bounded)

    # -- entries -----------------------------------------------------------------

    def _valid(self, i: int) -> bool:
        t, r = self._t, self._rows
        e = i * INDEX_WORDS
        h, sid, slot, blk = t[e], t[e + 1], t[e + 2], t[e + 3] & ~DISPLACED
        if not 0 <= slot < len(r) // SEQ_WORDS:  # a torn entry read without the lock
            return False
        b = slot * SEQ_WORDS
        if r[b + STATE] != LIVE or r[b + ID] != sid:
            return False
        if blk & LEADMARK:
            lvl = _LEAD_LEVEL.get(blk & ~LEADMARK, 0)
            if not 0 < lvl <= leads(r[b + FLAGS]):
                return False
            cell = r[b + START] + (blk & ~LEADMARK) - 1
        elif not 0 <= blk < r[b + IDX_BLOCKS]:
            return False
        else:
            cell = r[b + START] + (blk + 1) * BLOCK - 1
        return 0 <= cell < len(self._hashes) and int(self._hashes[cell]) == h

    def holders(self, h: int) -> list[tuple[int, int]]:
        """(id, slot) of the valid holders of ``h``."""
        t = self._t
        return [(t[i * INDEX_WORDS + 1], t[i * INDEX_WORDS + 2]) for i in self._valid_entries(h)]

    def insert(self, h: int, seq_id: int, slot: int, block: int, displaced: bool = False) -> int:
        """Record that sequence ``seq_id`` (row ``slot``) holds ``h`` as its block ``block`` (lock held).
        ``displaced``: mark the entry DISPLACED (rebuild and rehome carry a mark over).

        Returns 1 if an empty slot was taken (the caller counts occupancy), else 0.
        """
        t, mask, r = self._t, self._mask, self._rows
        i = h & mask
        reuse = -1  # first invalid entry on the probe
        same: list[int] = []
        for _ in range(self._slots):
            eh = t[i * INDEX_WORDS]
            if eh == 0:
                break
            if eh == h and t[i * INDEX_WORDS + 1] == seq_id and t[i * INDEX_WORDS + 3] & ~DISPLACED == block:
                return 0  # already there
            if not self._valid(i):
                if reuse < 0:
                    reuse = i
            elif eh == h:
                same.append(i)
            i = (i + 1) & mask
        else:
            # no empty entry anywhere (the occupancy count drifted, or the table was scribbled on):
            # an invalid entry is taken below; with none, the block stays unindexed. The index is a
            # hint, and this runs after a commit published its length (Writer.index_committed): it
            # must not raise there
            if reuse < 0:
                return 0
        taken = 0
        if len(same) >= DUP:  # replace the least recently used holder
            reuse = min(same, key=lambda j: r[t[j * INDEX_WORDS + 2] * SEQ_WORDS + RECENCY])
            displaced = True
        elif reuse < 0:
            reuse, taken = i, 1
        e = reuse * INDEX_WORDS
        t[e] = 0  # a reader passing by sees an empty-hash entry, never a mixed one
        t[e + 1], t[e + 2], t[e + 3] = seq_id, slot, block | (DISPLACED if displaced else 0)
        t[e] = h
        if displaced:
            r[slot * SEQ_WORDS + FLAGS] |= DISPLACER
        return taken

    def _entry(self, h: int, seq_id: int, block: int) -> int:
        """The index of the entry naming ``seq_id``'s block ``block`` under ``h``, or -1."""
        t, mask = self._t, self._mask
        i = h & mask
        for _ in range(self._slots):
            e = i * INDEX_WORDS
            if t[e] == 0:
                return -1
            if t[e] == h and t[e + 1] == seq_id and t[e + 3] & ~DISPLACED == block:
                return i
            i = (i + 1) & mask
        return -1

    def displaced_by(self, slot: int, blocks: int = 0, levels: int = 0) -> list[tuple[int, int]]:
        """(hash, block) of the entries of the sequence in ``slot`` that may stand for other holders
        (lock held; asked before the row stops holding them): those that replaced an older holder
        (DISPLACED) of a DISPLACER row, and all of a STANDIN row's (rows copied from it have no
        entries of their own for what they copied). Only its blocks from ``blocks`` on and its leads
        past the first ``levels`` (what a truncate to fewer tokens takes away; 0, 0: all of them)."""
        r = self._rows
        b = slot * SEQ_WORDS
        flags = r[b + FLAGS]
        if not flags & COVERS:
            return []
        start, sid, nb = r[b + START], r[b + ID], r[b + IDX_BLOCKS]
        lead_js = LEAD[levels : leads(flags)]
        if flags & STANDIN:  # all of them: no lookups (rehome finds who else has an entry)
            if start < 0 or start + nb * BLOCK > len(self._hashes):
                return []
            out = [(int(h), blk) for blk, h in enumerate(
                self._hashes[start + (blocks + 1) * BLOCK - 1 : start + nb * BLOCK : BLOCK].tolist(), blocks)]
            return out + [(int(self._hashes[start + j - 1]), LEADMARK | j) for j in lead_js]
        out = []
        for blk in range(blocks, nb):
            h = int(self._hashes[start + (blk + 1) * BLOCK - 1])
            i = self._entry(h, sid, blk)
            if i >= 0 and self._t[i * INDEX_WORDS + 3] & DISPLACED:
                out.append((h, blk))
        for j in lead_js:  # leads are displaced like blocks (a shared first token)
            h = int(self._hashes[start + j - 1])
            i = self._entry(h, sid, LEADMARK | j)
            if i >= 0 and self._t[i * INDEX_WORDS + 3] & DISPLACED:
                out.append((h, LEADMARK | j))
        return out

    def rehome(self, lost: list[tuple[int, int]], exclude: int = -1) -> int:
        """The row that held ``lost`` (from displaced_by) is about to stop holding them, or has
        (lock held; ``exclude``: that row, still live): each hash's mark goes to its other valid
        entries, or, when none is left, a live holder without an entry (found in the sequence
        table; the most recent) gets one, marked when it is not the only one. Returns slots taken.

        Called before the row changes (Arena.free_row, Arena.unindexing): a crash half-way leaves
        the row holding what is not yet rehomed, still marked."""
        t, r = self._t, self._rows
        need = []
        for h, blk in lost:
            kept = [i for i in self._valid_entries(h) if t[i * INDEX_WORDS + 2] != exclude]
            for i in kept:
                if not t[i * INDEX_WORDS + 3] & DISPLACED:
                    t[i * INDEX_WORDS + 3] |= DISPLACED
                r[t[i * INDEX_WORDS + 2] * SEQ_WORDS + FLAGS] |= DISPLACER
            if not kept:
                need.append((h, blk))
        if not need:
            return 0
        taken = 0
        rows = np.frombuffer(r, np.int64).reshape(-1, SEQ_WORDS)
        for n, (k, slot, count) in enumerate(table_holders(rows, self._hashes, need, exclude)):
            if n == 1:
                _crash.point("free.rehomed")  # one holder has its entry, the others not yet
            taken += self.insert(need[k][0], int(rows[slot, ID]), slot, need[k][1], displaced=count > 1)
        return taken

    def _valid_entries(self, h: int) -> list[int]:
        """Indices of the valid entries of ``h``."""
        t, mask = self._t, self._mask
        i, out = h & mask, []
        for _ in range(self._slots):
            eh = t[i * INDEX_WORDS]
            if eh == 0:
                break
            if eh == h and self._valid(i):
                out.append(i)
            i = (i + 1) & mask
        return out

    def rebuild(self) -> int:
        """Drop invalid entries (lock held); return the entries kept (see _rebuild)."""
        return _rebuild(self)

    def full(self, used: int) -> bool:
        return 4 * used >= 3 * self._slots

    # -- sequences ---------------------------------------------------------------

    def index_blocks(self, slot: int, upto: int) -> int:
        """Hash and index the whole blocks of the sequence in ``slot`` from IDX_BLOCKS up to
        token ``upto`` (lock held), stopping at a block with a token id -1; returns slots taken.
        Sets IDX_BLOCKS; the caller sets NOINDEX when it stopped early."""
        r = self._rows
        b = slot * SEQ_WORDS
        start, done, sid = r[b + START], r[b + IDX_BLOCKS], r[b + ID]
        clean = r[b + CLEAN]
        if clean >= 0:
            upto = min(upto, clean)
        taken = self._index_leads(slot, upto)
        nb = upto // BLOCK
        if nb <= done:
            return taken
        toks = self._tokens[start + done * BLOCK : start + nb * BLOCK]
        # a block is indexable while its ids are given (>= 0) and its positions are its indices
        # (a donor's tokens sit at positions 0..n-1): the first block breaking either stops it
        pos = self._positions[start + done * BLOCK : start + nb * BLOCK]
        bad = np.flatnonzero((toks < 0) | (pos != np.arange(done * BLOCK, nb * BLOCK)))
        if bad.size:
            nb = done + int(bad[0]) // BLOCK
            if nb <= done:
                return taken
            toks = toks[: (nb - done) * BLOCK]
        parent = int(self._hashes[start + done * BLOCK - 1]) if done else ROOT
        hs = block_hashes(toks, parent=parent)
        for j, h in enumerate(hs):
            blk = done + j
            self._hashes[start + (blk + 1) * BLOCK - 1] = h
            r[b + IDX_BLOCKS] = blk + 1  # before insert: the entry must validate
            taken += self.insert(h, sid, slot, blk)
        return taken

    def _index_leads(self, slot: int, upto: int) -> int:
        """Index the leads of the sequence in ``slot`` that its first ``upto`` tokens hold and the
        index lacks (lock held), stopping before a token id -1 or a position not its index;
        returns slots taken. Sets the row's LEADS bits."""
        r = self._rows
        b = slot * SEQ_WORDS
        have, want = leads(r[b + FLAGS]), lead_levels(upto)
        if want <= have:
            return 0
        start, sid = r[b + START], r[b + ID]
        top = LEAD[want - 1]
        toks = self._tokens[start : start + top]
        bad = np.flatnonzero((toks < 0) | (self._positions[start : start + top] != np.arange(top)))
        if bad.size:
            want = lead_levels(int(bad[0]))
        t = as_tokens(toks)
        taken = 0
        for lvl in range(have, want):
            j = LEAD[lvl]
            h = lead_hash(t, j)
            self._hashes[start + j - 1] = h
            r[b + FLAGS] = with_leads(r[b + FLAGS], lvl + 1)  # before insert: the entry must validate
            taken += self.insert(h, sid, slot, LEADMARK | j)
        return taken

    def match(self, tokens: object, limit: int | None = None) -> tuple[int, int, int]:
        """The longest verified prefix of ``tokens`` some sequence holds from position 0.

        Returns (n, donor id, donor slot); n = 0 (and id 0, slot -1) on a miss. At most
        ``limit`` tokens (default len - 1). Lock-free: safe on read-only attachments.
        """
        t = as_tokens(tokens)
        limit = len(t) - 1 if limit is None else min(limit, len(t))
        nb = max(limit, 0) // BLOCK
        if nb == 0:
            return self._match_leads(t, limit)
        hs = block_hashes(t, limit=nb)
        lo, best = _held_blocks(self.holders, hs, nb)
        # the holders of the longest indexed prefix, most recent first; a holder may fail its
        # check (stale, or its sliding/chunked layers moved on): then the next, then shorter prefixes
        tried: set[tuple[int, int]] = set()
        while lo > 0:
            found = self._best(t, limit, best, lo * BLOCK, tried, key=(hs[lo - 1], lo - 1))
            if found[0]:
                return found
            lo -= 1
            best = self.holders(hs[lo - 1]) if lo else []
        return self._match_leads(t, limit)

    def _match_leads(self, t: np.ndarray, limit: int) -> tuple[int, int, int]:
        """match() below one block: the holders of the longest lead of ``t`` that has any (most
        recent first), each verified and extended token by token; then shorter leads."""
        for lvl in range(lead_levels(limit), 0, -1):
            j = LEAD[lvl - 1]
            h = lead_hash(t, j)
            found = self._best(t, limit, self.holders(h), j, set(), key=(h, LEADMARK | j))
            if found[0]:
                return found
        return 0, 0, -1

    def _best(self, t: np.ndarray, limit: int, holders: list[tuple[int, int]], floor: int,
              tried: set[tuple[int, int]], *, key: tuple[int, int]) -> tuple[int, int, int]:
        """The holder (most recent first, each tried once) whose verified match is longest. When
        it stops short of ``limit`` and a holder stands for copies (STANDIN), the rows holding
        ``key`` (hash, block) whose next token is ``t``'s are tried too: a copy that went on past
        its source inside a block has no entry to be found by."""
        r = self._rows
        best = self._longest(t, limit, sorted(holders, key=lambda x: -r[x[1] * SEQ_WORDS + RECENCY]), floor,
                             tried, best=(0, 0, -1))
        if best[0] < limit and any(r[x[1] * SEQ_WORDS + FLAGS] & STANDIN for x in holders):
            best = self._longest(t, limit, copies(r, self._hashes, self._tokens, key, t=t, n=best[0]), floor,
                                 tried, best=best)
        return best

    def _longest(self, t: np.ndarray, limit: int, cands: list[tuple[int, int]], floor: int,
                 tried: set[tuple[int, int]], *, best: tuple[int, int, int]) -> tuple[int, int, int]:
        for sid, slot in cands:
            if (sid, slot) in tried:
                continue
            tried.add((sid, slot))
            n = self._verify(t, limit, sid, slot, floor)
            if n > best[0]:
                best = n, sid, slot
                if n >= limit:
                    break  # nobody can give more
        return best

    def _verify(self, t: np.ndarray, limit: int, sid: int, slot: int, floor: int) -> int:
        """Tokens of ``t`` (at most ``limit``) that sequence ``sid`` holds at positions 0..n-1,
        read under its seqlock; 0 if fewer than ``floor`` (a stale or colliding entry)."""
        r = self._rows
        b = slot * SEQ_WORDS

        def read() -> int:
            if r[b + STATE] != LIVE or r[b + ID] != sid:
                return 0
            if r[b + ENC_SLOT]:
                return 0  # its K/V were computed against its own encoder output: no donor for another
            start, length, clean, woff = r[b + START], r[b + LENGTH], r[b + CLEAN], r[b + WIN_OFF]
            end = min(length, limit, clean if clean >= 0 else length)
            if end < floor or start + end > len(self._tokens):
                return 0
            # ids everywhere (the hash is a hint, the ids are the proof); positions past the indexed
            # blocks (indexing checked those)
            ok = self._tokens[start : start + end] == t[:end]
            if end > floor:
                ok[floor:] &= self._positions[start + floor : start + end] == np.arange(floor, end)
            bad = np.flatnonzero(~ok)
            n = int(bad[0]) if bad.size else end
            if n < floor:
                return 0
            if self._bounded and woff > self._layout.resume_from(n):
                return 0  # its sliding/chunked layers no longer hold what a resume at n needs
            return n

        return seqlocked(r, b + GEN, read, VERIFY, _miss)  # a row changing all along: a miss



def _held_blocks(holders: Callable[[int], list[tuple[int, int]]], hs: list[PrefixHash],
                 nb: int) -> tuple[int, list[tuple[int, int]]]:
    """PrefixIndex.match: the largest block count of ``hs`` (a prompt's nb block hashes) with a
    valid holder, and its holders."""
    # The largest block count with a valid holder. Holding is monotone (a row that indexed k
    # blocks indexed every shorter prefix, and each keeps an entry or one that stands for
    # it), so it is found by steps down from the whole prompt (1, 1, 2, 4, ... blocks), then a
    # binary search in the last step: a prompt that goes on a block or two past a cached one (a
    # request after its system prompt) costs 2-3 probes, not log2 of its blocks
    lo, hi, best, down = 0, nb, [], 0
    while hi > 0:
        mid = max(hi - (1 << max(down - 1, 0)) + 1, 1)
        hol = holders(hs[mid - 1])
        if hol:
            lo, best = mid, hol
            break
        hi, down = mid - 1, down + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        hol = holders(hs[mid - 1])
        if hol:
            lo, best = mid, hol
        else:
            hi = mid - 1
    return lo, best


def _rebuild(index: PrefixIndex) -> int:
    """PrefixIndex.rebuild: validity is judged in numpy over the whole table; only the kept
    entries are re-inserted one by one."""
    e = np.frombuffer(index._t, np.int64).reshape(-1, INDEX_WORDS).copy()
    rows = np.frombuffer(index._rows, np.int64).reshape(-1, SEQ_WORDS)
    h, sid, slot, marked = e.T
    blk = marked & ~DISPLACED
    lead = (blk & LEADMARK) != 0
    j = np.where(lead, blk & ~LEADMARK, 0)  # a lead's length
    blk = np.where(lead, 0, blk)
    ok = (h != 0) & (slot >= 0) & (slot < len(rows))
    r = rows[np.where(ok, slot, 0)]
    ok &= (r[:, STATE] == LIVE) & (r[:, ID] == sid)
    have = (r[:, FLAGS] & LEADS_MASK) >> LEADS_SHIFT
    level = np.searchsorted(np.array(LEAD), j, side="right")  # lead j is the level-th
    ok &= np.where(lead, np.isin(j, LEAD) & (level <= have),
                   (blk >= 0) & (blk < r[:, IDX_BLOCKS]))
    cell = np.where(ok, r[:, START] + np.where(lead, j - 1, (blk + 1) * BLOCK - 1), 0)
    ok &= (cell >= 0) & (cell < len(index._hashes))
    ok &= index._hashes[np.where(ok, cell, 0)] == h
    np.frombuffer(index._t, np.int64)[:] = 0
    for hh, ss, sl, bb in e[ok].tolist():
        index.insert(hh, ss, sl, bb & ~DISPLACED, displaced=bool(bb & DISPLACED))
    return int(ok.sum())
