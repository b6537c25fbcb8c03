"""Liveness by kernel-released locks (docs/design.md §3): who is alive is a kernel fact.

Pids mean nothing across PID namespaces (containers that share /dev/shm: Docker
``--ipc=host``, Kubernetes pods) and get reused, so no liveness question here looks
at a pid. Each store has a liveness file beside its segments, ``skv_<name>.live``,
with one byte per client slot (the rows of the client table). A read-write
attachment holds an open-file-description byte-range lock (``F_OFD_SETLK``,
independent of the store's flock) on the byte of its slot; the kernel drops it
when the last descriptor of that description closes, so when its process exits
or is killed, in whatever namespace. Hence:

* a slot's holder is alive exactly while its byte is locked;
* whoever can take a slot's byte knows its previous holder is dead (that is how
  a new attachment picks a slot: the first byte it can take);
* asking costs one ``F_OFD_GETLK`` (about a microsecond, and no write access:
  a read-only attachment, ``shmkv ls`` and gc ask through a read-only descriptor).

A registration is named by a *client key*: ``random << 20 | slot``, written into
the client row (``C_KEY``), into every lease the attachment takes
(``LEASE_CLIENT``) and, for the creator, into the header (``W_CREATOR_CLIENT``).
A key is alive iff its slot's row still holds it and the slot's byte is locked:
a later holder of the slot writes its own key, so the slot's reuse never revives
an old key. (Between a new holder taking the byte and writing its key the old key
reads as alive: the safe direction, nothing is taken from a live process.)

Fork: an OFD lock lives while any descriptor of its description is open, so a
forked child closes the inherited descriptor at once (``register_at_fork``: the
parent keeps its lock, and a dead parent is not kept alive by its children; only in the
moment between the fork and the child's at-fork hooks does the child share it). A
child that writes through an inherited handle registers a slot of its own first
(``Engine.client_key``).

Read-only attachments register nothing: they cannot write the client table (it
is mapped read-only), hold no leases and keep no store alive. They open the
liveness file read-only and only ask. The file has the segments' mode, so anyone
who may map the header may open it; a read-write attachment needs write access
(an OFD write lock needs a descriptor opened for writing, the segments need it too).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import weakref

from shmkv._engine.locking.interrupts import critical, shielding
from shmkv._engine.memory import segment as _segment
from shmkv.errors import AccessDeniedError, CacheFullError, CorruptStoreError, StoreClosedError, StoreNotFound

LIVE_SUFFIX = ".live"
SLOT_BITS = 20  # max_clients is at most 1 << 20
SLOT_MASK = (1 << SLOT_BITS) - 1

# Linux's F_OFD_* (Python has them since 3.9 on Linux; the values are the kernel's)
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
# struct flock on 64-bit Linux: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid, padded to 32 bytes (l_pid must be 0 for OFD locks)
_FLOCK = struct.Struct("hhqqi4x")

# keys registered by this process's open attachments -> None (cleared in a forked child)
own_keys: set[int] = set()
# keys of the stores this process created (the pytest plugin's "created by the test")
created_keys: set[int] = set()
_open: weakref.WeakSet[Liveness] = weakref.WeakSet()

# Liveness holds between processes of different PID namespaces (containers that share one
# /dev/shm): the kernel's lock is the fact, not a pid. shmkv doctor reports it;
# tests/test_doctor.py::test_cross_namespace_liveness_is_what_doctor_says checks it against a
# lease holder in a second PID namespace.
CROSS_NAMESPACE_LIVENESS = True


def live_path(name: str) -> str:
    """The liveness file of store ``name``."""
    return f"{_segment.SHM_DIR}/{_segment.PREFIX}{name}{LIVE_SUFFIX}"


def new_key(slot: int) -> int:
    # 62 - SLOT_BITS random bits from os.urandom (what secrets.randbits reads), plus one: never 0
    return ((int.from_bytes(os.urandom(6), "little") >> (48 - 62 + SLOT_BITS)) + 1) << SLOT_BITS | slot


def slot_of(key: int) -> int:
    return key & SLOT_MASK


def _lock_cmd(fd: int, cmd: int, kind: int, byte: int) -> int:
    """One fcntl on byte ``byte``; returns the l_type the kernel handed back."""
    out = fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
    return int(_FLOCK.unpack(out)[0])


def byte_held(fd: int, slot: int) -> bool:
    """Whether some open file description other than ``fd``'s holds byte ``slot`` (F_OFD_GETLK)."""
    return _lock_cmd(fd, _F_OFD_GETLK, fcntl.F_WRLCK, slot) != fcntl.F_UNLCK


