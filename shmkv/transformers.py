"""Hugging Face transformers: :class:`ShmkvCache`, a ``transformers.Cache`` (5.x) in a shmkv store.

``model.generate(..., past_key_values=cache)`` then keeps its keys and values in
shared memory: another process continues the same sequences with
:meth:`ShmkvCache.attach`, and the outputs equal those of transformers' own
``DynamicCache`` (``tests/test_transformers.py`` compares them).

Importing this module imports torch and transformers (``pip install
'shmkv[transformers]'``); ``import shmkv`` never does.

How a forward maps onto the store (facts from transformers 5.x
``cache_utils.py``, cited where used):

* the model calls ``update(key_states, value_states, layer_idx)`` once per layer,
  in layer order, with ``[batch, kv_heads, q, head_dim]``; each batch row is one
  shmkv sequence; the new tokens are appended (pending) and committed after the
  last layer, so other processes only ever see whole tokens;
* the returned ``[batch, kv_heads, kv_len, head_dim]`` has the ``kv_len`` that
  ``get_mask_sizes`` announced: all tokens on full layers, the last
  ``window - 1`` kept ones plus the new ones on sliding and chunked layers
  (``DynamicSlidingWindowLayer.get_mask_sizes``);
* at batch 1 on CPU, when the store's dtype is the model's, the returned tensors
  are zero-copy views of the shared cells (bfloat16 through its int16 bits).
  They stay valid while the forward runs; a structural change (crop, a move when
  the sequence outgrows its range) changes what they show, exactly as for
  ``Sequence.append``'s views.

The module ends with the few primitives this adapter has to write against
shmkv internals because the public API lacks them (see "core primitives"):
they belong in ``Sequence`` / ``Store``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence as _Seq
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from . import _quant
from ._sequence import Sequence
from ._lifecycle import create
from ._store import Store, attach
from .errors import InvalidArgumentError, NotSupportedError

__all__ = ["ShmkvCache"]

# HF layer type -> shmkv layer kind. transformers 5.x cache_utils.py
# DYNAMIC_LAYER_TYPE_MAPPING: "sliding_attention" and "chunked_attention" both
# become DynamicSlidingWindowLayer (window = sliding_window or
# attention_chunk_size); only the mask differs.
_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}

_TORCH_TO_STORE = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}

_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)  # Tensor.numpy() shares these
_PLAIN = ("float32", "float16", "float64")  # stored as is: append returns views of the cells

DEFAULT_CAPACITY = 256  # first range of a sequence the cache creates; it doubles as it grows


class _ShmkvLayer(CacheLayerMixin):
    """One layer of a :class:`ShmkvCache`: the per-layer answers transformers asks for.

    Storage and every batch operation live in the cache (a sequence spans all
    layers); HF reads ``is_sliding`` here to choose masks (cache_utils.py
    ``Cache.is_sliding``; masking_utils.py ``find_first_full_attention_index``).
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False  # nothing to allocate ahead: the store exists already

    def __init__(self, cache: ShmkvCache, idx: int, window: int) -> None:
        # CacheLayerMixin.__init__ would set keys/values attributes: here they are properties
        self._cache = cache
        self.idx = idx
        self.window = window  # HF sliding_window of a sliding/chunked layer, 0 on full layers
        self.is_sliding = window > 0

    def __repr__(self) -> str:
        kind = f"sliding window={self.window}" if self.window else "full"
        return f"_ShmkvLayer({self.idx}, {kind})"

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self._cache._seqs is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache._update(key_states, value_states, self.idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # cache_utils.py DynamicLayer.get_mask_sizes: (past + q, 0);
        # DynamicSlidingWindowLayer.get_mask_sizes: (min(past, window - 1) + q, max(past - window + 1, 0))
        past = self._cache._length
        if not self.window:
            return past + query_length, 0
        return min(past, self.window - 1) + query_length, max(past - self.window + 1, 0)

    def get_seq_length(self) -> int:
        # DynamicSlidingWindowLayer counts every token seen (cumulative_length), as full layers do
        return self._cache._length

    def get_max_length(self) -> int:
        # cache_utils.py: DynamicLayer -1 (no maximum), DynamicSlidingWindowLayer its window
        return self.window if self.window else -1

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """Committed keys ``[batch, kv_heads, kv_len, head_dim]`` (what a DynamicLayer holds)."""
        return self._cache._held(self.idx, 0)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._cache._held(self.idx, 1)

    # whole-cache operations: a sequence spans every layer, so the cache does them once
    def _whole(self, what: str) -> None:
        raise NotSupportedError(f"{what} on one layer of a ShmkvCache: call cache.{what}() on the cache")

    def reset(self) -> None:
        self._whole("reset")

    def crop(self, tokens_to_remove: int) -> None:
        self._whole("crop")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._whole("reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._whole("batch_select_indices")

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


class _Forward:
    """State of one forward in progress (between its first and its last layer)."""

    __slots__ = ("deferred", "fast", "next", "q", "stash")

    def __init__(self, q: int, deferred: bool, layers: int, fast: bool) -> None:
        self.q = q
        self.next = 0  # the layer update() expects next
        self.deferred = deferred
        self.fast = fast  # batch 1 on CPU, a dtype numpy shares with torch, plain storage
        # deferred forwards keep each layer's new states here and write them at the end
        self.stash: list[tuple[list[np.ndarray], list[np.ndarray]] | None] = [None] * layers


class ShmkvCache(Cache):
    """A ``transformers.Cache`` whose keys and values live in a shmkv store.

    Each batch row is one sequence of the store (``sequence_ids``, in row order),
    held through its write lease. Pass it to ``model.generate(...,
    past_key_values=cache)`` or ``model(..., past_key_values=cache)``.

    Args:
        store: an open read-write :class:`shmkv.Store` whose layout fits the model
            (see :meth:`from_config`).
        seq_ids: sequences to continue, one per batch row; their leases are all
            taken now, or none (``LeaseError``; nothing kept). ``None``: one new
            sequence per batch row at the first update.
        capacity: first capacity of the sequences the cache creates (they grow).

    Example:
        >>> cache = ShmkvCache.from_config(model.config, "llama")       # doctest: +SKIP
        >>> out = model.generate(input_ids, past_key_values=cache)       # doctest: +SKIP
        >>> cache.sequence_ids, cache.release()                          # doctest: +SKIP
        >>> # another process: ShmkvCache.attach("llama", ids) continues them
    """

    def __init__(self, store: Store, seq_ids: _Seq[int] | None = None, *, capacity: int | None = None) -> None:
        if not isinstance(store, Store):
            raise InvalidArgumentError(f"store={store!r} must be an open shmkv.Store")
        if store.readonly:
            raise InvalidArgumentError(
                f"store {store.name!r} is attached read-only; a cache writes: attach it with readonly=False"
            )
        lay = store.layout
        windows = []
        for kind in lay.layer_types:
            windows.append(lay.window if kind == "sliding" else lay.chunk if kind == "chunked" else 0)
        super().__init__(layers=[_ShmkvLayer(self, i, w) for i, w in enumerate(windows)])
        self._store = store
        self._layout = lay
        self._windows = windows
        self._bounded = bool(lay.bounded)
        self._step = lay.step  # most new tokens a sliding/chunked layer takes between commits
        self._cell = (lay.kv_heads, lay.head_dim)
        self._capacity = capacity
        self._seqs: list[Sequence] | None = None
        self._owned_seqs = seq_ids is None  # created here: reset() frees them
        self._owns_store = False  # from_config / attach: close() closes it
        self._length = 0
        self._fwd: _Forward | None = None
        self._dtype: torch.dtype | None = None
        if seq_ids is not None:
            self._seqs = _take_leases(store, seq_ids)
            lengths = {s.length for s in self._seqs}
            if len(lengths) > 1:
                for s in self._seqs:
                    s.release()
                self._seqs = None
                raise InvalidArgumentError(
                    f"seq_ids={list(seq_ids)} have lengths {sorted(lengths)}: transformers keeps one past "
                    "length for the whole batch; pass sequences of equal length"
                )
            self._length = lengths.pop() if lengths else 0

    # -- construction ------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, *, dtype: Any = None, max_tokens: int = 65536,
                    max_seqs: int = 64, persistent: bool = False, memory: int | None = None,
                    mode: int = 0o600, capacity: int | None = None) -> ShmkvCache:
        """Create a store laid out for the model of ``config`` and a cache on it that owns it.

        Args:
            config: the model's ``PretrainedConfig`` (its text config is used).
            name: store name (default: a random ``hf-...`` one).
            dtype: storage dtype (default: the config's dtype, else float32); one of
                float32, float16, bfloat16, float64, int8 or a torch dtype.
            max_tokens, max_seqs, persistent, memory, mode: as :func:`shmkv.create`.

        Closing the cache closes the store, which removes it unless ``persistent``.

        Raises:
            NotSupportedError: the config has what shmkv cannot hold (the message
                names the field): per-layer head shapes, several sliding windows,
                linear-attention or KV-sharing layers.
        """
        spec = layout_from_config(config)
        if dtype is None:
            dtype = getattr(config.get_text_config(decoder=True), "dtype", None) or getattr(config, "dtype", None)
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype, None)
            dtype = dtype if dtype in _TORCH_TO_STORE else torch.float32
        if isinstance(dtype, torch.dtype):
            if dtype not in _TORCH_TO_STORE:
                raise InvalidArgumentError(f"dtype={dtype} has no shmkv storage dtype: use one of "
                                           f"{sorted(_TORCH_TO_STORE.values())} or 'int8'")
            dtype = _TORCH_TO_STORE[dtype]
        name = name if name is not None else "hf-" + secrets.token_hex(8)
        store = create(name, dtype=dtype, max_tokens=max_tokens, max_seqs=max_seqs, persistent=persistent,
                       memory=memory, mode=mode, **spec)
        return cls._owning(store, None, capacity)

    @classmethod
    def attach(cls, name: str, seq_ids: _Seq[int] | None = None, *, capacity: int | None = None) -> ShmkvCache:
        """Continue sequences ``seq_ids`` of store ``name`` (typically in another process).

        Attaches to the store (this cache's ``close()`` detaches) and takes every lease;
        ``seq_ids=None`` starts new sequences there, as ``ShmkvCache(store)`` does.
        """
        return cls._owning(attach(name), seq_ids, capacity)

    @classmethod
    def _owning(cls, store: Store, seq_ids: _Seq[int] | None, capacity: int | None) -> ShmkvCache:
        """A cache that owns ``store`` (its close() closes it); the store is closed if that fails."""
        try:
            cache = cls(store, seq_ids, capacity=capacity)
        except BaseException:
            store.close()
            raise
        cache._owns_store = True
        return cache

    @classmethod
    def for_prompt(cls, store: Store, input_ids: Any, *, capacity: int | None = None) -> ShmkvCache:
        """A cache whose rows start from the longest prefix of their prompt cached in ``store``
        (DESIGN §8), by any process: ``generate(input_ids, past_key_values=cache)`` then
        computes only the rest.

        Every row reuses the same number of tokens (transformers keeps one past length for
        the batch): the shortest match among the rows, at most ``len - 1`` (so generate
        still computes a token and gets its logits).

        Args:
            store: an open read-write store laid out for the model.
            input_ids: ``[batch, n]`` token ids (tensor, array or nested lists) — the same
                ones given to ``generate``.

        Example:
            >>> cache = ShmkvCache.for_prompt(store, input_ids)              # doctest: +SKIP
            >>> out = model.generate(input_ids, past_key_values=cache)       # doctest: +SKIP
            >>> cache.finish(out)          # now a cached prefix for every process  # doctest: +SKIP
        """
        rows = _token_rows(input_ids, "input_ids")
        k = min(store.match_prefix(r) for r in rows)
        cap = max(capacity or DEFAULT_CAPACITY, *(len(r) for r in rows))
        seqs: list[Sequence] = []
        try:
            for r in rows:
                seqs.append(store.create_sequence(capacity=cap, prefix=r[: k + 1]))
            n = min(len(s) for s in seqs)  # a donor evicted since match_prefix: fewer on that row
            for s in seqs:
                if len(s) > n:
                    s.truncate(n)
        except BaseException:
            for s in seqs:
                s.free()
            raise
        cache = cls(store, capacity=capacity)
        cache._seqs, cache._length = seqs, n
        return cache

    def finish(self, output_ids: Any, attention_mask: Any = None) -> None:
        """The requests are done: record every row's token ids from ``generate``'s output and
        keep the sequences as cached prefixes (``Sequence.finish``) for any process's
        :meth:`for_prompt`; the cache is empty afterwards.

        Args:
            output_ids: ``[batch, >= length]`` token ids, row order as the cache's (generate's
                output: the prompt and the new tokens; the cache holds all but the last).
            attention_mask: the mask given to generate, if any: rows with padding are freed
                instead (their cells were computed with the padding masked out, which a
                match by token ids cannot tell).

        Raises:
            InvalidArgumentError: ``output_ids`` too short, or disagreeing with ids the cells
                already hold (a prefix they were copied from): nothing is recorded then.
        """
        if self._seqs is None:
            return
        if self._fwd is not None:
            self._drop_pending()
        rows = _token_rows(output_ids, "output_ids")
        n = self._length
        if len(rows) != len(self._seqs) or any(len(r) < n for r in rows):
            raise InvalidArgumentError(
                f"finish: output_ids {[len(r) for r in rows]} must be {len(self._seqs)} rows of at least "
                f"{n} token ids (the cache's length)"
            )
        padded = [False] * len(rows)
        if attention_mask is not None:
            mask = _token_rows(attention_mask, "attention_mask")
            padded = [bool((m[:n] == 0).any()) for m in mask]
        for s, r, pad in zip(self._seqs, rows, padded, strict=True):
            if not pad:
                _check_tokens(s, r[:n])
        seqs, self._seqs = self._seqs, None
        self._length = 0
        for s, r, pad in zip(seqs, rows, padded, strict=True):
            if pad:
                s.free()
            else:
                _set_tokens(s, r[:n])
                s.finish()

    # -- what the caller sees ----------------------------------------------------------

    @property
    def store(self) -> Store:
        return self._store

    @property
    def sequence_ids(self) -> list[int]:
        """The store's sequence ids, in batch row order (empty before the first update)."""
        return [s.id for s in self._seqs] if self._seqs is not None else []

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        """Rows of the cache; -1 before the first update (as ``Cache.batch_size``)."""
        return len(self._seqs) if self._seqs is not None else -1

    def __repr__(self) -> str:
        return (f"ShmkvCache(store={self._store.name!r}, sequence_ids={self.sequence_ids}, "
                f"length={self._length})")

    def __enter__(self) -> ShmkvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def release(self) -> None:
        """Give up the write leases; the sequences stay in the store for another process."""
        self._fwd = None
        for s in self._seqs or ():
            s.release()

    def free(self) -> None:
        """Delete the sequences from the store; the cache is empty again (a new batch may follow)."""
        self._fwd = None
        seqs, self._seqs = self._seqs or [], None
        self._length = 0
        self._owned_seqs = True
        for s in seqs:
            s.free()

    def close(self) -> None:
        """Release the leases, and close the store if this cache opened it
        (:meth:`from_config`: a non-persistent store is then removed)."""
        if self._store.closed:
            return
        self.release()
        if self._owns_store:
            self._store.close()

    # -- the forward -------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._update(key_states, value_states, layer_idx)

    def _begin(self, key_states: torch.Tensor) -> _Forward:
        if self._fwd is not None:  # the previous forward failed between its layers: drop its tokens
            self._drop_pending()
        lay = self._layout
        shape = key_states.shape
        if len(shape) != 4 or (shape[1], shape[3]) != self._cell:
            raise InvalidArgumentError(
                f"key_states shape {tuple(key_states.shape)} must be [batch, kv_heads={lay.kv_heads}, q, "
                f"head_dim={lay.head_dim}] (the store's layout): build the store with ShmkvCache.from_config"
            )
        b, q = key_states.shape[0], key_states.shape[2]
        if self._seqs is None:
            cap = max(self._capacity or DEFAULT_CAPACITY, q)
            seqs: list[Sequence] = []
            try:
                for _ in range(b):
                    seqs.append(self._store.create_sequence(capacity=cap))
            except BaseException:
                for s in seqs:
                    s.free()
                raise
            self._seqs, self._length = seqs, 0
        elif len(self._seqs) != b:
            raise InvalidArgumentError(
                f"batch of {b} rows, but the cache holds {len(self._seqs)} sequences {self.sequence_ids}; "
                "use one cache per batch (or reset() an empty one)"
            )
        self._dtype = key_states.dtype
        # a sliding/chunked layer takes at most `step` (memory=) new tokens between commits;
        # longer forwards keep every layer's states aside and write them in steps at the end
        deferred = self._bounded and q > self._step
        fast = (b == 1 and not deferred and key_states.device.type == "cpu"
                and key_states.dtype in _NUMPY_DTYPES and self._store.layout.dtype in _PLAIN)
        self._fwd = _Forward(q, deferred, lay.layers, fast)
        return self._fwd

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        fwd = self._fwd
        if layer == 0 or fwd is None:
            fwd = self._begin(key_states)
        if layer != fwd.next:
            raise InvalidArgumentError(
                f"update for layer {layer}, expected layer {fwd.next}: a forward updates layers 0.."
                f"{self._layout.layers - 1} in order"
            )
        seqs = self._seqs
        assert seqs is not None
        if fwd.fast:  # the decode hot path: numpy views both ways, no copy but the append's
            if key_states.requires_grad:
                key_states, value_states = key_states.detach(), value_states.detach()
            ka, va = seqs[0].append(layer, key_states.numpy()[0].swapaxes(0, 1),
                                    value_states.numpy()[0].swapaxes(0, 1))
            w = self._windows[layer]
            lo = len(ka) - fwd.q - (min(self._length, w - 1) if w else self._length)
            k_out = torch.from_numpy(_writable(ka[lo:]).swapaxes(0, 1)[None])
            v_out = torch.from_numpy(_writable(va[lo:]).swapaxes(0, 1)[None])
            if k_out.dtype != key_states.dtype:
                k_out, v_out = k_out.to(key_states.dtype), v_out.to(key_states.dtype)
            fwd.next = layer + 1
            if fwd.next == self._layout.layers:
                self._commit(fwd)
            return k_out, v_out
        kn = _to_numpy(key_states.transpose(1, 2))  # [batch, q, kv_heads, head_dim] views
        vn = _to_numpy(value_states.transpose(1, 2))
        w = self._windows[layer]
        keep = fwd.q + (min(self._length, w - 1) if w else self._length)  # get_mask_sizes' kv_len
        dtype = key_states.dtype
        if fwd.deferred:
            fwd.stash[layer] = (list(kn), list(vn))
            n_held = keep - fwd.q
            held = [s.torch_kv(layer) for s in seqs]
            k_held = torch.stack([k[len(k) - n_held:] for k, _ in held]).to(dtype)
            v_held = torch.stack([v[len(v) - n_held:] for _, v in held]).to(dtype)
            k_out = torch.cat([k_held, key_states.detach().cpu().transpose(1, 2)], 1)
            v_out = torch.cat([v_held, value_states.detach().cpu().transpose(1, 2)], 1)
        elif len(seqs) == 1:  # zero-copy views of the cells
            ka, va = seqs[0].append(layer, kn[0], vn[0])
            k_out = _to_torch(ka[len(ka) - keep:], dtype).unsqueeze(0)
            v_out = _to_torch(va[len(va) - keep:], dtype).unsqueeze(0)
        else:  # one gather per layer, as DynamicCache's torch.cat
            kl, vl = [], []
            for s, k, v in zip(seqs, kn, vn, strict=True):
                ka, va = s.append(layer, k, v)
                kl.append(ka[len(ka) - keep:])
                vl.append(va[len(va) - keep:])
            k_out, v_out = _to_torch(np.stack(kl), dtype), _to_torch(np.stack(vl), dtype)
        fwd.next = layer + 1
        if fwd.next == self._layout.layers:
            self._commit(fwd)
        k_out, v_out = k_out.permute(0, 2, 1, 3), v_out.permute(0, 2, 1, 3)
        if key_states.device.type != "cpu":
            k_out, v_out = k_out.to(key_states.device), v_out.to(key_states.device)
        return k_out, v_out

    def _commit(self, fwd: _Forward) -> None:
        """After the last layer: publish the forward's tokens in every row."""
        seqs = self._seqs
        assert seqs is not None
        if fwd.deferred:
            step = self._layout.step
            try:
                for a in range(0, fwd.q, step):
                    for row, s in enumerate(seqs):
                        for layer, stash in enumerate(fwd.stash):
                            assert stash is not None
                            s.append(layer, stash[0][row][a : a + step], stash[1][row][a : a + step])
                        s.commit()
            except BaseException:  # e.g. CacheFullError: every row back to where the forward began
                self._fwd = None
                for s in seqs:
                    s.truncate(min(s.length, self._length))
                raise
        else:
            for s in seqs:
                s.commit()
        self._length += fwd.q
        self._fwd = None

    def _drop_pending(self) -> None:
        """Drop the tokens of a forward that did not reach its last layer (every row back to
        its committed length)."""
        self._fwd = None
        for s in self._seqs or ():
            _drop_pending(s, self._length)

    def _held(self, layer: int, which: int) -> torch.Tensor | None:
        if self._seqs is None:
            return None
        w = self._windows[layer]
        n = min(self._length, w - 1) if w else self._length
        dtype = self._dtype or torch.float32
        rows = [t[len(t) - n:].to(dtype) for t in (s.torch_kv(layer)[which] for s in self._seqs)]
        out = rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)  # batch 1: zero-copy
        return out.permute(0, 2, 1, 3)

    # -- what transformers asks of a cache ---------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every row (assisted and prompt-lookup
        decoding roll back rejected candidates so). Like ``DynamicLayer.crop`` (cache_utils.py),
        a positive value is refused and removing more than the length empties the rows."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
            raise InvalidArgumentError(f"crop: tokens_to_remove={tokens_to_remove!r} must be an int <= 0")
        if tokens_to_remove > 0:
            raise InvalidArgumentError(
                f"crop({tokens_to_remove}): a positive value is not supported (as in DynamicCache); pass "
                "a negative int, the number of tokens to remove"
            )
        if self._fwd is not None:
            self._drop_pending()
        if tokens_to_remove == 0 or self._seqs is None:
            return
        n = max(self._length + int(tokens_to_remove), 0)
        for s in self._seqs:
            s.truncate(n)
        self._length = n

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues the old row ``beam_idx[i]``."""
        self._regather(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows (new sequences copy it)."""
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise InvalidArgumentError(f"batch_repeat_interleave: repeats={repeats!r} must be an int >= 1")
        if self._seqs is None:
            return
        self._regather([i for i in range(len(self._seqs)) for _ in range(int(repeats))], "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (in that order); the dropped rows' sequences are freed."""
        self._regather(indices, "indices")

    def reset(self) -> None:
        """Empty the cache: sequences it created are freed (the next forward may have another
        batch size); sequences given to it are cleared and kept."""
        self._fwd = None
        if self._seqs is None:
            return
        if self._owned_seqs:
            self.free()
        else:
            for s in self._seqs:
                s.clear()
            self._length = 0

    def _regather(self, index: Any, what: str) -> None:
        if self._seqs is None:
            return
        if self._fwd is not None:
            self._drop_pending()
        a = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if a.dtype == np.bool_:  # a mask over the rows, as tensor indexing takes it
            a = np.flatnonzero(a)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"{what}={index!r} must be a 1-D sequence of row indices (or a bool mask)")
        idx = a.tolist()
        b = len(self._seqs)
        bad = [i for i in idx if not -b <= i < b]
        if bad:
            raise InvalidArgumentError(f"{what}: rows {bad[:8]} are out of range for a batch of {b}")
        self._seqs = _regather(self._store, self._seqs, [i % b for i in idx], self._length)


