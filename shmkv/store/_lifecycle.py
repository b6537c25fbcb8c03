"""The module-level lifecycle of stores: create, list, remove, gc, load.

The ``Store`` handle itself and ``attach`` (a store pickles as a call to it) are in
``_store``; what removes a store only while it is the one a handle knows (``read_identity``,
``remove_if_same``, the exit removals) in ``_removal``.
"""

from __future__ import annotations

import enum
import errno
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmkv._engine.table import header as _header
from shmkv._engine.clients import row_waiters as _row_waiters
from shmkv._engine.clients import liveness as _liveness
from shmkv._engine.locking import lock as _lock
from shmkv._engine.locking import lifecycle_lock as _lifecycle_lock
from shmkv._engine.locking.interrupts import critical, shielding
from shmkv._engine.memory import segment as _segment
from shmkv._engine.table import unattached as _unattached
from shmkv._snapshot import restore as _restore
from shmkv._snapshot import save as _save
from shmkv._engine.checks import check_timeout, count
from shmkv._engine.memory.segment import Segment
from shmkv.store._store import (
    DEFAULT_MAX_CLIENTS,
    Store,
    engine_of,
    read_header_once,
)
from shmkv.store._removal import remove_at_process_exit, remove_names
from shmkv.errors import AccessDeniedError, CorruptStoreError, InvalidArgumentError, StoreExistsError, StoreNotFound


def _check_mode(mode: object) -> int:
    if isinstance(mode, bool) or not isinstance(mode, (int, np.integer)) or not 0 <= mode <= 0o777 \
            or int(mode) & 0o600 != 0o600:
        raise InvalidArgumentError(
            f"mode={mode!r} must be permission bits up to 0o777 that let the owner read and write "
            "(0o600, the default; 0o660 to share with a group)"
        )
    return int(mode)


@critical  # (a Ctrl-C as the file is opened, before the descriptor is kept, waits)
def _prepare_lock_file(name: str, mode: int) -> None:
    """Create the store's lock file with the segments' mode (a group member who may write the
    store may take its lock), or take over a leftover of ours; refuse one that is not ours."""
    path = _segment.lock_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:  # another user's file (EACCES), a symlink (ELOOP), ...
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT):
            raise _segment.os_error(e, os.path.basename(path)) from None
        raise AccessDeniedError(
            f"store {name!r}: cannot open lock file {path} ({os.strerror(e.errno or 0)}; {_segment._owner(path)}): "
            "remove it (as its owner or root), or choose another store name"
        ) from None
    try:
        _refuse_foreign_lock(name, path, os.fstat(fd))
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _check_lock_owner(name: str) -> None:
    """Refuse early (before any segment exists) a lock file that another user left at our path."""
    path = _segment.lock_path(name)
    try:
        _refuse_foreign_lock(name, path, os.lstat(path))
    except FileNotFoundError:
        return