def try_take(fd: int, slot: int) -> bool:
    """Lock byte ``slot`` through ``fd`` if no one holds it; False if someone alive does."""
    try:
        _lock_cmd(fd, _F_OFD_SETLK, fcntl.F_WRLCK, slot)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


@critical  # (a Ctrl-C as the file is opened, before the caller keeps the descriptor, waits)
def _open_file(name: str, readonly: bool, mode: int | None = None) -> int:
    path = live_path(name)
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC | os.O_NOFOLLOW
    if mode is not None:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, 0o600 if mode is None else mode)
    except FileNotFoundError:
        raise StoreNotFound(f"store {name!r} has no liveness file {path}: it was removed "
                            "(`shmkv ls` lists the stores)") from None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise CacheFullError(f"cannot open {path}: {os.strerror(e.errno)}: close stores you no longer use, "
                                 "or raise the limit (`ulimit -n`)") from None
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _segment.shm_full(os.path.basename(path), e) from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise AccessDeniedError(
                f"store {name!r}: cannot open its liveness file {path} {'read-only' if readonly else 'read-write'} "
                f"({os.strerror(e.errno)}; {_segment._owner(path)}): it has the segments' mode; ask the "
                "store's creator for access (create(..., mode=0o660) and a common group)"
            ) from None
        raise CorruptStoreError(f"store {name!r}: cannot open its liveness file {path} ({os.strerror(e.errno or 0)}): "
                                "remove the store (`shmkv rm`) and create it anew") from None
    if mode is not None:
        try:
            os.fchmod(fd, mode)  # the umask must not narrow a group store's file
        except OSError:
            pass
    return fd