def layout_from_config(config: Any) -> dict[str, Any]:
    """``shmkv.create`` layout arguments for the model of ``config`` (its decoder text config).

    Raises NotSupportedError naming the field shmkv cannot serve.
    """
    from transformers.configuration_utils import get_head_shapes

    text = config.get_text_config(decoder=True)
    for field in ("kv_sharing_modes",):
        if getattr(text, field, None) is not None:
            raise NotSupportedError(f"config.{field}={getattr(text, field)!r}: layers sharing another layer's "
                                    "keys and values are not supported by ShmkvCache")
    # the same derivation DynamicCache(config=...) uses (cache_utils.py get_layer_types_and_kwargs)
    hf_types, kwargs = get_layer_types_and_kwargs(text)
    kv_heads, head_dim = get_head_shapes(text)
    if not isinstance(kv_heads, int):
        raise NotSupportedError(f"config num_key_value_heads differs between layers ({kv_heads}): shmkv stores "
                                "one kv_heads for every layer")
    if not isinstance(head_dim, int):
        raise NotSupportedError(f"config head_dim differs between layers ({head_dim}): shmkv stores one "
                                "head_dim for every layer")
    kinds: list[str] = []
    windows: dict[str, set[Any]] = {"sliding": set(), "chunked": set()}
    for i, (t, kw) in enumerate(zip(hf_types, kwargs, strict=True)):
        if t not in _KINDS:
            raise NotSupportedError(
                f"config layer_types[{i}]={t!r}: ShmkvCache holds {sorted(_KINDS)} layers only "
                "(no linear-attention, hybrid or cache-less layers)"
            )
        kind = _KINDS[t]
        kinds.append(kind)
        if kind != "full":
            windows[kind].add(kw.get("sliding_window"))
    spec: dict[str, Any] = {"layers": len(kinds), "kv_heads": kv_heads, "head_dim": head_dim, "layer_types": kinds}
    for kind, field, arg in (("sliding", "sliding_window", "window"), ("chunked", "attention_chunk_size", "chunk")):
        ws = windows[kind]
        if len(ws) > 1:
            raise NotSupportedError(f"config {field} differs between {kind} layers ({sorted(map(str, ws))}): "
                                    f"shmkv has one {arg} per store")
        if ws:
            w = ws.pop()
            if not isinstance(w, int) or w < 1:
                raise NotSupportedError(f"config {field}={w!r} on {kind} layers: need a positive int")
            spec[arg] = w
    return spec


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
    """``a`` as a torch tensor of ``dtype``: zero-copy when the dtypes match."""
    if _quant.BF16 is not None and a.dtype == _quant.BF16:
        t = torch.from_numpy(_writable(a.view(np.int16))).view(torch.bfloat16)
    else:
        t = torch.from_numpy(_writable(a))
    return t if t.dtype == dtype else t.to(dtype)


