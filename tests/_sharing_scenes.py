"""Scenes the shared-pages tests (tests/test_sharing_*.py) start from, in one layout (3 layers, 4 kv
heads, 64 dims; float16 unless asked): a store, a finished donor, contents as bytes, K/V that are a
function of the token ids (any cell read can be checked), this process's mappings of a store, and
``share.libc_mmap`` refusing spans as the kernel does at vm.max_map_count."""

from __future__ import annotations

import ctypes
import errno

import numpy as np

from procs.share_reads import kv_of

from shmkv._engine.spans import mappings as share
from shmkv.store._store import engine_of

L, H, D = 3, 4, 64
PROMPT = 300


def sharing_store(make_store, dtype="float16", **kw):
    args = dict(layers=L, kv_heads=H, head_dim=D, dtype=dtype, max_tokens=16384, max_seqs=32)
    args.update(kw)
    return make_store(**args)


def kv_pair(rng, n):
    shape = (L, n, H, D)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def make_donor(store, rng, n=PROMPT, first=1000, finish=True):
    prompt = np.arange(first, first + n)
    d = store.create_sequence(capacity=1024, prefix=prompt)
    k, v = kv_pair(rng, n - len(d))
    d.extend(k, v, tokens=prompt[len(d):])
    if finish:
        d.finish()
    return d, prompt


def seeded_donor(store, n=PROMPT, capacity=1024, first=1000, finish=True):
    """A donor of token ids ``first``.. (``n`` of them) whose K/V are drawn from a generator seeded
    with ``n`` (float64, as the store's dtype keeps them); returns (donor, prompt)."""
    prompt = np.arange(first, first + n)
    d = store.create_sequence(capacity=capacity, prefix=prompt)
    rng = np.random.default_rng(n)
    shape = (store.layout.layers, n - len(d), store.layout.kv_heads, store.layout.head_dim)
    d.extend(rng.standard_normal(shape), rng.standard_normal(shape), tokens=prompt[len(d):])
    if finish:
        d.finish()
    return d, prompt


def start_of(store, seq_id):
    """The first cell of ``seq_id``'s range."""
    return next(s.start for s in store.sequences() if s.id == seq_id)


def kv_and_tokens(seq, layers=L):
    """Every layer's committed K and V, then the token ids, of ``seq`` as bytes."""
    return [(np.asarray(seq.keys(i)).tobytes(), np.asarray(seq.values(i)).tobytes()) for i in range(layers)] + [
        seq.tokens.tobytes()]


def kv_of_tokens(tokens) -> tuple[np.ndarray, np.ndarray]:
    """K/V that are a function of each token id (exact in float16): any cell read can be checked."""
    return kv_of(tokens, L, H, D)


def token_donor(store, capacity=512):
    """A finished donor of token ids 1000..1299 holding ``kv_of_tokens`` of them; returns (donor, prompt)."""
    prompt = np.arange(1000, 1300)
    d = store.create_sequence(capacity=capacity, prefix=prompt)
    k, v = kv_of_tokens(prompt)
    d.extend(k, v, tokens=prompt)
    d.finish()
    return d, prompt


def holds_token_kv(seq) -> bool | None:
    """Whether a seqlocked copy of every layer holds the K/V of the sequence's token ids (None:
    the length changed between the two reads)."""
    toks = np.array(seq.tokens)
    ek, ev = kv_of_tokens(toks)
    for layer in range(L):
        k, v = seq.read(layer)
        if len(k) != len(toks):
            return None
        if not (np.array_equal(k, ek[layer].astype(np.float16)) and np.array_equal(v, ev[layer].astype(np.float16))):
            return False
    return True


def kv_content(seq, n=None):
    """Every layer's committed K and V (int8: the codes and scales read back), token ids and
    positions of ``seq``'s first ``n`` tokens, as bytes."""
    n = len(seq) if n is None else n
    out = [seq.tokens[:n].tobytes(), seq.positions[:n].tobytes()]
    for i in range(L):
        k, v = seq.kv(i)
        out += [np.asarray(k)[:n].tobytes(), np.asarray(v)[:n].tobytes()]
    return out


def data_mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("skv_" + name + ".d"))


def refusing(monkeypatch, *stores, spans_from=1, put_back=True):
    """``share.libc_mmap`` as in a process at vm.max_map_count: a span's mapping (a cell shown at
    another cell's file offset: it splits the data segment's region) is refused with ENOMEM, the
    errno the kernel gives, from the ``spans_from``-th such call on (the ones before it mapped);
    mapping a cell's own pages back (it merges with its neighbours again) is allowed, or refused
    as well (``put_back=False``). Returns the calls: (own pages?, refused?) each."""
    real, calls = share.libc_mmap, []
    shares = [engine_of(s).shares for s in stores]

    def mmap(*args):
        if args[3] & share.MAP_ANONYMOUS:  # the spare's page (Spare): not a cell's mapping
            return real(*args)
        addr, off = args[0], args[5]  # (addr, length, prot, flags, fd, offset)
        own = any(sh.base <= addr < sh.base + sh.anchor.nbytes and off == addr - sh.base for sh in shares)
        spans = sum(1 for c in calls if not c[0]) + (not own)
        refuse = (not put_back) if own else spans >= spans_from
        calls.append((own, refuse))
        if refuse:
            ctypes.set_errno(errno.ENOMEM)
            return share.MAP_FAILED
        return real(*args)

    monkeypatch.setattr(share, "libc_mmap", mmap)
    return calls
