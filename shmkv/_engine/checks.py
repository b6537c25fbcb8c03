"""Argument checks shared by the API modules (messages name the argument)."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from shmkv._engine.table.header import META_BYTES
from shmkv.errors import InvalidArgumentError


def count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int, checked to be an integer (not a bool) >= ``minimum``."""
    if type(value) is int and value >= minimum:  # (the common case, on the speculative-decoding path)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name}={value!r} must be an int >= {minimum}")
    if value < minimum:
        raise InvalidArgumentError(f"{name}={value} must be >= {minimum}")
    return int(value)


def int_list(what: str, name: str, values: Any, hint: str = "") -> list[int]:
    """``values`` (any iterable, read once) as a list of Python ints; a string, a non-iterable
    or an element that is not an integer (1.5, True, 'a') is refused, naming it."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidArgumentError(f"{what}: {name}={values!r} must be a list of ints{hint}")
    values = list(values)
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise InvalidArgumentError(f"{what}: {name}={values[:16]!r} holds {x!r}, not an int{hint}")
    return [int(x) for x in values]


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


def pack_meta(value: Any) -> bytes:
    """``seq.meta = value``'s record: ``value`` checked (a dict) and packed (at most META_BYTES)."""
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"meta must be a dict, got {type(value).__name__}")
    try:
        packed = msgpack.packb(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgumentError(
            f"meta {value!r:.80} cannot be packed ({e}): use str, int, float, bool, bytes, lists and dicts"
        ) from None
    if len(packed) > META_BYTES:
        raise InvalidArgumentError(
            f"meta packs to {len(packed)} bytes, more than the {META_BYTES} a sequence keeps: "
            "store an id here and the rest elsewhere"
        )
    return bytes(packed)


def check_timeout(name: str, value: object) -> float:
    if type(value) is float and value >= 0.0:  # (the default's case: no isnan, nor numpy's types, asked)
        return value  # (a NaN fails the comparison and is refused below)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or math.isnan(value) or value < 0:
        raise InvalidArgumentError(f"{name}={value!r} must be a number of seconds >= 0")
    return float(value)
