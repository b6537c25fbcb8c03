"""Hugging Face transformers: :class:`ShmkvCache`, a ``transformers.Cache`` (5.x) in a shmkv store.

``model.generate(..., cache=cache)`` (``past_key_values=cache`` before transformers
5.24: :func:`cache_keyword` tells which) then keeps its keys and values in
shared memory: another process continues the same sequences with
:meth:`ShmkvCache.attach`, and the outputs equal those of transformers' own
``DynamicCache`` (``tests/test_transformers.py`` compares them).

Importing this module imports torch and transformers (``pip install
'shmkv[transformers]'``); ``import shmkv`` never does.

The parts: this module is what transformers sees (the cache and its layers,
argument checks, ownership of the store); ``_hf_layout`` turns a model config
into a store layout; ``_hf_rows`` holds the batch rows and maps a forward onto
appends and commits; ``transformers/_prefix.py`` does prefix reuse (``for_prompt``,
``finish``); ``_compat`` reads which keyword the installed transformers takes.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence as _Seq
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from shmkv.transformers._compat import cache_keyword, cache_kwargs
from shmkv.transformers._layout import check_layout, layout_from_config, storage_dtype
from shmkv.transformers._prefix import (check_finish, inferred_pad, prompt_ids, prompt_sequences, record_finish,
                                       token_rows, without_pad)
from shmkv.transformers._rows import Rows
from shmkv.store._lifecycle import create
from shmkv.store._store import Store, attach
from shmkv.errors import InvalidArgumentError, NotSupportedError

__all__ = ["ShmkvCache", "cache_keyword", "cache_kwargs", "layout_from_config"]


class _ShmkvLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__ is untyped
    """One layer of a :class:`ShmkvCache`: the per-layer answers transformers asks for.

    Storage and every batch operation live in the cache (a sequence spans all
    layers); HF reads ``is_sliding`` here to choose masks (cache_utils.py
    ``Cache.is_sliding``; masking_utils.py ``find_first_full_attention_index``).
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False  # nothing to allocate ahead: the store exists already

    def __init__(self, rows: Rows, idx: int, window: int) -> None:
        # CacheLayerMixin.__init__ would set keys/values attributes: here they are properties
        self._rows = rows
        self.idx = idx
        self.window = window  # HF sliding_window of a sliding/chunked layer, 0 on full layers
        self.is_sliding = window > 0

    def __repr__(self) -> str:
        kind = f"sliding window={self.window}" if self.window else "full"
        return f"_ShmkvLayer({self.idx}, {kind})"

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]  # an attribute in transformers: a property here
        return self._rows.seqs is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows.update(key_states, value_states, self.idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # cache_utils.py DynamicLayer.get_mask_sizes: (past + q, 0);
        # DynamicSlidingWindowLayer.get_mask_sizes: (min(past, window - 1) + q, max(past - window + 1, 0))
        past = self._rows.length
        if not self.window:
            return past + query_length, 0
        return min(past, self.window - 1) + query_length, max(past - self.window + 1, 0)

    def get_seq_length(self) -> int:
        # DynamicSlidingWindowLayer counts every token seen (cumulative_length), as full layers do
        return self._rows.length

    def get_max_length(self) -> int:
        # cache_utils.py: DynamicLayer -1 (no maximum), DynamicSlidingWindowLayer its window
        return self.window if self.window else -1

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]  # (as is_initialized)
        """Committed keys ``[batch, kv_heads, kv_len, head_dim]`` (what a DynamicLayer holds)."""
        return self._rows.held(self.idx, 0)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]  # (as is_initialized)
        return self._rows.held(self.idx, 1)

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