class Liveness:
    """One attachment's descriptor of a store's liveness file, and the slot it holds (if any).

    ``register(rows)`` takes the first free byte; ``alive(key, rows)`` asks a key;
    ``close()`` releases the byte (closing the descriptor).

    ``alive`` runs without the store lock (``clients()``, ``sequences()``), so another thread's
    ``close()`` may race it: ``_guard`` keeps the descriptor open for the whole question (a closed
    number could be reused by another open file, whose answer would be a lie), and a question after
    close raises StoreClosedError."""

    __slots__ = ("__weakref__", "_guard", "closed", "fd", "key", "name", "pid", "readonly")

    @critical  # (a Ctrl-C as the file is opened, before the descriptor is kept, waits)
    def __init__(self, name: str, readonly: bool, *, mode: int | None = None) -> None:
        self.name, self.readonly = name, readonly
        self._guard = threading.Lock()
        self.closed = False
        self.fd = _open_file(name, readonly, mode)
        self.pid = os.getpid()
        self.key = 0  # 0: holds no slot
        _open.add(self)

    def take(self, slot: int) -> int:
        """Take byte ``slot`` (a fresh store's creator: nobody else can hold it); returns the key."""
        if not try_take(self.fd, slot):
            raise CorruptStoreError(f"store {self.name!r}: client slot {slot} is held already")
        return self._holding(slot)

    def register(self, max_clients: int) -> int:
        """Take the first slot whose byte is free (its former holder, if any, is dead); returns the key.

        The caller writes the client row: holding the byte makes the row this attachment's alone."""
        self.reopen_in_child()
        fd = self.fd
        for slot in range(max_clients):
            # a held byte is passed over as asked (F_OFD_GETLK: no OSError raised and caught a
            # live client); a free one is taken, or passed over if someone took it meanwhile
            if not byte_held(fd, slot) and try_take(fd, slot):
                return self._holding(slot)
        raise CacheFullError(
            f"store {self.name!r}: all {max_clients} client slots hold live processes; "
            "close unused attachments (or create the store with a larger max_clients=)"
        )

    def _holding(self, slot: int) -> int:
        self.key = new_key(slot)
        own_keys.add(self.key)
        return self.key

    @shielding()  # (a Ctrl-C as the file is opened, before the descriptor is kept: raised once kept)
    @critical
    def reopen_in_child(self) -> None:
        """In a forked child: a descriptor of our own (the inherited one was closed at fork)."""
        if self.pid != os.getpid():
            self.fd = _open_file(self.name, self.readonly)
            self.pid = os.getpid()
            self.key = 0

    def alive(self, key: int, row_key: int) -> bool:
        """Whether client key ``key`` is alive; ``row_key``: what its slot's client row holds now."""
        if key <= 0:
            return False
        if key in own_keys and self.pid == os.getpid():
            return True  # one of this process's attachments (its own byte is invisible to its own F_GETLK)
        if row_key != key:
            return False  # the slot was taken again: the key's holder is dead
        with self._guard:
            if self.closed:
                raise StoreClosedError(f"store {self.name!r} is closed: attach again with shmkv.attach({self.name!r})")
            if self.fd < 0 or self.pid != os.getpid():
                self.reopen_in_child()
            return byte_held(self.fd, slot_of(key))

    @critical  # (the descriptor forgotten and closed at once)
    def close(self) -> None:
        """Release the slot (closing the descriptor drops the lock)."""
        own_keys.discard(self.key)
        self.key = 0
        with self._guard:
            self.closed = True
            fd, self.fd = self.fd, -1
            if fd >= 0 and self.pid == os.getpid():
                os.close(fd)
        _open.discard(self)

    def __del__(self) -> None:
        # a handle whose construction was interrupted never reaches close(): its descriptor (and
        # the slot's byte, if it took one) must not stay open for good
        try:
            self.close()
        except Exception:
            pass


def _after_fork_in_child() -> None:
    own_keys.clear()
    created_keys.clear()
    for lv in list(_open):
        lv._guard = threading.Lock()  # (another thread of the parent may have held it at fork)
        # the parent's lock must die with the parent: drop our copy of its description
        if lv.fd >= 0:
            try:
                os.close(lv.fd)
            except OSError:
                pass
        lv.fd, lv.key = -1, 0


os.register_at_fork(after_in_child=_after_fork_in_child)


@critical  # (the descriptor opened for the question is closed whatever comes)
def alive_keys(name: str, keys: list[tuple[int, int]]) -> set[int] | None:
    """Which of ``keys`` (each with what its slot's row holds now) are alive, asked through a
    read-only descriptor of store ``name``'s liveness file opened for the question; None when
    the file cannot be opened (the answer is unknown)."""
    try:
        fd = _open_file(name, True)
    except (StoreNotFound, AccessDeniedError, CorruptStoreError, CacheFullError):
        return None
    try:
        return {k for k, row_key in keys if k > 0 and (k in own_keys or (row_key == k and byte_held(fd, slot_of(k))))}
    finally:
        os.close(fd)


def prepare(name: str, mode: int) -> Liveness:
    """A new store's liveness file (created, or a leftover of ours taken over) and the creator's
    attachment of it; the creator then takes slot 0 before the header's magic is published."""
    lv = Liveness(name, False, mode=mode)
    st = os.fstat(lv.fd)
    if st.st_uid != os.geteuid():
        lv.close()
        raise AccessDeniedError(
            f"store {name!r}: liveness file {live_path(name)} is not ours (uid {st.st_uid}, we are uid "
            f"{os.geteuid()}): whoever owns it could fake who is alive; remove it (as its owner or root), "
            "or choose another store name"
        )
    return lv