# -- core primitives -----------------------------------------------------------------------
# What shmkv's public API does not offer and this adapter needs. Each helper is
# small and stands in for the named core primitive; the lead moves them into
# Sequence / Store (listed in the helper's report).


def _writable(a: np.ndarray) -> np.ndarray:
    """Stand-in for a torch form of ``Sequence.append`` (``seq.torch_kv`` covers committed
    cells only; append's views hold the pending ones too): a writable view of cells that
    ``Sequence`` hands out read-only, so ``torch.from_numpy`` neither copies nor warns
    (it warns once per process about read-only arrays). The store's arrays are
    writable on a read-write attachment; only the view's flag is read-only."""
    if a.flags.writeable:
        return a
    v = a.view()
    try:
        v.flags.writeable = True
    except ValueError:  # really read-only memory (read-only attachment): copy
        return a.copy()
    return v


def _token_rows(ids: Any, what: str) -> list[np.ndarray]:
    if isinstance(getattr(ids, "sequences", None), torch.Tensor):  # generate's GenerateOutput
        ids = ids.sequences
    a = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if a.ndim != 2 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{what} must be [batch, n] token ids, got shape {a.shape} dtype {a.dtype}")
    return [row.astype(np.int64) for row in a]


def _check_tokens(seq: Sequence, tokens: np.ndarray) -> None:
    """The ids the cells already hold (a reused prefix) must be the ones given."""
    held = seq.tokens[: len(tokens)]
    known = held >= 0
    if (held[known] != tokens[known]).any():
        i = int(np.flatnonzero(known & (held != tokens))[0])
        raise InvalidArgumentError(
            f"finish: output_ids give token {int(tokens[i])} at index {i} of sequence {seq.id}, whose cell "
            f"holds token {int(held[i])}: pass generate's output for the same input_ids"
        )