class ShmkvCache(Cache):
    """A ``transformers.Cache`` whose keys and values live in a shmkv store.

    Each batch row is one sequence of the store (``sequence_ids``, in row order),
    held through its write lease. Pass it to ``model.generate(..., cache=cache)`` or
    ``model(..., cache=cache)`` (``past_key_values=`` before transformers 5.24;
    ``**cache_kwargs(model, cache)`` passes it under the keyword the model takes).

    Args:
        store: an open read-write :class:`shmkv.Store` whose layout fits the model
            (see :meth:`from_config`).
        seq_ids: sequences to continue, one per batch row; their leases are all
            taken now, or none (``LeaseError``; nothing kept). ``None``: one new
            sequence per batch row at the first update.
        capacity: first capacity of the sequences the cache creates (they grow).

    Example:
        >>> cache = ShmkvCache.from_config(model.config, "llama")       # doctest: +SKIP
        >>> out = model.generate(input_ids, **cache_kwargs(model, cache))   # doctest: +SKIP
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
        rows = Rows(store, capacity)
        super().__init__(layers=[_ShmkvLayer(rows, i, w) for i, w in enumerate(rows.windows)])
        self._store = store
        self._rows = rows
        self._fits: Any = None  # the config check_fits last found this store laid out for
        # the pad id generate() masks (check_model); for_prompt's prompt length and whether it had a mask
        self._pad: int | None = None
        self._prompt: int | None = None
        self._masked = False
        self._owned_seqs = seq_ids is None  # created here: reset() frees them
        self._owns_store = False  # from_config / attach: close() closes it
        if seq_ids is not None:
            rows.take(seq_ids)

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
        name = name if name is not None else "hf-" + secrets.token_hex(8)
        store = create(name, dtype=storage_dtype(config, dtype), max_tokens=max_tokens, max_seqs=max_seqs,
                       persistent=persistent, memory=memory, mode=mode, **spec)
        return cls._owning(store, None, capacity)

    def check_fits(self, config: Any) -> None:
        """Raise ``InvalidArgumentError`` unless the store is laid out as :meth:`from_config` lays
        it out for ``config`` (layers, their kinds, heads, window): a store with more layers than
        the model never commits a forward, one of another window attends to other tokens, and
        neither is seen in a forward. :func:`cache_kwargs` calls it (once per config)."""
        if config is not self._fits:
            check_layout(self._store, config)
            self._fits = config

    def check_model(self, model: Any) -> None:
        """``check_fits(model.config)``, and learn the token ``generate()`` takes for padding
        when it is given no ``attention_mask`` (``model.generation_config.pad_token_id``, unless
        it is an end-of-sequence id): a row whose prompt holds it is computed with it masked
        out, so it is no prefix to cache (:meth:`for_prompt`'s forward does not record it,
        :meth:`finish` frees it). :func:`cache_kwargs` calls it."""
        self.check_fits(model.config)
        self._pad = inferred_pad(model)
        if self._pad is not None and not self._masked and self._prompt is not None:  # (for_prompt's rows)
            self._rows.prompt = without_pad(self._rows.prompt, self._pad)
            self._rows.unmask_reuse(self._pad)

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
    def for_prompt(cls, store: Store, input_ids: Any, *, capacity: int | None = None,
                   attention_mask: Any = None) -> ShmkvCache:
        """A cache whose rows start from the longest prefix of their prompt cached in ``store``
        (docs/design.md §8), by any process: ``generate(input_ids, cache=cache)`` then
        computes only the rest.

        Every row reuses the same number of tokens (transformers keeps one past length for
        the batch): the shortest match among the rows, at most ``len - 1`` (so generate
        still computes a token and gets its logits).

        Args:
            store: an open read-write store laid out for the model.
            input_ids: ``[batch, n]`` token ids (tensor, array or nested lists) — the same
                ones given to ``generate``.
            capacity: each row's first range, in tokens (at least ``n``); by default ``n``
                plus 256 for what ``generate`` adds. A row that outgrows it moves to a larger
                range, copying the tokens it shares with the cached prefix: give the prompt
                plus ``max_new_tokens`` when generating more.
            attention_mask: the mask given to generate, if any.

        The forward that computes the rest of the prompt (generate's first) records its ids
        as it commits: from then on the prompt is a cached prefix for every process, while
        this request still generates (``finish`` adds the new tokens' ids). Only rows known
        to hold no padding are recorded so early: those ``attention_mask`` shows unpadded,
        or without a mask a batch of one row (a padded row's cells were computed with the
        padding masked out, which a match by ids cannot tell). ``input_ids`` must be the ids
        given to ``generate``.

        Example:
            >>> cache = ShmkvCache.for_prompt(store, input_ids)              # doctest: +SKIP
            >>> out = model.generate(input_ids, **cache_kwargs(model, cache))  # doctest: +SKIP
            >>> cache.finish(out)          # now a cached prefix for every process  # doctest: +SKIP
        """
        early = prompt_ids(input_ids, attention_mask)
        seqs, n = prompt_sequences(store, input_ids, capacity)
        cache = cls(store, capacity=capacity)
        cache._rows.adopt(seqs, n)
        cache._rows.prompt = early
        cache._prompt = max(len(r) for r in token_rows(input_ids, "input_ids"))
        cache._masked = attention_mask is not None
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
        rows = self._rows
        if rows.seqs is None:
            return
        rows.drop_pending()
        checked = check_finish(rows.seqs, rows.length, output_ids, attention_mask, pad=self._pad, prompt=self._prompt)
        rows.forget()
        record_finish(checked)

    # -- what the caller sees ----------------------------------------------------------

    @property
    def store(self) -> Store:
        return self._store

    @property
    def sequence_ids(self) -> list[int]:
        """The store's sequence ids, in batch row order (empty before the first update)."""
        seqs = self._rows.seqs
        return [s.id for s in seqs] if seqs is not None else []

    @property
    def batch_size(self) -> int:
        """Rows of the cache; -1 before the first update (as ``Cache.batch_size``)."""
        seqs = self._rows.seqs
        return len(seqs) if seqs is not None else -1

    def __repr__(self) -> str:
        return (f"ShmkvCache(store={self._store.name!r}, sequence_ids={self.sequence_ids}, "
                f"length={self._rows.length})")

    def __deepcopy__(self, memo: dict[int, Any]) -> ShmkvCache:
        """``copy.deepcopy(cache)``: an independent cache on the same store whose rows are forks
        of this one's (``Sequence.fork``: new sequences holding the same tokens on every layer,
        their leases held by the copy). Both can go on generating, as with a deep-copied
        ``DynamicCache`` (transformers' tests restart ``generate`` from a copy so).

        The copy owns its sequences (``reset()``/``free()`` free them) but not the store: it
        works while the store stays open (closing an original made by ``from_config`` or
        ``attach`` closes it). Pickling is unchanged: a pickled cache arrives in the other
        process as read handles of the same sequences (a lease never travels); continue there
        with :meth:`attach`.

        Raises:
            InvalidArgumentError: a forward is in progress (between its layers).
            CacheFullError: the store has no room for the copies (nothing is kept then).
        """
        rows = self._rows
        if rows.pending:
            raise InvalidArgumentError(
                "copy.deepcopy(ShmkvCache) during a forward (layers updated, not all of them): copy the cache "
                "between forwards"
            )
        copy = type(self)(self._store, capacity=rows.capacity)
        memo[id(self)] = copy
        if rows.seqs is not None:
            forks = []
            try:
                for s in rows.seqs:
                    forks.append(s.fork())
            except BaseException:
                for f in forks:
                    f.free()
                raise
            copy._rows.adopt(forks, rows.length)
            copy._rows.copy_state(rows)
        return copy

    def __enter__(self) -> ShmkvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def release(self) -> None:
        """Give up the write leases; the sequences stay in the store for another process."""
        self._rows.release()

    def free(self) -> None:
        """Delete the sequences from the store; the cache is empty again (a new batch may follow)."""
        self._owned_seqs = True
        for s in self._rows.forget():
            s.free()

    def close(self) -> None:
        """Release the leases, and close the store if this cache opened it
        (:meth:`from_config`: a non-persistent store is then removed)."""
        if self._store.closed:
            return
        self.release()
        if self._owns_store:
            self._store.close()

    # -- what transformers asks of a cache ---------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._rows.length

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
        rows = self._rows
        rows.drop_pending()
        if tokens_to_remove == 0 or rows.seqs is None:
            return
        try:
            rows.truncate(max(rows.length + int(tokens_to_remove), 0))
        except NotSupportedError as e:
            raise NotSupportedError(
                f"crop({tokens_to_remove}): {e}. A forward longer than the store's memory= "
                f"({self._store.layout.step}) is committed in steps; its sliding/chunked states are kept "
                "for crop only after cache.activate_past_recording() (generate calls it for assisted "
                "and prompt-lookup decoding; DynamicCache needs it too)"
            ) from e

    def activate_past_recording(self) -> None:
        """Keep what ``crop`` needs after a forward longer than ``memory`` (its sliding/chunked
        layers' states, in this process, until the next forward), as transformers'
        ``DynamicSlidingWindowLayer`` keeps its past when recording. ``generate`` calls it
        where it crops (assisted and prompt-lookup decoding). Forwards of at most ``memory``
        tokens can always be cropped."""
        self._rows.record = True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues the old row ``beam_idx[i]``."""
        self._regather(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows (new sequences copy it)."""
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise InvalidArgumentError(f"batch_repeat_interleave: repeats={repeats!r} must be an int >= 1")
        if self._rows.seqs is None:
            return
        self._regather([i for i in range(len(self._rows.seqs)) for _ in range(int(repeats))], "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (in that order); the dropped rows' sequences are freed."""
        self._regather(indices, "indices")

    def reset(self) -> None:
        """Empty the cache: sequences it created are freed (the next forward may have another
        batch size); sequences given to it are cleared and kept."""
        rows = self._rows
        rows.drop_pending()
        if rows.seqs is None:
            return
        if self._owned_seqs:
            self.free()
        else:
            rows.truncate(0)

    def _regather(self, index: Any, what: str) -> None:
        rows = self._rows
        if rows.seqs is None:
            return
        rows.drop_pending()
        a = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if a.dtype == np.bool_:  # a mask over the rows, as tensor indexing takes it
            a = np.flatnonzero(a)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"{what}={index!r} must be a 1-D sequence of row indices (or a bool mask)")
        idx = a.tolist()
        b = len(rows.seqs)
        bad = [i for i in idx if not -b <= i < b]
        if bad:
            raise InvalidArgumentError(f"{what}: rows {bad[:8]} are out of range for a batch of {b}")
        rows.regather([i % b for i in idx])
