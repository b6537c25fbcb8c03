"""Batch forward across sequences (continuous batching).

``batch = store.forward(seq_ids, positions)`` names one entry per new token
(several sequences, several tokens each, in any order). ``batch.put(layer, k,
v)`` writes that layer's new keys and values of every row and returns the keys
and values gathered over the batch's sequences, with a mask
``[batch_tokens, kv_rows]`` in which each row sees exactly the tokens its own
sequence allows on that layer. ``batch.commit()`` publishes, once every layer
was put. Gathering copies, but only the rows the batch's sequences hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shmkv._engine.checks import ints, not_arrays
from shmkv._sequence.handle import Sequence, writer_for, writer_part
from shmkv._sequence.visibility import attention_mask
from shmkv._sequence.writer import kv_arrays
from shmkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shmkv._sequence.handle import Owner


class Batch:
    """The new tokens of several sequences for one forward pass. Use as a context manager
    (or call ``close()``) so an uncommitted batch drops its pending tokens."""

    def __init__(self, store: Owner, seq_ids: Any, positions: Any, tokens: Any = None) -> None:
        ids = np.asarray(seq_ids)
        pos = np.asarray(positions)
        if ids.ndim != 1 or pos.shape != ids.shape or (ids.size and (ids.dtype.kind not in "iu"
                                                                      or pos.dtype.kind not in "iu")):
            raise InvalidArgumentError(
                f"forward: seq_ids {ids.shape} and positions {pos.shape} must be equally long 1-D int arrays "
                "(one entry per new token)"
            )
        self._store = store
        self.n = int(ids.size)
        self.positions = pos.astype(np.int64)
        self.tokens = None if tokens is None else ints("tokens", tokens, self.n)
        self._order: list[int] = list(dict.fromkeys(int(i) for i in ids))
        self._rows = {sid: np.flatnonzero(ids == sid) for sid in self._order}
        self._seqs: dict[int, Sequence] = {}
        self._owned: list[Sequence] = []
        self._done: set[int] = set()
        self._failed = False
        self._committed = False
        try:
            for sid in self._order:
                seq = writer_for(store, sid)
                if seq is None:
                    seq = store.sequence(sid, write=True)
                    self._owned.append(seq)
                elif any(pending := writer_part(seq).pending):  # checked before the batch adopts it: close()
                    raise InvalidArgumentError(                        # must not drop them
                        f"forward: sequence {sid} has uncommitted appends {pending}; commit() them first "
                        "(they are kept)"
                    )
                self._seqs[sid] = seq
                p = self.positions[self._rows[sid]]
                held = seq.positions
                last = int(held[-1]) if held.size else -1
                want = np.arange(last + 1, last + 1 + p.size)
                if not np.array_equal(p, want):
                    raise InvalidArgumentError(
                        f"forward: positions {p.tolist()[:8]} of sequence {sid} must continue its last position "
                        f"{last} without going backwards or skipping (expected {want.tolist()[:8]})"
                    )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(self, layer: int, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write this layer's keys and values ``[batch_tokens, kv_heads, head_dim]`` of every row.

        Returns:
            ``(K, V, mask)``: K and V ``[kv_rows, kv_heads, head_dim]`` gathered over the
            batch's sequences (what each holds on this layer, then its new tokens), and
            an additive float32 mask ``[batch_tokens, kv_rows]``.
        """
        if self._committed or self._failed:
            raise InvalidArgumentError("put: this batch was committed or failed; start a new store.forward()")
        first = next(iter(self._seqs.values()), None)
        if first is None:
            raise InvalidArgumentError("put: the batch has no tokens")
        w = writer_part(first)
        layer = w.r.layer(layer)
        if layer in self._done:
            raise InvalidArgumentError(f"put: layer {layer} was put already in this batch")
        try:
            k = np.asarray(k)
            v = np.asarray(v)
        except (TypeError, ValueError, RuntimeError):
            raise not_arrays("put", {"k": k, "v": v}) from None
        H, D = w.cell
        if k.shape != (self.n, H, D) or v.shape != k.shape:
            raise InvalidArgumentError(
                f"put: k {k.shape} and v {v.shape} must be [batch_tokens={self.n}, kv_heads={H}, head_dim={D}]"
            )
        parts = {sid: kv_arrays(writer_part(seq), k[self._rows[sid]], v[self._rows[sid]])  # all checked first
                 for sid, seq in self._seqs.items()}
        keys, values, cols = [], [], []
        try:
            for sid, seq in self._seqs.items():
                rows = self._rows[sid]
                kk, vv = seq.append(layer, *parts[sid])
                keys.append(kk)
                values.append(vv)
                held = seq.held_positions(layer)
                cols.append(np.concatenate([held, self.positions[rows]]))
        except BaseException:
            self._failed = True
            raise
        self._done.add(layer)
        mask = np.full((self.n, sum(c.size for c in cols)), -np.inf, np.float32)
        at = 0
        for (sid, _), kp in zip(self._seqs.items(), cols, strict=True):
            rows = self._rows[sid]
            mask[rows, at : at + kp.size] = attention_mask(self._store.layout, layer, self.positions[rows], kp)
            at += kp.size
        return np.concatenate(keys), np.concatenate(values), mask

    def commit(self) -> None:
        """Publish every sequence's new tokens (after every layer was put)."""
        if self._committed or self._failed:
            raise InvalidArgumentError("commit: this batch was committed or failed")
        layers = self._store.layout.layers
        missing = [i for i in range(layers) if i not in self._done]
        if missing and self.n:
            raise InvalidArgumentError(f"commit: layers {missing} were not put; put every layer before commit()")
        for sid, seq in self._seqs.items():
            rows = self._rows[sid]
            seq.commit(tokens=None if self.tokens is None else self.tokens[rows], positions=self.positions[rows])
        self._committed = True
        self.close()

    def close(self) -> None:
        """Drop uncommitted tokens and give back the leases the batch took."""
        for seq in self._seqs.values():
            if not self._committed:
                writer_part(seq).drop_pending()
        for seq in self._owned:
            seq.release()
        self._owned = []
