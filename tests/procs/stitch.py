"""Child-process functions of tests/test_stitch.py (module level, so spawn can import them)."""

from __future__ import annotations

import os

import numpy as np

from shmkv._engine.spans import stitch


def read_stitched(path: str, pieces: list[tuple[int, int]], count: int) -> list[int]:
    """In a child: stitch ``pieces`` of the file at ``path`` and return its first ``count`` bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        a = stitch.Stitch(fd, pieces, writable=False).array(np.uint8, (count,))
        return a.tolist()
    finally:
        os.close(fd)


def read_inherited(a: np.ndarray) -> list[int]:
    """In a fork child: the parent's stitched array, as inherited."""
    return a.tolist()
