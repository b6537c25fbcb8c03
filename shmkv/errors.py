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
    "AccessDeniedError",
    "CacheFullError",
    "CorruptStoreError",
    "InvalidArgumentError",
    "LayoutMismatchError",
    "LeaseError",
    "LockTimeout",
    "NotSupportedError",
    "ReadOnlyError",
    "RemoteError",
    "SequenceNotFound",
    "ShareError",
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


class ShareError(ShmkvError, OSError):
    """The kernel refused to map a shared prefix span (out of ``vm.max_map_count``?), or a read
    needs one this process could not map (docs/prefix-cache.md, "Limits"). Raised as
    ``ShareError(errno, message)``; ``clean``: a refused re-map left the arrays as they were."""

    clean = True


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


class RemoteError(ShmkvError, ConnectionError):
    """The remote tier (Redis) is down, timed out or refused a command; the message names its URL."""


class AccessDeniedError(ShmkvError, PermissionError):
    """The store (or its lock file) belongs to another user, or its mode does not let us in."""
