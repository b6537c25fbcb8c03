"""Argument checks shared by the API modules (messages name the argument)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidArgumentError


def count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int, checked to be an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name}={value!r} must be an int >= {minimum}")
    if value < minimum:
        raise InvalidArgumentError(f"{name}={value} must be >= {minimum}")
    return int(value)


def ints(name: str, values: Any, n: int) -> np.ndarray:
    """``values`` as ``n`` int64s (a scalar counts as one), checked: one per pending token."""
    a = np.asarray(values)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.shape != (n,) or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgumentError(
            f"{name} must be {n} ints (one per pending token), got shape {a.shape} dtype {a.dtype}"
        )
    return a.astype(np.int64, copy=False)
