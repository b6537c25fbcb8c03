"""Argument checks shared by the API modules (messages name the argument)."""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgumentError


def count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int, checked to be an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name}={value!r} must be an int >= {minimum}")
    if value < minimum:
        raise InvalidArgumentError(f"{name}={value} must be >= {minimum}")
    return int(value)
