"""Prefix reuse for :class:`shmkv.transformers.ShmkvCache` (docs/design.md §8): the rows of
``ShmkvCache.for_prompt`` start from the longest prefix any process cached, and
``cache.finish`` records generate's token ids and keeps the rows as cached prefixes.

Imports torch; ``import shmkv`` never imports this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shmkv.transformers._rows import DEFAULT_CAPACITY
from shmkv._sequence.handle import Sequence
from shmkv.store._store import Store
from shmkv.errors import InvalidArgumentError


def token_rows(ids: Any, what: str) -> list[np.ndarray]:
    """``[batch, n]`` token ids (a tensor, an array, nested lists, generate's output) as int64 rows."""
    if isinstance(getattr(ids, "sequences", None), torch.Tensor):  # generate's GenerateOutput
        ids = ids.sequences
    a = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if a.ndim != 2 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{what} must be [batch, n] token ids, got shape {a.shape} dtype {a.dtype}")
    return [row.astype(np.int64) for row in a]


def prompt_sequences(store: Store, input_ids: Any, capacity: int | None) -> tuple[list[Sequence], int]:
    """One new sequence per row of ``input_ids``, each holding the same number of reused tokens:
    the shortest longest-cached-prefix among the rows (at most ``len - 1``). Returns the
    sequences and that number. All are created, or none (the ones made are freed)."""
    rows = token_rows(input_ids, "input_ids")
    k = min(store.match_prefix(r) for r in rows)
    longest = max(len(r) for r in rows)
    # room for the prompt and what generate adds: a row that outgrew its range at the first new
    # token would move, and a move copies the cells it borrowed from a cached prefix
    cap = max(capacity, longest) if capacity else longest + DEFAULT_CAPACITY
    seqs = store.create_sequences(len(rows), cap, prefix=[r[: k + 1] for r in rows])
    try:
        n = min(len(s) for s in seqs)  # a donor evicted since match_prefix: fewer on that row
        for s in seqs:
            if len(s) > n:
                s.truncate(n)
    except BaseException:
        for s in seqs:
            s.free()
        raise
    return seqs, n


def prompt_ids(input_ids: Any, attention_mask: Any) -> list[np.ndarray | None] | None:
    """Per row of ``for_prompt``'s ``input_ids``, the ids its prefill commits with, or None for a
    row that may hold padding (its cells are computed with the padding masked out, which a match
    by ids cannot tell): with ``attention_mask`` the rows it shows unpadded, without one a
    single row (a batch of several is padded to its longest row)."""
    ids = token_rows(input_ids, "input_ids")
    rows: list[np.ndarray | None] = list(ids)
    if attention_mask is None:
        return rows if len(rows) == 1 else None
    mask = token_rows(attention_mask, "attention_mask")
    if len(mask) != len(ids) or any(len(m) != len(r) for m, r in zip(mask, ids, strict=True)):
        raise InvalidArgumentError(
            f"attention_mask {[len(m) for m in mask]} must have the shape of input_ids {[len(r) for r in ids]}"
        )
    kept: list[np.ndarray | None] = [r if bool((m != 0).all()) else None for r, m in zip(ids, mask, strict=True)]
    return kept if any(r is not None for r in kept) else None


def check_finish(seqs: list[Sequence], length: int, output_ids: Any, attention_mask: Any, *,
                 pad: int | None = None, prompt: int | None = None) -> list[tuple[Sequence, np.ndarray | None]]:
    """``ShmkvCache.finish``'s checks, before anything is recorded: per row, its sequence and the
    ids of its ``length`` cells from ``output_ids``, or None for a padded row (per
    ``attention_mask``; without one, a row whose first ``prompt`` ids (default: all) hold
    ``pad``, the id generate then masks out: freed, not cached)."""
    rows = token_rows(output_ids, "output_ids")
    if len(rows) != len(seqs) or any(len(r) < length for r in rows):
        raise InvalidArgumentError(
            f"finish: output_ids {[len(r) for r in rows]} must be {len(seqs)} rows of at least "
            f"{length} token ids (the cache's length)"
        )
    padded = [False] * len(rows)
    if attention_mask is not None:
        mask = token_rows(attention_mask, "attention_mask")
        padded = [bool((m[:length] == 0).any()) for m in mask]
    elif pad is not None:
        end = length if prompt is None else min(prompt, length)
        padded = [bool((r[:end] == pad).any()) for r in rows]
    for s, r, p in zip(seqs, rows, padded, strict=True):
        if not p:
            _check_tokens(s, r[:length])
    return [(s, None if p else r[:length]) for s, r, p in zip(seqs, rows, padded, strict=True)]


def record_finish(checked: list[tuple[Sequence, np.ndarray | None]]) -> None:
    """Record the ids and finish each sequence that ``check_finish`` passed; free the padded ones."""
    for s, ids in checked:
        if ids is None:
            s.free()
        else:
            s.set_tokens(ids)  # the forward saw states, not ids: the prefix cache needs them
            s.finish()


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


def inferred_pad(model: Any) -> int | None:
    """The id ``generate()`` masks out as padding when it is given no attention_mask (it infers
    ``ids != pad_token_id``): ``model.generation_config.pad_token_id``, unless none or an
    end-of-sequence id (then it infers nothing)."""
    gen = getattr(model, "generation_config", None)
    pad, eos = getattr(gen, "pad_token_id", None), getattr(gen, "eos_token_id", None)
    eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return pad if isinstance(pad, int) and pad not in eos_ids else None


def without_pad(rows: list[np.ndarray | None] | None, pad: int) -> list[np.ndarray | None] | None:
    """``prompt_ids``' rows less those holding ``pad`` (None when none is left)."""
    if rows is None:
        return None
    kept = [None if r is None or bool((r == pad).any()) else r for r in rows]
    return kept if any(r is not None for r in kept) else None
