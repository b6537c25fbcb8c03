"""shmkv: a transformer KV cache in shared memory, shared by several processes.

See README.md for a tour, docs/design.md for the contract and ARCHITECTURE.md for the map of the code.
"""

from shmkv._sequence.batch import Batch
from shmkv._engine.table.header import Layout
from shmkv._sequence.handle import Sequence
from shmkv._snapshot.format import Snapshot, read_header
from shmkv.store._doctor import Doctor, doctor
from shmkv.store._lifecycle import create, gc, list_stores, load, remove
from shmkv.store._records import SequenceInfo, StoreStats
from shmkv.store._store import Store, attach
from shmkv.errors import (
    AccessDeniedError,
    CacheFullError,
    CorruptStoreError,
    InvalidArgumentError,
    LayoutMismatchError,
    LeaseError,
    LockTimeout,
    NotSupportedError,
    ReadOnlyError,
    RemoteError,
    SequenceNotFound,
    ShareError,
    ShmkvError,
    SnapshotError,
    StoreClosedError,
    StoreExistsError,
    StoreNotFound,
    WaitTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "Batch",
    "CacheFullError",
    "CorruptStoreError",
    "Doctor",
    "InvalidArgumentError",
    "Layout",
    "LayoutMismatchError",
    "LeaseError",
    "LockTimeout",
    "NotSupportedError",
    "ReadOnlyError",
    "RemoteError",
    "Sequence",
    "SequenceInfo",
    "SequenceNotFound",
    "ShareError",
    "ShmkvError",
    "Snapshot",
    "SnapshotError",
    "Store",
    "StoreClosedError",
    "StoreExistsError",
    "StoreNotFound",
    "StoreStats",
    "WaitTimeout",
    "__version__",
    "attach",
    "create",
    "doctor",
    "gc",
    "list_stores",
    "load",
    "read_header",
    "remove",
]
