"""Store: a named KV cache in shared memory, the public handle. It holds its engine (an
``_engine.engine.Engine``: mappings, table, lock and journal, cell placement) and delegates to
it; create, gc and the rest of the lifecycle: ``_lifecycle``."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from shmkv._sequence import group as _group
from shmkv._engine.table import header as _header
from shmkv._engine.locking import interrupts as _interrupts
from shmkv._engine.locking import lock as _lock
from shmkv._engine.memory import segment as _segment
from shmkv._engine.table import unattached as _unattached
from shmkv._snapshot import restore as _restore
from shmkv._snapshot import save as _save
from shmkv._engine.checks import check_timeout
from shmkv._engine.engine import Engine
from shmkv._sequence.batch import Batch
from shmkv._engine.clients.lease import live_writers
from shmkv._engine.table.header import Layout
from shmkv._engine.clients.liveness import Liveness
from shmkv._engine.memory.segment import Segment
from shmkv._sequence.handle import Sequence, drop_lease
from shmkv.store import _handles, _records
from shmkv.store._records import SequenceInfo, StoreStats
from shmkv.store._removal import read_identity, remove_then_forget
from shmkv.errors import (
    AccessDeniedError,
    CacheFullError,
    CorruptStoreError,
    ShmkvError,
    StoreNotFound,
)

DEFAULT_MAX_CLIENTS = 128
DEFAULT_CAPACITY = 256
SeqId = int  # sequence ids are plain ints in the API; kept as a name for the docs


class Store:
    """A handle on a named store. Create with :func:`create`, attach with :func:`attach`.

    ``close()`` gives up this handle's leases and client slot, closes its
    descriptors and unmaps both segments at once. A view (``seq.keys()``, ...) or a
    Sequence handle that outlives it keeps the pages it uses mapped until it is
    collected: reading it stays valid, never a segfault (``.copy()`` what you keep
    for long). The creator's ``close()`` (or exit) also removes a non-persistent
    store, if its segments are still the ones it created; dropping the handle
    (garbage collection) only closes it. ``unlink()`` removes the store
    explicitly, also after ``close()``.
    """

    def __init__(self, name: str, hseg: Segment, dseg: Segment, layout: Layout, max_clients: int, *,
                 creator: bool, persistent: bool, lock_timeout: float, live: Liveness | None = None) -> None:
        # The engine (the mappings, the table, the lock and journal, cell placement) does the
        # work; the store is its public face and delegates. The sequence layer and snapshots
        # see the engine through its narrow core (``_engine.port.Port``), never the store's privates.
        self._engine = e = Engine(name, hseg, dseg, layout, max_clients, creator=creator, persistent=persistent,
                                 lock_timeout=lock_timeout, live=live)
        self.name = name
        self.layout = layout
        self.readonly = e.readonly

    @property
    def lock_timeout(self) -> float:
        """Seconds a structural operation waits for the store lock (``LockTimeout`` after)."""
        return self._engine.lock_timeout

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in the full layers (K, V, int8 scales), plus its id and position.

        Sliding and chunked layers add ``kv_bytes(len(bounded))`` per token they keep (see stats()).
        """
        return self._engine.kv_bytes(self.layout.layers - len(self.layout.bounded)) + 16

    # -- lifecycle -------------------------------------------------------------

    def __repr__(self) -> str:
        state = "closed" if self._engine.shut else ("read-only" if self.readonly else "read-write")
        lay = self.layout
        return (f"<shmkv.Store {self.name!r} {state} layers={lay.layers} kv_heads={lay.kv_heads} "
                f"head_dim={lay.head_dim} dtype={lay.dtype} max_tokens={lay.max_tokens}>")

    def __reduce__(self) -> tuple[Any, ...]:
        # A store pickles by name: the receiving process attaches on its own.
        return (attach, (self.name, self.readonly))

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        # closing counts: a handle whose lease close() just dropped says StoreClosedError, not ReadOnlyError
        return self._engine.closed

    @property
    def persistent(self) -> bool:
        e = self._engine
        e.check_open()
        return e.rows.persistent()

    def close(self) -> None:
        """Give up this handle's leases, close its descriptors and unmap (views the caller still
        holds keep their own pages); the creator also removes a non-persistent store.

        The store is removed only while its segments are still the ones this
        process created (same store identity): a newer store of the same name
        is left alone.
        """
        self._close(remove=None)

    @_interrupts.shielding()  # (a Ctrl-C as a descriptor is closed: raised once the close is done)
    def _close(self, remove: bool | None) -> None:
        """Close (``remove``: None, the creator's rule; True/False: remove or not). Another thread's
        hold of the store lock (a structural operation in progress) is waited out first (up to
        lock_timeout), and a thread that uses the handle afterwards gets StoreClosedError."""
        if self.__dict__.get("_close_done"):
            return
        e = self._engine
        quiet = e.quiesce(self.lock_timeout)
        try:
            if not self.__dict__.get("_close_done"):  # (another thread closed it while this one waited)
                self._teardown(remove)
        finally:
            if quiet:
                e.unquiesce()

    def _teardown(self, remove: bool | None) -> None:
        """Every step may be cut short by an exception (Ctrl-C): the next close() finishes the job
        (each step is idempotent), and until it is done the finalizer still closes what is left."""
        e = self._engine
        plan: tuple[bool, bool] | None = self.__dict__.get("_close_plan")
        if plan is None:
            if remove is None:
                remove = e.creator and not e.rows.persistent()
            inherited = e.inherited()
            plan = self._close_plan = (bool(remove) and not inherited, inherited)
            e.closed = True  # closing counts: a handle whose lease is dropped next says StoreClosedError
        remove, inherited = plan
        if not e.shut:
            if not inherited and not self.readonly:
                for handle in list(live_writers.values()):
                    if isinstance(handle, Sequence) and handle.store is self:
                        drop_lease(handle)
                try:
                    # a store removed meanwhile has no lock file to take (taking it would leave one behind)
                    if read_identity(self.name) == e.identity:
                        e.drop_waiters()
                except Exception:  # closing must not fail because the lock is stuck
                    pass
            elif not inherited:
                e.drop_waiters()  # (read-only: counts in the liveness file, no lock)
            e.shut_down(wake=not inherited)  # our client row, the liveness byte; this handle's sleepers wake
        e.release()  # every view this handle holds dropped, the descriptors closed: unmapped now
        if remove:
            remove_then_forget(self.name, e.identity)
        self._close_done = True

    def unlink(self) -> None:
        """Remove the store (segments, lock and liveness files) now, if its name still holds the
        store this handle attached to (same store identity; a newer store of that name is left
        alone), and close this handle if it is open. Other attached processes keep their mappings.

        Works on a closed handle too, as with ``multiprocessing.shared_memory``: ``store.close();
        store.unlink()`` removes a created, attached or persistent store (once; then it does nothing).
        """
        self._close(remove=False)
        remove_then_forget(self.name, self._engine.identity)

    def transaction(self) -> AbstractContextManager[None]:
        """Hold the store lock across several structural operations (a context manager).

        It enters through the journal's one way into the lock, so it first rolls back
        what a process that died holding the lock left half done (``shmkv verify
        --repair`` is this). It is not itself atomic: each structural operation inside
        is its own journaled transaction (all or nothing: rolled back on an exception of
        any kind, or by the next lock holder after a crash), and an exception in the
        block does not undo the operations that completed before it. Other processes'
        structural operations wait meanwhile: keep it short.

        Example:
            >>> with store.transaction():          # doctest: +SKIP
            ...     store.copy_prefix(a, b, 16)
            ...     store.sequence(b, write=True).truncate(8)
        """
        return self._engine.locked()

    def clients(self) -> list[int]:
        """Pids of the live read-write attachments of the store (one per attachment).

        Alive means holding its byte of the liveness file, whatever the PID namespace; the pids
        are for display: each is the pid in its process's own namespace."""
        return _records.live_clients(self._engine)

    # -- sequences -------------------------------------------------------------

    def create_sequence(self, capacity: int = DEFAULT_CAPACITY, *, prefix: Any = None, tier: Any = None,
                        _protect: int = -1) -> Sequence:
        """Create a sequence with room for ``capacity`` tokens; return its write handle.

        The pages of its range are reserved now, so a full /dev/shm raises
        CacheFullError here rather than SIGBUS later. When the store is full,
        finished sequences (``seq.finish()``) are evicted, least recently used first.

        Args:
            capacity: token cells to reserve (the sequence grows past them when it must).
            prefix: the prompt's token ids. The new sequence starts with the longest prefix
                of it that any sequence of the store holds from position 0 (copied in, at most
                ``len(prefix) - 1`` tokens, so at least one token is left to compute):
                ``len(seq)`` says how many. Counted in ``stats()`` as a hit or a miss.
            tier: a :class:`shmkv.remote.RemoteTier`: after the local match, whole chunks
                of the prompt that the tier holds continue it (checked, then appended and
                committed: from then on they are in this store's prefix cache too). A tier
                that is down or slow gives a ``RuntimeWarning`` and the local match alone.

        Example:
            >>> seq = store.create_sequence(capacity=1024, prefix=prompt)   # doctest: +SKIP
            >>> n = len(seq)                                              # doctest: +SKIP
            >>> seq.extend(k_all[:, n:], v_all[:, n:], tokens=prompt[n:])  # doctest: +SKIP
        """
        return _handles.create_sequence(self, self._engine, capacity, prefix=prefix, tier=tier, protect=_protect)

    def match_prefix(self, tokens: Any) -> int:
        """Tokens of ``tokens`` that ``create_sequence(prefix=tokens)`` would reuse now.

        No side effect: no counter, no recency, no lock; works on a read-only attachment.

        Example:
            >>> store.match_prefix(prompt)   # doctest: +SKIP
            299
        """
        e = self._engine
        e.check_open()
        return e.index.match(_handles.prompt(tokens))[0]

    def sequence(self, seq_id: int, write: bool = False) -> Sequence:
        """A handle on sequence ``seq_id``; ``write=True`` takes its write lease.

        Raises:
            SequenceNotFound: no live sequence has that id.
            LeaseError: ``write=True`` and a live process (or another handle here) holds the lease.
        """
        e = self._engine
        if write:
            return _handles.take_lease(self, e, seq_id)
        e.check_open()  # a read handle: made here, with no call layer (store.sequence(id) is hot)
        slot = e.slot_of(seq_id)  # (first: it names a bad id)
        return Sequence(self, e, int(seq_id), slot, write=False, token=0)

    def forward(self, seq_ids: Any, positions: Any, tokens: Any = None) -> Batch:
        """Start a batch forward: one entry of ``seq_ids``/``positions`` per new token.

        Uses this process's write handles on those sequences, or takes their leases
        until commit. See :class:`shmkv.Batch`.

        Example:
            >>> with store.forward([a, a, b], [7, 8, 3]) as batch:       # doctest: +SKIP
            ...     for layer in range(layers):
            ...         K, V, mask = batch.put(layer, k[layer], v[layer])
            ...     batch.commit()
        """
        e = self._engine
        e.check_writable()
        return Batch(self, seq_ids, positions, tokens)

    def sequences(self) -> list[SequenceInfo]:
        """The live sequences, in id order."""
        return _records.sequence_infos(self._engine)

    def copy_prefix(self, src_id: int, dst_id: int, n: int) -> None:
        """Replace sequence ``dst_id``'s content with the first ``n`` tokens of ``src_id``.

        Sliding/chunked layers of dst hold every token of the first ``n`` that src's hold.

        dst grows (or moves) if its capacity is below n. dst must not be leased by
        another live process; a write handle of this process on dst sees the new
        content (its uncommitted tokens are dropped).
        """
        _handles.copy_prefix(self._engine, src_id, dst_id, n)

    def lease(self, seq_ids: Iterable[int]) -> list[Sequence]:
        """Write handles on every sequence of ``seq_ids``, in that order: all leases, or none
        (the first failure's ``LeaseError`` / ``SequenceNotFound``; the leases taken are given back)."""
        return _group.lease(self, seq_ids)

    def regather(self, seqs: list[Sequence], rows: Iterable[int]) -> list[Sequence]:
        """Reorder, repeat and drop the rows of a batch: returns write handles whose row ``i`` holds
        what ``seqs[rows[i]]`` holds (committed K/V of every layer, token ids, positions, encoder).

        A row's first use keeps its handle (and meta); repeats are copied into sequences no row
        keeps (no allocation), or forked when there are none (a repeat's meta is ``{}``, as a
        fork's); sequences no row keeps are freed. ``seqs``: this store object's write handles,
        each once, nothing pending. A ``CacheFullError`` (no room for a fork) changes nothing.
        """
        return _group.regather(self, seqs, rows)

    def create_sequences(self, n: int, capacity: int = DEFAULT_CAPACITY, *,
                         prefix: Iterable[Any] | None = None) -> list[Sequence]:
        """``n`` new sequences (write handles) of ``capacity`` each: every one, or none (on any
        error the ones made are freed and the error propagates). ``prefix``: one prompt per
        sequence, as ``create_sequence(prefix=)`` takes it (a reused prefix longer than ``capacity``
        enlarges its range). Made under one hold of the store lock, first fit: when the first free
        range that fits ``capacity`` holds all ``n`` (no eviction needed), their ranges are adjacent
        and equally spaced, which ``batch_kv`` reads zero-copy."""
        return _group.create_sequences(self, n, capacity, prefix)

    def batch_kv(self, seqs: Iterable[Sequence], layer: int, *, pending: bool = False,
                 writable: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of ``layer`` for several sequences of equal length, ``[B, T, kv_heads,
        head_dim]``. Zero-copy, one strided view of the shared cells, when the rows' cells are
        equally spaced in the order given (checked each call; e.g. ``create_sequences``' rows on
        full layers) and stored as read (plain floats; bfloat16 as ml_dtypes views); otherwise,
        and for int8, a gathered copy. ``pending``: this process's handles' pending tokens too
        (what ``append`` returned). Views are read-only unless ``writable`` (write handles only):
        writing into a view writes the shared cache, writing into a gathered copy writes only the
        copy (``np.shares_memory`` tells which). Content holds as for ``seq.keys``."""
        return _group.batch_kv(self, seqs, layer, pending, writable)

    # -- snapshots ---------------------------------------------------------------

    def save(self, path: Any, seq_ids: list[int] | None = None, *,
             progress: Callable[[int, int], None] | None = None) -> int:
        """Write a msgpack snapshot of the store (or of ``seq_ids``) to a path or binary file.

        Decode workers keep appending while it runs; each sequence is saved at
        its committed length. A path is replaced atomically. Returns bytes written.

        Example:
            >>> store.save("/tmp/cache.shmkv")       # doctest: +SKIP
        """
        return _save.save(self._engine, path, seq_ids, progress)

    def restore(self, path: Any, seq_ids: list[int] | None = None, *,
                progress: Callable[[int, int], None] | None = None) -> list[int]:
        """Restore sequences from a snapshot (path or binary file), all or nothing; return their ids.

        Raises:
            SnapshotError: the file is damaged or not a snapshot (the store is unchanged).
            LayoutMismatchError: the snapshot's geometry differs from the store's.
            CacheFullError: the store has no room (the store is unchanged).
        """
        return _restore.restore(self._engine, path, seq_ids, progress)

    # -- reading ---------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Occupancy: sequences, tokens, free cells and bytes."""
        return _records.store_stats(self._engine, self.bytes_per_token)


def engine_of(store: Store) -> Engine:
    """``store``'s engine: for the lifecycle functions (create registers its client), ``shmkv verify``
    (the raw header and table) and the pytest plugin (the store's identity)."""
    return store._engine


# -- module-level lifecycle ----------------------------------------------------


def _lock_open_error(name: str, e: OSError) -> ShmkvError:
    """The error for a store lock file that cannot be opened (attach), naming the fix."""
    path = _segment.lock_path(name)
    why = f"{os.strerror(e.errno or 0)}; {_segment._owner(path)}"
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return CacheFullError(f"store {name!r}: cannot open its lock file {path} ({why}): close stores you no "
                              "longer use, or raise the limit (`ulimit -n`)")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a missing lock file that /dev/shm has no inode for
        return _segment.shm_full(os.path.basename(path), e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.ELOOP):
        return AccessDeniedError(
            f"store {name!r}: cannot open its lock file {path} ({why}): it must be a regular file that the "
            "store's users may open (create(..., mode=0o660) and a common group); remove a stray one as its "
            "owner, or use another store name"
        )
    return CorruptStoreError(f"store {name!r}: cannot open its lock file {path} ({why}): remove the store "
                             f"(`shmkv rm {name}`) and create it anew")


# Headers this process found intact (a forked child inherits them): what read() decides from (the
# words it checks, the layer kinds and the segment's size: ``unattached.read_key``) -> what it
# returned. A header equal to one is decoded and checked already.
# At most READ_KEPT headers are kept: a process sees a few stores; one that sees more forgets them
# all and decodes each again (one read(), tens of microseconds), rather than holding every header.
_READ: dict[bytes, tuple[Layout, int]] = {}
READ_KEPT = 64


def read_header_once(words: np.ndarray | None, raw: np.ndarray, size: int, name: str) -> tuple[Layout, int]:
    """``header.read``, once for each header this process sees (the creator's, or an attach's)."""
    if words is None:  # (too short: read() says so)
        return _header.read(np.zeros(64, np.int64), raw, size, name)
    key = _unattached.read_key(words, raw, size)
    got = _READ.get(key)
    if got is None:
        got = _header.read(words, raw, size, name)
        if len(_READ) >= READ_KEPT:
            _READ.clear()
        _READ[key] = got
    return got


@_interrupts.shielding(undo=lambda store: store.close())
def attach(name: str, readonly: bool = False, *, timeout: float = 5.0,
           lock_timeout: float = _lock.DEFAULT_TIMEOUT) -> Store:
    """Attach to the existing store ``name``.

    ``readonly=True`` maps the segments read-only: views are not writeable and
    any write through the mapping faults. A read-only attachment is not listed
    as a client (it cannot write the client table) and holds no leases.

    What an attach does, each once (about 30 syscalls; no data is read):

    1. opens and maps the header segment, waits (``timeout``) for a creator's magic word,
       checks the header (version, layout, checksum) and computes the layout's offsets;
    2. opens and maps the data segment and checks its size;
    3. opens the store lock's file (stat-ing the header for a mode only when it must create
       it), installs the deferred Ctrl-C handler (main thread), opens the liveness file, maps
       the read-only waiter counts (a second descriptor on purpose: a mapping keeps one, which
       must never carry the liveness byte's lock into a fork), builds the header's views and
       the journal (the data views and other parts: at their first use, ``Engine.__getattr__``);
    4. read-write only, the engine's ``join()`` (the one place that says it), in one hold of
       the store lock: the recovery check (a dead holder's transaction rolled back, odd
       generations repaired), the span sync (the shared prefix pages the table lists, mapped
       here), the client table's check, and the liveness registration (its byte of the
       liveness file, a key, its client row).

    A Ctrl-C in the steps that take a descriptor or a mapping is raised once the attach is
    done (and the handle it made closed): no descriptor is left open without an owner.

    Raises:
        StoreNotFound: no store of that name (the message says how to list them).
        CorruptStoreError: the segment is not an intact shmkv store.
        AccessDeniedError: the store belongs to another user and its mode keeps us out.
    """
    _segment.check_name(name)
    lock_timeout = check_timeout("lock_timeout", lock_timeout)
    timeout = check_timeout("timeout", timeout)
    try:
        hseg = Segment.open(_segment.header_name(name), readonly)
    except StoreNotFound:
        raise StoreNotFound(f"no store named {name!r} (shmkv.list_stores() or `shmkv ls` lists them)") from None
    opened: list[Segment] = []
    try:
        words = _unattached.fixed_words(hseg)
        deadline = time.monotonic() + timeout
        while words is not None and not _unattached.published(words) and time.monotonic() < deadline:
            _interrupts.deliver_deferred()  # (one noted as the header was opened: not after the wait)
            time.sleep(0.001)  # the creator writes the magic last
        raw = hseg.array(np.uint8)
        layout, max_clients = read_header_once(words, raw, hseg.size, name)
        assert words is not None  # (read() refused a short one)
        persistent = _unattached.persistent_of(words)
        data_bytes = _unattached.data_bytes_of(words)  # (read() checked it against the layout's offsets)
        del words, raw
        dseg = Segment.open(_segment.data_name(name), readonly)
        opened.append(dseg)
        if dseg.size < data_bytes:
            raise CorruptStoreError(
                f"store {name!r}: data segment is {dseg.size} bytes, the header needs {data_bytes}"
            )
    except StoreNotFound:
        hseg.close()
        raise StoreNotFound(
            f"no store named {name!r} (shmkv.list_stores() or `shmkv ls` lists them)"
        ) from None
    except BaseException:  # (Ctrl-C included: the data segment's descriptor too, if it was opened)
        for seg in (hseg, *opened):
            seg.close()
        raise
    try:
        store = Store(name, hseg, dseg, layout, max_clients, creator=False, persistent=persistent,
                      lock_timeout=lock_timeout)
    except BaseException as e:
        hseg.close()  # nothing leaks: both segments' descriptors (and mappings) go now
        dseg.close()
        if isinstance(e, OSError) and not isinstance(e, ShmkvError):
            raise _lock_open_error(name, e) from None
        raise
    if not readonly:
        try:
            store._engine.join()
        except BaseException:
            store.close()
            raise
    return store