def _set_tokens(seq: Sequence, tokens: np.ndarray) -> None:
    """Stand-in for ``seq.set_tokens(tokens, begin=0)``: record the ids of committed cells
    that were committed without them (the model's forward sees states, not ids), and index
    their blocks for the prefix cache (what ``commit(tokens=...)`` does at once)."""
    from ._header import FLAGS, LENGTH, NOINDEX, START

    st = seq._store
    with st._locked():
        row = seq._row
        start = row[START]
        n = min(len(tokens), row[LENGTH])
        with st._changing(row):
            st._tokens[start : start + n] = tokens[:n]
        row[FLAGS] &= ~NOINDEX  # blocks from IDX_BLOCKS on may be indexed now
        st._index_blocks(seq._slot, row[LENGTH])


def _drop_pending(seq: Sequence, length: int) -> None:
    """Stand-in for ``Sequence.discard()``: drop this handle's uncommitted tokens of every
    layer (after a forward failed between layers). Today only a structural truncate does
    it, under the store lock."""
    if seq.writable and any(seq._pending):
        seq.truncate(length)


def _take_leases(store: Store, seq_ids: _Seq[int]) -> list[Sequence]:
    """Stand-in for ``store.sequences_for_write(ids)``: every lease or none."""
    ids = [int(i) for i in seq_ids]
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"seq_ids={ids} repeats a sequence: one row per sequence")
    taken: list[Sequence] = []
    try:
        for i in ids:
            taken.append(store.sequence(i, write=True))
    except BaseException:
        for s in taken:
            s.release()
        raise
    return taken


