"""The shmkv error tree.

Every error raised on purpose by shmkv is a :class:`ShmkvError` and also the
builtin that fits, so ``except KeyError`` keeps working for callers that do not
know shmkv. Messages name the offending value and the setting that fixes it.
All errors are plain one-argument exceptions, so they pickle and cross process
boundaries (a child's ``LeaseError`` re-raised in its parent stays a
``LeaseError``).
"""

from __future__ import annotations

__all__ = [
    "CacheFullError",
    "CorruptStoreError",
    "InvalidArgumentError",
    "LayoutMismatchError",
    "LeaseError",
    "LockTimeout",
    "NotSupportedError",
    "ReadOnlyError",
    "SequenceNotFound",
    "ShmkvError",
    "SnapshotError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreNotFound",
    "WaitTimeout",
]


class ShmkvError(Exception):
    """Base class of every error shmkv raises on purpose."""

    def __str__(self) -> str:
        # KeyError's __str__ would repr() the message; keep it readable.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class InvalidArgumentError(ShmkvError, ValueError):
    """A value, shape, dtype or index given to shmkv is not acceptable."""


class CacheFullError(ShmkvError, MemoryError):
    """No room: the store's token cells, sequence slots or /dev/shm are exhausted."""


class LayoutMismatchError(ShmkvError, ValueError):
    """Two layouts (store and snapshot, or create and attach) disagree."""


class CorruptStoreError(ShmkvError, ValueError):
    """A segment is not a shmkv store, or its header is damaged."""


class SnapshotError(ShmkvError, ValueError):
    """A snapshot file is damaged, truncated or not a shmkv snapshot."""


class LockTimeout(ShmkvError, TimeoutError):
    """The store lock was not acquired within the timeout."""


class LeaseError(ShmkvError, PermissionError):
    """The sequence's write lease is held by another live process or handle."""


class ReadOnlyError(ShmkvError, PermissionError):
    """A mutating call on a read-only attachment or read handle."""


class SequenceNotFound(ShmkvError, KeyError):
    """No live sequence has that id."""


class StoreNotFound(ShmkvError, FileNotFoundError):
    """No store of that name exists."""


class StoreExistsError(ShmkvError, FileExistsError):
    """A store of that name exists already."""


class StoreClosedError(ShmkvError, RuntimeError):
    """The store handle was closed; attach again to keep working."""


class NotSupportedError(ShmkvError, NotImplementedError):
    """The operation is not supported for this store's layout or platform."""


class WaitTimeout(ShmkvError, TimeoutError):
    """``seq.wait()`` timed out before the sequence reached the length waited for."""
