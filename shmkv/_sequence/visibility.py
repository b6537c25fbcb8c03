"""Which positions a token sees on each layer kind (full, sliding, chunked), and attention masks."""

from __future__ import annotations

from typing import Any

import numpy as np


def visible_from(layout: Any, layer: int, p: Any) -> Any:
    """The oldest position a token at position(s) ``p`` sees on ``layer`` (it sees up to ``p``).

    The one statement of the visibility rule: sliding ``p - window < p'``, chunked
    ``p - p % chunk <= p'``, full everything.
    """
    kind = layout.layer_types[layer]
    if kind == "sliding":
        return np.maximum(0, p - layout.window + 1)
    if kind == "chunked":
        return p - p % layout.chunk
    return np.zeros_like(p)


def attention_mask(layout: Any, layer: int, query_positions: np.ndarray, key_positions: np.ndarray) -> np.ndarray:
    """0 / -inf float32 mask ``[q, k]`` of which keys each query sees on ``layer``."""
    qp = np.asarray(query_positions, np.int64)[:, None]
    kp = np.asarray(key_positions, np.int64)[None, :]
    ok = (kp <= qp) & (kp >= visible_from(layout, layer, qp))
    return np.where(ok, np.float32(0), np.float32(-np.inf))
