"""The read side of the ``Sequence`` API: what every handle, read or write, offers (lengths,
views and copies of the committed tokens, masks, ``can_resume``, the encoder cache, waiting for
tokens, torch tensors). ``Sequence`` (``handle``) inherits it and adds writing, structural
operations and the lease; the work is done by the handle's parts (``reader.SeqReader``, and the
writer's pending tokens for ``mask`` and ``torch_kv``). What invalidates a view: see ``handle``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from shmkv._sequence.mirror import Int8Mirror
from shmkv._sequence.reader import extent as _extent

if TYPE_CHECKING:
    from shmkv._engine.port import Port
    from shmkv._sequence.reader import SeqReader
    from shmkv._sequence.writer import SeqWriter

__all__ = ["Reads", "stamp"]


class Reads:
    """The read API of a sequence handle (see the module docstring); ``Sequence`` sets its parts."""

    __slots__ = ()

    _p: Port  # the store's engine
    _r: SeqReader
    _w: SeqWriter
    _row: memoryview

    def encoder_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The encoder keys and values of ``layer`` ``[n, kv_heads, head_dim]`` (read-only views;
        int8: dequantized copies); empty when none was set."""
        return self._r.encoder_kv(layer)

    @property
    def encoder_length(self) -> int:
        return self._r.encoder_length()


    @property
    def length(self) -> int:
        """Committed tokens (what every process sees)."""
        return int(_extent(self._r)[2])

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return int(_extent(self._r)[1])

    @property
    def pending(self) -> int:
        """Tokens appended to every layer by this handle and not yet committed."""
        return min(self._w.pending)

    @property
    def remaining_capacity(self) -> int:
        """Tokens that fit before the sequence must grow (moving if needed)."""
        _, cap, length, _ = _extent(self._r)
        return int(cap - length - max(self._w.pending))

    @property
    def is_full(self) -> bool:
        return self.remaining_capacity <= 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the committed tokens (K and V of the layers that hold them, ids, positions)."""
        _, _, length, woff = _extent(self._r)
        p = self._p
        bounded = len(p.layout.bounded)  # (the full layers' bytes: store.bytes_per_token)
        return length * (p.kv_bytes(p.layout.layers - bounded) + 16) + (length - woff) * p.kv_bytes(bounded)

    @property
    def writable(self) -> bool:
        """Whether this handle holds the write lease."""
        return self._w.write

    @property
    def lease_pid(self) -> int:
        self._r.check()
        return self._r.rows.lease_pid(self._row)

    def keys(self, layer: int) -> np.ndarray:
        """Committed keys ``layer`` holds, ``[n, kv_heads, head_dim]``: a read-only zero-copy
        view; for int8 stores a dequantized float32 copy (bfloat16: a copy unless ml_dtypes).

        ``n`` is the length on full layers; sliding and chunked layers hold only the most
        recent tokens (``held_positions(layer)`` gives their positions).
        """
        r = self._r
        lo, hi, _, _ = r.held(r.layer(layer))
        return r.view("k", layer, lo, hi)

    def values(self, layer: int) -> np.ndarray:
        """Committed values of ``layer``; see :meth:`keys`."""
        r = self._r
        lo, hi, _, _ = r.held(r.layer(layer))
        return r.view("v", layer, lo, hi)

    def kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``(keys(layer), values(layer))`` taken at the same length."""
        return self._r.kv(self._r.layer(layer))

    def held_positions(self, layer: int) -> np.ndarray:
        """Positions of the committed tokens ``layer`` holds (rows of ``keys(layer)``)."""
        return self._r.held_positions(self._r.layer(layer))

    def mask(self, layer: int, query_positions: Any) -> np.ndarray:
        """Additive float32 attention mask ``[q, n]`` for new tokens at ``query_positions``.

        Columns are what ``append(layer, ...)`` returned: the tokens ``layer`` holds,
        then this handle's pending ones (at the positions ``commit()`` would give them
        by default). 0 where the layer's kind lets the query see the key, -inf elsewhere:
        full ``p' <= p``; sliding ``p - window < p' <= p``; chunked
        ``p - p % chunk <= p' <= p``.
        """
        r = self._r
        return r.mask(layer, query_positions, self._w.pending[r.layer(layer)])

    def can_resume(self, pos: int) -> bool:
        """Whether a new token at position ``pos`` finds every token it needs in every layer.

        It needs, per layer, each earlier position its kind lets it see; the sequence
        must hold them all (positions 0..pos-1 with none missing), and ``pos`` must not
        skip past the last committed position + 1.
        """
        return self._r.can_resume(pos)

    def raw_keys(self, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Stored keys of ``layer`` without any decoding: ``(codes, scales)`` zero-copy views.

        ``codes`` is the storage array (int8 codes, bfloat16 bits as uint16, or the
        floats); ``scales`` the int8 float32 scales ``[length, kv_heads]``, else None.
        """
        return self._r.raw("k", layer)

    def raw_values(self, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Stored values of ``layer``; see :meth:`raw_keys`."""
        return self._r.raw("v", layer)

    @property
    def tokens(self) -> np.ndarray:
        """Token ids of the committed tokens (read-only view; -1 where none was given)."""
        return self._r.committed(ids=True)

    @property
    def positions(self) -> np.ndarray:
        """Positions of the committed tokens (read-only view)."""
        return self._r.committed(ids=False)

    def head(self, layer: int, head: int, begin: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of one KV head over tokens ``[begin, end)``: views ``[n, head_dim]``."""
        return self._r.head(self.kv(layer), head, begin, end)

    def iter_tokens(self, layer: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """Yield ``(token_id, position, k, v)`` for each committed token of ``layer``."""
        return self._r.iter_tokens(layer)

    def read(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the committed keys and values of ``layer``, consistent even while
        structural operations run (seqlock: retried, then taken under the lock)."""
        return self._r.read(layer)

    # -- waiting for tokens, torch tensors ------------------------------------

    def wait(self, length: int | None = None, timeout: float | None = None) -> int:
        """Block until the committed length reaches ``length``; return the length then.

        ``length=None`` waits until the length differs from what it is at the call (a
        commit, or a truncate). The thread sleeps in the kernel (futex(2)) on the row's
        length word: on a read-write attachment the commit wakes it (as fast as a pipe
        would), and an idle waiter costs a wake-up every 2 s. A read-only attachment
        cannot register as a waiter: it looks again after sleeps growing from 50 us to
        4 ms (see ``shmkv/_sequence/waiting.py``). Works on read handles.

        Raises:
            WaitTimeout: ``timeout`` seconds passed first (the message gives the length).
            SequenceNotFound: the sequence is freed (before or while waiting).
            StoreClosedError: the store handle is closed.

        Example:
            >>> n = seq.wait(len(seq) + 16, timeout=5.0)    # doctest: +SKIP
        """
        return self._r.wait(length, timeout)

    async def wait_async(self, length: int | None = None, timeout: float | None = None) -> int:
        """:meth:`wait` for asyncio: the wait runs on a thread of its own, never blocking the
        event loop; cancelling the task wakes and ends that thread."""
        return await self._r.wait_async(length, timeout)

    def torch_kv(self, layer: int, pending: bool = False) -> tuple[Any, Any]:
        """Committed keys and values of ``layer`` as torch tensors ``[n, kv_heads, head_dim]``;
        ``pending=True``: this handle's pending tokens too (the cells ``append`` returned).

        On a read-write attachment, for float32, float16, float64 and bfloat16 (its stored
        uint16 bits viewed as ``torch.bfloat16``), the tensors are zero-copy: **writing
        into them writes the shared cache** that every process reads. On a read-only
        attachment (its mapping cannot be written) and for int8 stores (dequantized to
        float32) they are copies. The same rules as :meth:`keys` say how long the content
        holds. torch is imported here: ``import shmkv`` never imports it.
        """
        layer = self._r.layer(layer)
        staged = Int8Mirror.staged_rows(self._w, layer) if pending else None
        if staged is not None:  # int8: pending tokens are in the write handle's mirror until commit
            import torch

            return torch.from_numpy(staged[0]), torch.from_numpy(staged[1])
        cells = self._w.pending_cells(layer) if pending else None
        return self._r.torch_kv(layer, (self._w.Kw, self._w.Vw), cells)


def stamp(seq: Reads) -> tuple[int, int]:
    """(generation, faithful) of ``seq``'s row now, for a reader that sends its views elsewhere
    over time (the remote tier's push). The generation changes with every structural change of
    the sequence (a move as it grows past its capacity, a truncate, a remove, a rewind, its free:
    whatever may give its cells to another sequence), never with a commit, and is odd while one
    runs: bytes read from views taken after one read of it are this sequence's if a later read
    gives the same even value. ``faithful``: the leading tokens that are a faithful computation
    from position 0 (-1: all of them; tokens past it were moved by a ``remove`` or ``shift_left``
    and are no prefix)."""
    r = seq._r
    r.check()
    return r.rows.generation(r.row), r.rows.faithful(r.row)
