"""Storage dtypes: names, codes in the header, numpy dtypes."""

from __future__ import annotations

import numpy as np

from shmkv.errors import InvalidArgumentError, NotSupportedError

# name -> (header code, numpy storage dtype). bfloat16 is stored as its uint16
# bits and int8 with a float32 scale per (token, head): see _quant.
_TABLE: dict[str, tuple[int, np.dtype]] = {
    "float32": (1, np.dtype(np.float32)),
    "float16": (2, np.dtype(np.float16)),
    "float64": (3, np.dtype(np.float64)),
    "bfloat16": (4, np.dtype(np.uint16)),
    "int8": (5, np.dtype(np.int8)),
}
PLAIN = ("float32", "float16", "float64")
_PLANNED: tuple[str, ...] = ()
_BY_CODE = {code: name for name, (code, _) in _TABLE.items()}


def canonical(dtype: object) -> str:
    """Map 'float16', np.float16, np.dtype('float16') ... to the storage name."""
    name = dtype if isinstance(dtype, str) else None
    if name is None and getattr(dtype, "__name__", None) == "bfloat16":
        name = "bfloat16"  # ml_dtypes.bfloat16
    if name is None:
        try:
            name = np.dtype(dtype).name  # type: ignore[call-overload]  # any object: a TypeError is caught
        except TypeError:
            raise InvalidArgumentError(f"dtype={dtype!r} is not a dtype: use one of {sorted(_TABLE)}") from None
    if name in _PLANNED:
        raise NotSupportedError(f"dtype={name!r} is not implemented yet: use one of {sorted(_TABLE)}")
    if name not in _TABLE:
        raise InvalidArgumentError(f"dtype={dtype!r} is not supported: use one of {sorted(_TABLE)}")
    return name


def code(name: str) -> int:
    return _TABLE[name][0]


def from_code(c: int) -> str:
    return _BY_CODE[c]


def storage(name: str) -> np.dtype:
    return _TABLE[name][1]


def itemsize(name: str) -> int:
    return _TABLE[name][1].itemsize