def _regather(store: Store, seqs: list[Sequence], idx: list[int], length: int) -> list[Sequence]:
    """Stand-in for ``store.regather(seq_ids, rows)``: new row i holds old row ``idx[i]``.

    Without fork + free per row: a row's first use keeps its sequence (relabelled),
    repeats are copied (copy_prefix) into sequences no row uses any more, then into
    forks; sequences left unused are freed. On an error (CacheFullError from a fork) the
    forks made are freed and the cache keeps its old rows, of which the ones the new order
    dropped may already hold a copy of another row.
    """
    used: set[int] = set()
    new: list[Sequence | None] = [None] * len(idx)
    repeats: list[tuple[int, int]] = []
    for i, j in enumerate(idx):
        if j in used:
            repeats.append((i, j))
        else:
            used.add(j)
            new[i] = seqs[j]
    spare = [s for j, s in enumerate(seqs) if j not in used]
    try:
        for i, j in repeats:
            if spare:
                s = spare.pop()
                if length:
                    store.copy_prefix(seqs[j].id, s.id, length)
                else:
                    s.clear()
            else:
                s = seqs[j].fork()
            new[i] = s
    except BaseException:
        for got in new:
            if got is not None and got not in seqs:
                got.free()
        raise
    for s in spare:
        s.free()
    return [s for s in new if s is not None]

