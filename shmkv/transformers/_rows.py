"""The batch rows of a :class:`shmkv.transformers.ShmkvCache` and how a forward maps onto them.

:class:`Rows` holds one write handle per batch row, the past length transformers
keeps for the whole batch, and the forward in progress. Facts from transformers
5.x ``cache_utils.py``, cited where used:

* the model calls ``update(key_states, value_states, layer_idx)`` once per layer,
  in layer order, with ``[batch, kv_heads, q, head_dim]``; each batch row is one
  shmkv sequence; the new tokens are appended (pending) and committed after the
  last layer, so other processes only ever see whole tokens;
* the returned ``[batch, kv_heads, kv_len, head_dim]`` has the ``kv_len`` that
  ``get_mask_sizes`` announced: all tokens on full layers, the last
  ``window - 1`` kept ones plus the new ones on sliding and chunked layers
  (``DynamicSlidingWindowLayer.get_mask_sizes``);
* at batch 1 on CPU, when the store's dtype is the model's, the returned tensors
  are zero-copy views of the shared cells (bfloat16 through its int16 bits); at
  batch > 1 too while the rows' cells sit equally spaced (``store.create_sequences``
  makes them so; a row that outgrows its range moves, and from then on each layer
  is gathered into one copy, as DynamicCache's ``torch.cat`` copies).
  They stay valid while the forward runs; a structural change (crop, a move when
  the sequence outgrows its range) changes what they show, exactly as for
  ``Sequence.append``'s views.

Only shmkv's public API is used: ``append`` then ``torch_kv(layer, pending=True)``
(batch 1) or ``store.batch_kv(seqs, layer, pending=True, writable=True)`` (the
cells, zero-copy when they can be), ``commit``, ``discard`` (a forward that failed
between layers), ``extend(..., in_steps=True)`` (a prompt longer than a window
buffer takes between commits), ``store.create_sequences`` (every row or none),
``store.lease`` and ``store.regather`` (beam search and the batch operations),
``rewind`` (crop into a forward that was committed in steps, see ``_Undo``).
Imports torch; ``import shmkv`` never imports this module.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence as _Seq

import numpy as np
import torch

from shmkv._engine.table import dtypes as _dtypes
from shmkv._sequence import quant as _quant
from shmkv.transformers._layout import layer_windows
from shmkv._sequence.handle import Sequence, pending_views
from shmkv.store._store import Store
from shmkv.errors import InvalidArgumentError, NotSupportedError

_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)  # Tensor.numpy() shares these
_PLAIN = _dtypes.PLAIN  # stored as is: append returns views of the cells

DEFAULT_CAPACITY = 256  # first range of a sequence the cache creates; it doubles as it grows


class _Forward:
    """State of one forward in progress (between its first and its last layer)."""

    __slots__ = ("before", "deferred", "fast", "next", "q", "stash")

    def __init__(self, q: int, deferred: bool, layers: int, fast: bool) -> None:
        self.q = q
        self.next = 0  # the layer update() expects next
        self.deferred = deferred
        self.fast = fast  # batch 1 on CPU, a dtype numpy shares with torch, plain storage
        # deferred forwards keep each layer's new states here and write them at the end
        self.stash: list[tuple[list[np.ndarray], list[np.ndarray]] | None] = [None] * layers
        # ... and, on sliding/chunked layers, a copy of the tokens held before the forward
        # (``[batch, min(length, keep), kv_heads, head_dim]`` keys, values): what crop needs
        self.before: dict[int, tuple[np.ndarray, np.ndarray]] = {}


class _Undo:
    """What ``crop`` needs after a forward that was committed in steps (longer than ``step``):
    sliding/chunked layers no longer hold the tokens before its start, so a crop into it
    gives them their window back from here (``Sequence.rewind``). Per bounded layer (in
    ``layout.bounded`` order): keys, values of tokens ``start - len(before) .. start + q - 1``
    per row, in the store's dtype."""

    __slots__ = ("first", "k", "start", "v")

    def __init__(self, start: int, fwd: _Forward, bounded: tuple[int, ...], dtype: np.dtype) -> None:
        self.start = start  # the forward's first token: crops back to here or later are served
        self.k: list[list[np.ndarray]] = []  # [bounded layer][row] -> [tokens, kv_heads, head_dim]
        self.v: list[list[np.ndarray]] = []
        first = start
        for layer in bounded:
            st = fwd.stash[layer]
            assert st is not None
            kb, vb = fwd.before[layer]
            first = start - kb.shape[1]
            self.k.append([np.concatenate([kb[r], new.astype(dtype, copy=False)]) for r, new in enumerate(st[0])])
            self.v.append([np.concatenate([vb[r], new.astype(dtype, copy=False)]) for r, new in enumerate(st[1])])
        self.first = first  # the oldest token kept here

    def select(self, idx: list[int]) -> None:
        """Rows regathered: new row i is old row ``idx[i]``."""
        self.k = [[rows[i] for i in idx] for rows in self.k]
        self.v = [[rows[i] for i in idx] for rows in self.v]

    def window(self, row: int, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values ``[bounded layers, m, kv_heads, head_dim]`` of tokens n-m..n-1 of ``row``."""
        a, b = n - m - self.first, n - self.first
        return (np.stack([k[row][a:b] for k in self.k]), np.stack([v[row][a:b] for v in self.v]))


class Rows:
    """The sequences of a cache's batch rows (``seqs``, None before the first forward), their
    common committed ``length``, and the forward in progress."""

    def __init__(self, store: Store, capacity: int | None) -> None:
        self.store = store
        self.layout = store.layout
        self.windows = layer_windows(self.layout)  # HF sliding_window per layer, 0 on full layers
        self.capacity = capacity
        self.seqs: list[Sequence] | None = None
        self.length = 0
        self._fwd: _Forward | None = None
        self._undo: _Undo | None = None  # after a forward committed in steps (see _Undo)
        self._unrolled: _Forward | None = None  # a forward whose rollback did not finish (_roll_back)
        self._begun = False  # a forward ran since the rows were made or adopted (unmask_reuse)
        # Cache.activate_past_recording (transformers >= 5.24; generate calls it where it crops):
        # only then are a long forward's states kept for crop, as DynamicSlidingWindowLayer
        # keeps its past only when recording (a 100k-token prompt's states of every sliding
        # layer are otherwise dropped as soon as they are written)
        self.record = False
        self._cell = (self.layout.kv_heads, self.layout.head_dim)
        self._dtype: torch.dtype | None = None
        # for_prompt's ids per row (None: a row that may be padded): the forward that commits
        # them records them (commit(tokens=)), so the prompt is a cached prefix for every
        # process from its prefill on, not only from finish()
        self.prompt: list[np.ndarray | None] | None = None

    def adopt(self, seqs: list[Sequence], length: int) -> None:
        self.seqs, self.length, self._fwd, self._undo, self.prompt = seqs, length, None, None, None
        self._begun = False

    def unmask_reuse(self, pad: int) -> None:
        """Before the first forward over a reused prefix (``for_prompt``, no attention_mask): when
        generate will mask ``pad`` out, the reused cells from the first ``pad`` in any row on were
        computed without it masked (a match by ids cannot tell): every row keeps what comes before
        it, the same for all (generate computes the rest), or nothing where a window cannot."""
        if self.seqs is None or not self.length or self._begun:
            return
        cut = self.length
        for s in self.seqs:
            hit = np.flatnonzero(np.asarray(s.tokens[:cut]) == pad)
            cut = int(hit[0]) if hit.size else cut
        if cut < self.length:
            try:
                self.truncate(cut)
            except NotSupportedError:  # (a sliding window holds too little for that length)
                self.truncate(0)

    @property
    def pending(self) -> bool:
        """A forward is in progress (some layers updated, not all)."""
        return self._fwd is not None

    def copy_state(self, other: Rows) -> None:
        """After ``adopt`` of forks of ``other``'s rows: what else a copy must know (the dtype
        transformers works in, what a crop into the last forward needs; read-only, shared)."""
        self._dtype, self._undo = other._dtype, copy.copy(other._undo)  # its row lists are its own
        self.record = other.record

    def take(self, seq_ids: _Seq[int]) -> None:
        """Take the leases of ``seq_ids`` (all or none) as the rows; they must be equally long."""
        seqs = self.store.lease([int(i) for i in seq_ids])
        lengths = {s.length for s in seqs}
        if len(lengths) > 1:
            for s in seqs:
                s.release()
            raise InvalidArgumentError(
                f"seq_ids={list(seq_ids)} have lengths {sorted(lengths)}: transformers keeps one past "
                "length for the whole batch; pass sequences of equal length"
            )
        self.adopt(seqs, lengths.pop() if lengths else 0)

    def kept(self, layer: int) -> int:
        """Past tokens ``layer`` attends to (get_mask_sizes' kv_len minus the query)."""
        w = self.windows[layer]
        return min(self.length, w - 1) if w else self.length

    # -- the forward -------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        fwd = self._fwd
        if layer == 0 or fwd is None:
            fwd = self._begin(key_states)
        if layer >= self.layout.layers:
            raise InvalidArgumentError(
                f"update for layer {layer}: store {self.store.name!r} has {self.layout.layers} layers, the model "
                "more; use a store made by ShmkvCache.from_config(model.config, ...)"
            )
        if layer != fwd.next:
            raise InvalidArgumentError(
                f"update for layer {layer}, expected layer {fwd.next}: a forward updates layers 0.."
                f"{self.layout.layers - 1} in order"
            )
        seqs = self.seqs
        assert seqs is not None
        if fwd.fast:  # the decode hot path: numpy views both ways, no copy but the append's
            if key_states.requires_grad:
                key_states, value_states = key_states.detach(), value_states.detach()
            s = seqs[0]
            s.append(layer, key_states.numpy()[0].swapaxes(0, 1), value_states.numpy()[0].swapaxes(0, 1))
            # zero-copy: the cells, pending ones included, as numpy views (no tensor made twice)
            if (kv := pending_views(s, layer)) is None:
                kt, vt = s.torch_kv(layer, pending=True)  # (raises, or returns the same cells)
                kv = kt.numpy(), vt.numpy()
            kn, vn = kv
            lo = len(kn) - fwd.q - self.kept(layer)
            # shaped on the numpy side (a torch view op costs ~1 us each, numpy's a fraction)
            k_out = torch.from_numpy(kn[lo:].swapaxes(0, 1)[None])
            v_out = torch.from_numpy(vn[lo:].swapaxes(0, 1)[None])
            if k_out.dtype != key_states.dtype:
                k_out, v_out = k_out.to(key_states.dtype), v_out.to(key_states.dtype)
            fwd.next = layer + 1
            if fwd.next == self.layout.layers:
                self._commit(fwd)
            return k_out, v_out
        kn = _to_numpy(key_states.transpose(1, 2))  # [batch, q, kv_heads, head_dim] views
        vn = _to_numpy(value_states.transpose(1, 2))
        keep = fwd.q + self.kept(layer)  # get_mask_sizes' kv_len
        dtype = key_states.dtype
        if fwd.deferred:
            fwd.stash[layer] = (list(kn), list(vn))
            n_held = keep - fwd.q
            kb, vb = self.store.batch_kv(seqs, layer, writable=True)  # torch warns on read-only arrays
            if self.windows[layer]:  # a rollback (and crop) needs them once the steps compact the buffer
                fwd.before[layer] = (kb.copy(), vb.copy())  # (all it holds: every bounded layer as many)
            k_held = _to_torch(kb[:, kb.shape[1] - n_held:], dtype)
            v_held = _to_torch(vb[:, vb.shape[1] - n_held:], dtype)
            k_out = torch.cat([k_held, key_states.detach().cpu().transpose(1, 2)], 1)
            v_out = torch.cat([v_held, value_states.detach().cpu().transpose(1, 2)], 1)
        elif len(seqs) == 1:  # zero-copy views of the cells when the dtypes match
            seqs[0].append(layer, kn[0], vn[0])
            kt, vt = seqs[0].torch_kv(layer, pending=True)
            k_out, v_out = kt[len(kt) - keep:].to(dtype)[None], vt[len(vt) - keep:].to(dtype)[None]
        else:  # rows made together sit equally spaced: one strided view, else one gather per layer
            for s, k, v in zip(seqs, kn, vn, strict=True):
                s.append(layer, k, v)
            kb, vb = self.store.batch_kv(seqs, layer, pending=True, writable=True)
            k_out = _to_torch(kb[:, kb.shape[1] - keep:], dtype)
            v_out = _to_torch(vb[:, vb.shape[1] - keep:], dtype)
        fwd.next = layer + 1
        if fwd.next == self.layout.layers:
            self._commit(fwd)
        k_out, v_out = k_out.permute(0, 2, 1, 3), v_out.permute(0, 2, 1, 3)
        if key_states.device.type != "cpu":
            k_out, v_out = k_out.to(key_states.device), v_out.to(key_states.device)
        return k_out, v_out

    def _begin(self, key_states: torch.Tensor) -> _Forward:
        if self._fwd is not None or self._unrolled is not None:  # the previous forward failed: undo it
            self.drop_pending()
        self._begun = True
        self._undo = None  # crop goes back at most to this forward's start
        lay = self.layout
        shape = key_states.shape
        if len(shape) != 4 or (shape[1], shape[3]) != self._cell:
            raise InvalidArgumentError(
                f"key_states shape {tuple(key_states.shape)} must be [batch, kv_heads={lay.kv_heads}, q, "
                f"head_dim={lay.head_dim}] (the store's layout): build the store with ShmkvCache.from_config"
            )
        b, q = key_states.shape[0], key_states.shape[2]
        if self.seqs is None:
            # (by default: a share of a small store, the rows grow when they must)
            cap = max(self.capacity or min(DEFAULT_CAPACITY, self.layout.max_tokens // b), q)
            self.seqs, self.length = self.store.create_sequences(b, cap), 0  # adjacent: batch_kv's views
        elif len(self.seqs) != b:
            raise InvalidArgumentError(
                f"batch of {b} rows, but the cache holds {len(self.seqs)} sequences "
                f"{[s.id for s in self.seqs]}; use one cache per batch (or reset() an empty one)"
            )
        self._dtype = key_states.dtype
        # a sliding/chunked layer takes at most `step` (memory=) new tokens between commits;
        # longer forwards keep every layer's states aside and write them in steps at the end
        deferred = bool(lay.bounded) and q > lay.step
        fast = (b == 1 and not deferred and key_states.device.type == "cpu"
                and key_states.dtype in _NUMPY_DTYPES and lay.dtype in _PLAIN)
        self._fwd = _Forward(q, deferred, lay.layers, fast)
        return self._fwd

    def _commit(self, fwd: _Forward) -> None:
        """After the last layer: publish the forward's tokens in every row."""
        seqs = self.seqs
        assert seqs is not None
        if fwd.deferred:  # each row's tokens of every layer, committed in steps a window takes
            stash = fwd.stash
            tokens = self._prompt_tokens(fwd.q)
            try:
                for row, s in enumerate(seqs):
                    k_all = np.stack([st[0][row] for st in stash if st is not None])
                    v_all = np.stack([st[1][row] for st in stash if st is not None])
                    s.extend(k_all, v_all, tokens[row], in_steps=True)
            except BaseException:  # e.g. CacheFullError, a Ctrl-C: every row back to where the forward began
                self._fwd, self._unrolled = None, fwd  # (a rollback cut short is finished by the next call)
                self._roll_back(fwd)
                self._unrolled = None
                raise
            if self.record:
                self._undo = _Undo(self.length, fwd, self.layout.bounded, _dtypes.storage(self.layout.dtype))
        else:
            for s, t in zip(seqs, self._prompt_tokens(fwd.q), strict=True):
                s.commit(t)
        self.length += fwd.q
        self._fwd = None

    def _roll_back(self, fwd: _Forward) -> None:
        """Every row back to the committed length before ``fwd``, a forward committed in steps,
        failed part way: its sliding/chunked layers no longer hold the tokens before the forward
        (the steps compacted their buffers), so they get that window back (``Sequence.rewind``,
        from the copy ``fwd.before``), as a crop into the forward does."""
        assert self.seqs is not None
        n = self.length
        undo = _Undo(n, fwd, self.layout.bounded, _dtypes.storage(self.layout.dtype))
        held = n - undo.first  # what every row held on its sliding/chunked layers before
        for row, s in enumerate(self.seqs):
            s.discard()
            # (a step may compact the window and fail before its commit: the length alone cannot tell)
            if s.length > n or len(s.keys(self.layout.bounded[0])) != held:
                s.rewind(n, *undo.window(row, n, held))  # as long a window as the rows not reached hold

    def _prompt_tokens(self, q: int) -> list[np.ndarray | None]:
        """Per row, the ids of the ``q`` tokens the forward commits when they are ``prompt``'s
        next ones, else None (-1: no id). The prompt is dropped once a forward reaches its end."""
        seqs, prompt, lo = self.seqs, self.prompt, self.length
        assert seqs is not None
        if prompt is None:
            return [None] * len(seqs)
        n = max(len(r) for r in prompt if r is not None)
        if lo + q >= n:
            self.prompt = None
        if lo + q > n:  # not the prompt's rest (generate computes exactly that)
            return [None] * len(seqs)
        return [None if r is None else r[lo : lo + q] for r in prompt]

    def drop_pending(self) -> None:
        """Drop the tokens of a forward that did not reach its last layer (every row back to
        its committed length), and finish the rollback of one that failed as it committed in
        steps, if an error (a second Ctrl-C) cut it short."""
        if self._unrolled is not None:
            self._roll_back(self._unrolled)
            self._unrolled = None
        if self._fwd is None:
            return
        self._fwd = None
        for s in self.seqs or ():
            s.discard()

    def release(self) -> None:
        """Give up every row's lease (pending tokens go with it); the rows stay."""
        self.drop_pending()  # (a rollback cut short: finished first, the rows as the cache says)
        self._fwd, self._undo, self.prompt = None, None, None
        for s in self.seqs or ():
            s.release()

    def forget(self) -> list[Sequence]:
        """Empty rows (no forward, length 0); returns the sequences they held."""
        seqs, self.seqs = self.seqs or [], None
        self.length, self._fwd, self._undo, self.prompt = 0, None, None, None
        return seqs

    def held(self, layer: int, which: int) -> torch.Tensor | None:
        """Committed keys (which=0) or values (1) of ``layer``, ``[batch, kv_heads, kv_len,
        head_dim]``: what a DynamicLayer holds."""
        if self.seqs is None:
            return None
        n = self.kept(layer)
        writable = all(s.writable for s in self.seqs)
        a = self.store.batch_kv(self.seqs, layer, writable=writable)[which]  # zero-copy when equally spaced
        a = a[:, a.shape[1] - n:]
        if not a.flags.writeable:  # read handles (released rows): torch warns on read-only arrays
            a = a.copy()
        return _to_torch(a, self._dtype or torch.float32).permute(0, 2, 1, 3)

    # -- batch operations --------------------------------------------------------

    def truncate(self, n: int) -> None:
        """Every row keeps its first ``n`` tokens (n <= length). Back into a forward that was
        committed in steps, sliding/chunked layers get their window from ``_undo``."""
        self.drop_pending()
        self.prompt = None
        undo = self._undo
        if undo is not None and n < undo.start:
            undo = self._undo = None  # before the last forward: as far as the layers hold
        for row, s in enumerate(self.seqs or ()):
            if undo is not None and n < self.length:
                m = min(n, self.layout.keep)
                s.rewind(n, *undo.window(row, n, m))
            else:
                s.truncate(n)
        self.length = min(n, self.length)

    def regather(self, idx: list[int]) -> None:
        """New row i holds old row ``idx[i]`` (indices checked by the caller)."""
        assert self.seqs is not None
        self.drop_pending()
        self.prompt = None
        self.seqs = self.store.regather(self.seqs, idx)
        if self._undo is not None:  # (arrays shared between rows: only ever read)
            self._undo.select(idx)


# -- tensors <-> shared cells ------------------------------------------------------------


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (CPU, same memory when possible) of a [q, kv_heads, head_dim] tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        if _quant.BF16 is None:
            return t.float().numpy()
        return t.view(torch.int16).numpy().view(_quant.BF16)
    return t.numpy()


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``a`` (a writable array: a fresh one, or ``batch_kv``'s writable view of the cells) as a
    torch tensor of ``dtype``: zero-copy when the dtypes match."""
    if _quant.BF16 is not None and a.dtype == _quant.BF16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if t.dtype == dtype else t.to(dtype)
