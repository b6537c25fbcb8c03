"""The float32 limits the int8 codec's two paths share (``quant``'s numpy calls and
``quant_jit``'s compiled loops, which must agree bit for bit; ``quant`` loads ``quant_jit``,
so neither imports the other's constants).

numba freezes these as constants in ``quant_jit``'s cached machine code (``cache=True``), and
its cache is invalidated only when ``quant_jit.py`` itself changes: a change here must touch
``quant_jit.py`` too (its cached loops would keep the old values)."""

from __future__ import annotations

import numpy as np

__all__ = ["F32_MAX", "NORMAL", "SCALE_MAX"]

F32_MAX = float(np.finfo(np.float32).max)
NORMAL = float(np.finfo(np.float32).tiny) * 127.5  # absmax above it: absmax / 127 is a normal float32


def _largest_scale() -> np.float32:
    """The largest float32 ``s`` whose ``127 * s`` is finite in float32 (fl(max / 127) is not)."""
    s = np.float32(F32_MAX) / np.float32(127)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(127) * s):
            s = np.nextafter(s, np.float32(0))
    return np.float32(s)


SCALE_MAX = _largest_scale()  # the scale of a row whose absmax is float32's largest