def _refuse_foreign_lock(name: str, path: str, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
        raise AccessDeniedError(
            f"store {name!r}: lock file {path} is not ours (uid {st.st_uid}, we are uid {os.geteuid()}): "
            "whoever owns it could block or fake the store lock; remove it (as its owner or root), "
            "or choose another store name"
        )


SESSION_ENV = "SHMKV_PYTEST_SESSION"  # set by the pytest plugin for the processes of a test session


def session_tag() -> int:
    """The pytest plugin's session tag from the environment (0 outside a plugin-run test session);
    stored in the header of every store created, so the plugin's leak check judges only its own."""
    tag = os.environ.get(SESSION_ENV)
    if not tag:
        return 0
    try:
        return int(tag, 16) & ((1 << 62) - 1)
    except ValueError:
        return 0


_loading = threading.local()  # kept: the list a load in this thread keeps its new store in (load)


def create(name: str, *, layers: int, kv_heads: int, head_dim: int, dtype: Any = "float16",
           max_tokens: int = 65536, max_seqs: int = 64, layer_types: list[str] | None = None,
           window: int | None = None, chunk: int | None = None, memory: int | None = None,
           persistent: bool = False, mode: int = 0o600, max_clients: int = DEFAULT_MAX_CLIENTS,
           lock_timeout: float = _lock.DEFAULT_TIMEOUT) -> Store:
    """Create the store ``name`` and return a read-write handle on it.

    Args:
        name: 1-24 characters of ``[A-Za-z0-9_-]``.
        layers, kv_heads, head_dim: the geometry of K and V per token.
        dtype: storage dtype: "float32", "float16", "bfloat16" (zero-copy views with ml_dtypes),
            "float64", or "int8" (one absmax float32 scale per token and head, dequantized on read).
        max_tokens: token cells the sequences may take in all (their capacities), whatever the alignment.
        max_seqs: rows of the sequence table.
        persistent: keep the store after this process closes or exits
            (until ``shmkv.remove(name)``); by default the creator removes it.
        mode: permission bits of the segments and the lock file (0o600; 0o660 to share with a group).
        lock_timeout: seconds to wait for the store lock (>= 0).

    Raises:
        StoreExistsError: a store of that name exists.
        InvalidArgumentError: a bad name or layout value (the message names it).
        AccessDeniedError: the store's lock file exists and belongs to another user.
        CacheFullError: the segments cannot be mapped (too large for memory, or out of descriptors).

    Example:
        >>> store = shmkv.create("demo", layers=4, kv_heads=2, head_dim=8)  # doctest: +SKIP
    """
    # the name and mode are checked before they name or make the lifecycle lock file
    _segment.check_name(name)
    if not isinstance(persistent, (bool, np.bool_)):
        raise InvalidArgumentError(f"persistent={persistent!r} must be True or False")
    return _create(name, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, max_tokens=max_tokens,
                   max_seqs=max_seqs, layer_types=layer_types, window=window, chunk=chunk, memory=memory,
                   persistent=bool(persistent), mode=_check_mode(mode), max_clients=max_clients,
                   lock_timeout=lock_timeout)


def _undo_create(store: Store) -> None:
    store.unlink()


@_lifecycle_lock.lifecycle_op(undo=_undo_create)  # a Ctrl-C raised as the lock is given up: the caller has no store
def _create(name: str, *, layers: int, kv_heads: int, head_dim: int, dtype: Any, max_tokens: int, max_seqs: int,
            layer_types: list[str] | None, window: int | None, chunk: int | None, memory: int | None,
            persistent: bool, mode: int, max_clients: int, lock_timeout: float) -> Store:
    """create() under the name's lifecycle lock (name and mode checked)."""
    layout = _header.make_layout(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                 max_tokens=max_tokens, max_seqs=max_seqs, layer_types=layer_types,
                                 window=window, chunk=chunk, memory=memory)
    max_clients = count("max_clients", max_clients, minimum=1)
    if max_clients > 1 << 20:
        raise InvalidArgumentError(f"max_clients={max_clients} must be at most {1 << 20}")
    lock_timeout = check_timeout("lock_timeout", lock_timeout)
    off = _header.offsets(layout, max_clients)
    if off.data_bytes > _header.MAX_STORE_BYTES:
        raise InvalidArgumentError(
            f"store {name!r} would need {off.data_bytes} bytes of shared memory (layers={layout.layers} x "
            f"max_tokens={layout.max_tokens} x kv_heads={layout.kv_heads} x head_dim={layout.head_dim} x "
            f"{layout.dtype}, K and V), more than shmkv maps ({_header.MAX_STORE_BYTES}): "
            "lower max_tokens= or the layout"
        )
    _check_lock_owner(name)
    exists = (f"a store named {name!r} exists already: attach to it with shmkv.attach({name!r}), or remove it "
              f"(shmkv.remove({name!r}) or `shmkv rm {name}`) first")
    try:
        hseg = Segment.create(_segment.header_name(name), off.header_bytes, mode)
    except StoreExistsError:  # (its message names the segment, not the store)
        raise StoreExistsError(exists) from None
    try:
        try:
            dseg = Segment.create(_segment.data_name(name), off.data_bytes, mode)
        except BaseException as e:
            hseg.unlink()
            if isinstance(e, StoreExistsError):
                raise StoreExistsError(exists) from None
            raise
        live = None
        try:
            _prepare_lock_file(name, mode)
            # the creator holds slot 0 before the magic is published: no attacher can take it first
            live = _liveness.prepare(name, mode)
            _row_waiters.prepare(live.fd, layout.max_seqs)  # read-only waiters' counts (zeroed)
            creator_key = live.take(0)
            hseg.reserve([(0, off.header_bytes)])
            words = _unattached.fixed_words(hseg)
            assert words is not None  # (the segment holds the whole header)
            raw = hseg.array(np.uint8)
            _header.write(words, raw, layout, off, max_clients=max_clients, creator_pid=os.getpid(),
                          creator_client=creator_key, persistent=persistent,
                          identity=secrets.randbits(62) + 1, session=session_tag())
            read_header_once(words, raw, hseg.size, name)  # (checked as written; workers forked from here know it)
            del words, raw
            store = Store(name, hseg, dseg, layout, max_clients, creator=True, persistent=persistent,
                          lock_timeout=lock_timeout, live=live)
            engine_of(store).join()
            _liveness.created_keys.add(creator_key)
            if not persistent:
                remove_at_process_exit(name, engine_of(store).identity)
            if (kept := getattr(_loading, "kept", None)) is not None:  # a load's: kept before it is returned
                _loading.kept = None  # (its first create only: not one its progress callback might make)
                kept.append(store)
        except BaseException:
            hseg.unlink()
            dseg.unlink()
            dseg.close()
            if live is not None:
                live.close()
            for path in (_liveness.live_path(name), _segment.lock_path(name)):
                try:
                    os.unlink(path)  # no segment is left for them to serve (nor a handle: none was returned)
                except OSError:
                    pass
            raise
    except BaseException:
        hseg.close()
        raise
    return store


def list_stores() -> list[str]:
    """Names of the stores in /dev/shm (Linux; empty where shm cannot be listed)."""
    pre, suf = _segment.PREFIX, ".h"
    return [f[len(pre) : -len(suf)] for f in _segment.listdir() if f.startswith(pre) and f.endswith(suf)]


def remove(name: str) -> None:
    """Remove store ``name`` (segments and lock file). Attached processes keep their mappings.

    Raises:
        StoreNotFound: nothing of that name existed.
    """
    _segment.check_name(name)
    if not remove_names(name):
        raise StoreNotFound(f"no store named {name!r} to remove (`shmkv ls` lists them)")


def _ours(entry: str) -> bool:
    """Whether /dev/shm entry ``entry`` exists and belongs to our effective uid."""
    try:
        return os.lstat(_segment.shm_path(entry)).st_uid == os.geteuid()
    except OSError:
        return False


@dataclass(frozen=True)
class Owners:
    """Who keeps a store alive: its creator and its read-write clients, as (pid, client key),
    and which keys were alive (holding their byte of the liveness file, see liveness) when read.
    Pids are for display: each is the pid in its process's own PID namespace."""

    creator: tuple[int, int]
    clients: list[tuple[int, int]]
    persistent: bool
    alive: frozenset[int] | None  # None: the liveness file could not be asked (counted as alive)

    def _is_alive(self, key: int) -> bool:
        return self.alive is None or key in self.alive

    def creator_alive(self) -> bool:
        return self._is_alive(self.creator[1])

    def live_clients(self) -> list[int]:
        return sorted({pid for pid, key in self.clients if self._is_alive(key)})

    def collectable(self, include_persistent: bool) -> bool:
        """gc's rule: nobody alive keeps it, and it is not persistent (unless asked)."""
        if self.persistent and not include_persistent:
            return False
        return not self.creator_alive() and not self.live_clients()


class Unjudged(enum.Enum):
    """Why a store's owners could not be read."""

    UNREADABLE = "no readable, intact shmkv header"  # a creation that crashed half-way, or not a store
    OTHER_VERSION = "another shmkv version's store"  # its tables are not ours to read: never judged


@shielding()  # (a Ctrl-C as the header or the liveness file is opened or closed: raised once closed)
def store_owners(name: str) -> Owners | Unjudged:
    """The owners of store ``name``, from one read of its header."""
    try:
        hseg = Segment.open(_segment.header_name(name), readonly=True)
    except (StoreNotFound, AccessDeniedError):
        return Unjudged.UNREADABLE
    try:
        return _owners_in(hseg, name)
    finally:
        hseg.close()


def _owners_in(hseg: Segment, name: str) -> Owners | Unjudged:
    words = _unattached.fixed_words(hseg)
    if words is None:
        return Unjudged.UNREADABLE
    if _unattached.other_version(words):
        return Unjudged.OTHER_VERSION
    try:
        layout, max_clients = _header.read(words, hseg.array(np.uint8), hseg.size, name)
    except CorruptStoreError:
        return Unjudged.UNREADABLE
    off = _header.offsets(layout, max_clients)
    rows = _unattached.clients_of(hseg, off, max_clients)
    row_keys = [key for _, key in rows]
    creator = _unattached.creator_of(words)
    clients = [(pid, key) for pid, key in rows if pid]

    def held(key: int) -> tuple[int, int]:
        slot = _liveness.slot_of(key)
        return key, (row_keys[slot] if key > 0 and slot < max_clients else 0)

    alive = _liveness.alive_keys(name, [held(creator[1]), *(held(k) for _, k in clients)])
    return Owners(creator=creator, clients=clients, persistent=_unattached.persistent_of(words),
                  alive=None if alive is None else frozenset(alive))
    # (the arrays over the mapping die with this frame, before the caller closes it)


def _collect(name: str, include_persistent: bool, grace: float) -> bool:
    """gc's judgement of one store: remove it if it is ours and dead; True if removed.

    Another user's store is skipped (never read, never removed, never an error).
    """
    if not _ours(_segment.header_name(name)):
        return False
    owners = store_owners(name)
    if owners is Unjudged.UNREADABLE:
        mtime = _segment.segment_mtime(_segment.header_name(name))
        if mtime is not None and time.time() - mtime > grace:
            remove_names(name)
            return True
        return False
    if isinstance(owners, Owners) and owners.collectable(include_persistent):
        remove_names(name)
        return True
    return False


def gc(*, include_persistent: bool = False, grace: float = 30.0, snapshot_dirs: Any = ()) -> list[str]:
    """Remove stores whose creator and read-write clients are all dead; return their names.

    Persistent stores are kept unless ``include_persistent=True``. Segments that
    are not intact stores (a creation that crashed half-way) are removed once
    they are older than ``grace`` seconds, as are lock files with no store.
    Other users' stores are skipped. ``snapshot_dirs``: directories in which to
    remove the temporary files of snapshot saves whose writer died.
    """
    removed = []
    names = set(list_stores())
    for name in sorted(names):
        with _lifecycle_lock.lifecycle(name):  # no create or remove of this name between the check and the removal
            try:
                if _collect(name, include_persistent, grace):
                    removed.append(name)
            except AccessDeniedError:
                continue  # changed owner meanwhile: not ours to judge
    pre = _segment.PREFIX
    for f in _segment.listdir():  # data segments and lock files whose header is gone
        for suf in (".d", ".lock", _liveness.LIVE_SUFFIX, _lifecycle_lock.LIFECYCLE_SUFFIX):
            if f.startswith(pre) and f.endswith(suf) and f[len(pre) : -len(suf)] not in names and _ours(f):
                mtime = _segment.segment_mtime(f)
                if mtime is not None and time.time() - mtime > grace:
                    _lifecycle_lock.remove_orphan(f[len(pre) : -len(suf)], os.path.join(_segment.SHM_DIR, f))
    if snapshot_dirs:
        for directory in [snapshot_dirs] if isinstance(snapshot_dirs, (str, os.PathLike)) else snapshot_dirs:
            _save.remove_stale_temps(os.fspath(directory))
    return removed


def load(source: Any, name: str | None = None, *, persistent: bool = False, max_tokens: int | None = None,
         max_seqs: int | None = None, progress: Callable[[int, int], None] | None = None, **create_kw: Any) -> Store:
    """Create store ``name`` with a snapshot's layout and restore the whole snapshot into it.

    Every sequence keeps its id, length, capacity, token ids and positions; finished ones stay
    finished. ``max_tokens``/``max_seqs`` default to at least the snapshot's. Like any store this
    process creates, the new store is removed when it is closed or the process exits, unless
    ``persistent=True`` (the ``shmkv load`` command passes it: its store stays until ``shmkv rm``).
    ``name`` is required: the new store's name (a snapshot does not choose one; leaving it out
    raises InvalidArgumentError). ``source`` is a snapshot file's path or a binary file object.

    Example:
        >>> store = shmkv.load("/tmp/cache.shmkv", "restored")   # doctest: +SKIP
    """
    if name is None:
        raise InvalidArgumentError(f"shmkv.load({source!r}) needs the new store's name: shmkv.load(path, name), "
                                   "e.g. shmkv.load(path, 'restored')")
    # The store is kept here as the create makes it, not when a call returns it: CPython raises a
    # Ctrl-C as a call through C returns, before the caller holds what it returned.
    kept: list[Store] = []
    try:
        _loading.kept = kept
        return _restore.load_with(create, engine_of, source, name, persistent=persistent, max_tokens=max_tokens,
                                   max_seqs=max_seqs, progress=progress, **create_kw)
    except BaseException:
        for store in kept:
            store.unlink()
        raise
    finally:
        _loading.kept = None
