"""Argument checks shared by the API modules (messages name the argument)."""

from __future__ import annotations

import math
import threading
from typing import Any

import msgpack
import numpy as np

from shmkv._engine.table.header import META_BYTES
from shmkv.errors import InvalidArgumentError

MAX_POSITION = 2**63 - 1  # positions and token ids are int64 words


def count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int, checked to be an integer (not a bool) >= ``minimum``."""
    if type(value) is int and value >= minimum:  # (the common case, on the speculative-decoding path)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name}={value!r} must be an int >= {minimum}")
    if value < minimum:
        raise InvalidArgumentError(f"{name}={value} must be >= {minimum}")
    return int(value)


def int_list(what: str, name: str, values: Any, hint: str = "", *, distinct: bool = False) -> list[int]:
    """``values`` (any iterable, read once) as a list of Python ints; a string, a non-iterable
    or an element that is not an integer (1.5, True, 'a') is refused, naming it; with
    ``distinct``, a value given twice too."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidArgumentError(f"{what}: {name}={values!r} must be a list of ints{hint}")
    values = list(values)
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise InvalidArgumentError(f"{what}: {name}={values[:16]!r} holds {x!r}, not an int{hint}")
    out = [int(x) for x in values]
    if distinct and len(set(out)) != len(out):
        raise InvalidArgumentError(f"{name}={out[:16]} names a sequence twice; name each once")
    return out


def ints(name: str, values: Any, n: int) -> np.ndarray:
    """``values`` as ``n`` int64s (a scalar counts as one), checked: one per pending token."""
    a = np.asarray(values)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.shape != (n,) or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgumentError(
            f"{name} must be {n} int{'' if n == 1 else 's'} (one per pending token), got shape {a.shape} "
            f"dtype {a.dtype}"
        )
    if a.dtype == np.uint64 and a.size and int(a.max()) > MAX_POSITION:  # (what astype would wrap negative)
        raise InvalidArgumentError(f"{name} holds {int(a.max())}, more than an int64 holds ({MAX_POSITION})")
    return a.astype(np.int64, copy=False)


def positions_fit(what: str, n: int, last: int, positions: np.ndarray | None) -> None:
    """The positions of a commit of ``n`` tokens (given, increasing: ``ints``'s; or the default,
    after ``last``) stay within an int64."""
    top = last + n if positions is None else int(positions[-1])
    if top > MAX_POSITION:
        raise InvalidArgumentError(
            f"{what}: the last position would be {top}, past the largest an int64 holds ({MAX_POSITION})"
            + ("" if positions is not None else f" (the default continues after {last}: pass positions=)")
        )


def as_arrays(what: str, named: dict[str, Any]) -> list[np.ndarray]:
    """``np.asarray`` of each value of ``named`` (argument name -> value), or ``not_arrays``'s
    error for the first numpy cannot read. (The per-token paths, append and a batch's put, keep
    their own inline ``try``: no call added there.)"""
    try:
        return [np.asarray(v) for v in named.values()]
    except (TypeError, ValueError, RuntimeError):
        raise not_arrays(what, named) from None


def not_arrays(what: str, named: dict[str, Any]) -> InvalidArgumentError:
    """The error for inputs numpy cannot make an array of (``named``: argument name -> value, in
    order: the first that fails is named), with what to pass instead."""
    for name, value in named.items():
        try:
            np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as e:
            dtype = str(getattr(value, "dtype", ""))
            if getattr(value, "requires_grad", False):
                hint = "a tensor that requires grad: pass it .detach()ed"
            elif dtype == "torch.bfloat16":
                hint = "a torch bfloat16 tensor, which numpy cannot read: pass t.float() (the store casts it)"
            else:
                hint = "pass an array (or nested lists of one shape)"
            return InvalidArgumentError(f"{what}: {name} cannot be read as an array ({e}): {hint}")
    return InvalidArgumentError(f"{what}: {', '.join(named)} cannot be read as arrays")


def check_progress(what: str, progress: object) -> None:
    """A snapshot's ``progress``: None or a callable ``progress(done, total)``."""
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(f"{what}: progress={progress!r} must be a callable progress(done, total), or None")


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
    try:
        msgpack.unpackb(packed)  # as every reader unpacks it (a snapshot too): a key must be a str or bytes
    except ValueError as e:
        raise InvalidArgumentError(
            f"meta {value!r:.80} could not be read back ({e}): the keys of its dicts, nested ones too, must be str"
        ) from None
    if len(packed) > META_BYTES:
        raise InvalidArgumentError(
            f"meta packs to {len(packed)} bytes, more than the {META_BYTES} a sequence keeps: "
            "store an id here and the rest elsewhere"
        )
    return bytes(packed)


def check_timeout(name: str, value: object) -> float:
    """``value`` as a number of seconds >= 0, at most what a wait of the threading module takes
    (``threading.TIMEOUT_MAX``, some 292 years here: infinity and NaN are refused)."""
    if type(value) is float and 0.0 <= value <= threading.TIMEOUT_MAX:  # (the default's case: no isnan asked)
        return value  # (a NaN fails the comparison and is refused below)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or math.isnan(value) or not 0 <= value <= threading.TIMEOUT_MAX:
        raise InvalidArgumentError(
            f"{name}={value!r} must be a finite number of seconds >= 0 (at most {threading.TIMEOUT_MAX:.0f})"
        )
    return float(value)
