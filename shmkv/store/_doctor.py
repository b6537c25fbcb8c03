"""``shmkv.doctor()`` and ``shmkv doctor``: will shmkv work here, and how big can a store be?

Everything here is read from the machine without creating a store: /dev/shm's
size and free space (``os.statvfs``), ``vm.max_map_count`` and this process's
mappings (``/proc``), the architecture, the Python and numpy versions, which
optional extras are installed (``importlib.util.find_spec``: nothing is imported,
so torch's seconds of import are not paid), and this process's PID namespace.

``room(need, what)`` is the check ``shmkv demo`` and ``tools/bench.py`` make before
they start: the message names what is needed, what there is and how to get it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmkv._engine.table import dtypes as _dtypes
from shmkv._engine.clients import liveness as _liveness
from shmkv._engine.memory import segment as _segment
from shmkv.errors import CacheFullError, InvalidArgumentError

__all__ = ["Doctor", "doctor", "room", "shm_space"]

MiB = 1 << 20

# The layout the largest-store figure is given for unless the caller names one:
# Llama-3-8B's (32 layers, 8 KV heads of 128, bfloat16: 128 KiB a token).
DEFAULT_LAYOUT: dict[str, Any] = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}

# Each attached store maps its two segments (header and data) and its read-only waiters'
# counts (the liveness file's content, _engine/clients/row_waiters.py): checked by
# tests/test_doctor.py::test_maps_per_store.
MAPS_PER_STORE = 3

# Below this much free /dev/shm no store is worth making (a small store's header
# and a few sequences): doctor reports it as a problem.
MIN_FREE = 4 * MiB

# The PID namespace every Linux machine starts with (PROC_PID_INIT_INO).
INITIAL_PID_NS = 0xEFFFFFFC

# Optional extras: the module to look for, and the pip line that adds it.
EXTRAS: dict[str, str] = {
    "torch": "pip install torch  # first, the build you want (CPU: --index-url https://download.pytorch.org/whl/cpu)",
    "transformers": "pip install torch && pip install 'shmkv[transformers]'",
    "ml_dtypes": "pip install 'shmkv[bf16]'",
    "redis": "pip install 'shmkv[redis]'",
    "isal": "pip install 'shmkv[fast]'",
    "numba": "pip install 'shmkv[fast]'",
}


@dataclass(frozen=True, slots=True)
class Extra:
    """An optional dependency: installed or not (``version`` None), and how to add it."""

    name: str
    version: str | None
    pip: str


@dataclass(frozen=True, slots=True)
class Doctor:
    """What ``shmkv.doctor()`` found. ``ok`` is False when ``problems`` (things that block
    use) is not empty; ``notes`` are worth knowing but block nothing.

    ``stores_mappable``: how many more stores this process could attach under
    ``vm.max_map_count`` (three mappings each) once its cache of stitched views (shared
    prefix pages, at most ``2 * CACHE_LIMIT`` = 16,384 mappings) is full.

    Sizes are bytes. ``tokens_fit`` is how many tokens of ``layout`` (K and V of every
    layer, int8 scales included) the free /dev/shm holds now: the largest store that
    fits (a store reserves memory only for the tokens it holds, so its ``max_tokens``
    may be larger; a sequence that finds no room gets ``CacheFullError``).
    """

    ok: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    system: str
    machine: str
    supported_platform: bool
    python: str
    numpy: str
    shmkv: str
    shm_path: str
    shm_fs: str | None
    shm_size: int
    shm_free: int
    shm_writable: bool
    layout: dict[str, Any]
    bytes_per_token: int
    tokens_fit: int
    max_map_count: int | None
    maps_in_use: int | None
    stores_mappable: int | None
    pid_namespace: str | None
    initial_pid_namespace: bool | None
    proc_matches_pid_namespace: bool | None
    cross_namespace_liveness: bool
    extras: tuple[Extra, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``shmkv doctor --json`` prints it)."""
        d = dataclasses.asdict(self)
        d["extras"] = {e.name: {"installed": e.version is not None, "version": e.version, "pip": e.pip}
                       for e in self.extras}
        d["problems"], d["notes"] = list(self.problems), list(self.notes)
        return d


def shm_space(path: str = _segment.SHM_DIR) -> tuple[int, int]:
    """(size, free) of the file system at ``path`` in bytes; (0, 0) if it does not exist."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0, 0
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n < 10 * 1024 * MiB else f"{n / (1024 * MiB):.1f} GiB"


def shm_size_flag(need: int) -> str:
    """A ``--shm-size`` value with room for ``need`` bytes: the next 256 MiB step (Docker's ``1g`` style)."""
    step = 256 * MiB if need <= 1024 * MiB else 1024 * MiB
    n = max(step, -(-need // step) * step)
    return f"{n // (1024 * MiB)}g" if n % (1024 * MiB) == 0 else f"{n // MiB}m"


def how_to_get(need: int) -> str:
    """How to give /dev/shm ``need`` bytes, in the places shmkv runs."""
    flag = shm_size_flag(need)
    return (f"in Docker `docker run --shm-size={flag} ...` (its default is 64 MiB), in Kubernetes an "
            f"emptyDir with medium: Memory and sizeLimit >= {flag} mounted at /dev/shm, on a host "
            f"`mount -o remount,size={flag} /dev/shm` (as root); see docs/containers.md")


def room(need: int, what: str, *, path: str = _segment.SHM_DIR) -> str | None:
    """None if /dev/shm has ``need`` bytes free now, else a message naming ``what`` needs them,
    what there is, and how to get more."""
    size, free = shm_space(path)
    if free >= need:
        return None
    return (f"{what} needs {_mib(need)} free in {path}; it has {_mib(free)} free of {_mib(size)}. "
            f"Free some (`shmkv ls`, `shmkv gc`) or give it more room: {how_to_get(need + size - free)}")


def check_room(need: int, what: str, *, path: str = _segment.SHM_DIR) -> None:
    """Raise ``CacheFullError`` with :func:`room`'s message when ``need`` bytes are not free."""
    msg = room(need, what, path=path)
    if msg is not None:
        raise CacheFullError(msg)


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes one token takes in a store of this layout: K and V of every layer (int8: and their scales)."""
    name = _dtypes.canonical(dtype)
    per = 2 * layers * kv_heads * head_dim * _dtypes.itemsize(name)
    if name == "int8":
        per += 2 * layers * kv_heads * 4  # one float32 scale per (token, head), K and V
    return per


def _fs_type(path: str) -> str | None:
    try:
        with open("/proc/mounts") as f:
            best: tuple[int, str | None] = (-1, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1]
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best[0]:
                        best = (len(mnt), parts[2])
            return best[1]
    except OSError:
        return None


def _int_file(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _maps_in_use() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _pid_ns() -> tuple[str | None, bool | None]:
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
        return link, int(link[link.index("[") + 1 : -1]) == INITIAL_PID_NS
    except (OSError, ValueError):
        return None, None


def _version() -> str:
    """shmkv's installed version (read from the package metadata: no import of ``shmkv``, whose
    ``__init__`` imports this module)."""
    import importlib.metadata  # here, not at the top: 15 ms that `import shmkv` need not pay

    try:
        return importlib.metadata.version("shmkv")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _proc_is_ours() -> bool | None:
    """Whether the /proc mounted here is of this process's PID namespace: its ``self`` link
    names our pid (a /proc of another namespace numbers us differently, or not at all).
    Needs no access to PID 1 (reading /proc/1/ns/pid is often denied in containers)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False if os.path.isdir("/proc") else None


def _extras() -> tuple[Extra, ...]:
    import importlib.metadata
    import importlib.util

    out = []
    for name, pip in EXTRAS.items():
        version = None
        try:
            if importlib.util.find_spec(name) is not None:
                try:
                    version = importlib.metadata.version(name)
                except importlib.metadata.PackageNotFoundError:
                    version = "unknown"
        except (ImportError, ValueError):
            pass
        out.append(Extra(name, version, pip))
    return tuple(out)


def doctor(*, layers: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
           dtype: str | None = None, tokens: int | None = None, path: str = _segment.SHM_DIR) -> Doctor:
    """Check whether shmkv works on this machine and how large a store fits.

    Args:
        layers, kv_heads, head_dim, dtype: the layout the largest store is given for
            (default: 32 layers, 8 KV heads of 128, bfloat16, as Llama-3-8B).
        tokens: when given, a problem unless that many tokens of the layout fit now.
        path: the shared-memory directory (``/dev/shm``).

    Returns:
        A frozen :class:`Doctor`; ``ok`` is False when something blocks use.

    Example::

        >>> import shmkv
        >>> d = shmkv.doctor(layers=4, kv_heads=2, head_dim=8, dtype="float16")
        >>> d.bytes_per_token
        256
    """
    layout = dict(DEFAULT_LAYOUT)
    for key, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{key}={value!r} must be a positive integer")
            layout[key] = value
    if dtype is not None:
        layout["dtype"] = _dtypes.canonical(dtype)
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise InvalidArgumentError(f"tokens={tokens!r} must be a positive integer")
    per = bytes_per_token(layout["layers"], layout["kv_heads"], layout["head_dim"], layout["dtype"])
    problems: list[str] = []
    notes: list[str] = []

    system, machine = os.uname().sysname, os.uname().machine
    supported = sys.platform == "linux" and machine in ("x86_64", "amd64", "AMD64")
    if sys.platform != "linux":
        problems.append(f"{system} is not supported: shmkv's stores live in /dev/shm on Linux")
    elif not supported:
        problems.append(f"{machine} is not supported: the lock-free hot path relies on x86-64's ordering of "
                        "stores (data before the length word); run on an x86-64 (amd64) Linux machine")

    size, free = shm_space(path)
    fs = _fs_type(path)
    writable = os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
    if size == 0:
        problems.append(f"{path} does not exist: mount a tmpfs there (`mount -t tmpfs tmpfs {path}`), or in a "
                        "container see docs/containers.md")
    elif not writable:
        problems.append(f"{path} is not writable by uid {os.geteuid()}: stores cannot be created (its mode is "
                        f"{os.stat(path).st_mode & 0o7777:#o}; it is normally 1777)")
    elif free < MIN_FREE:
        problems.append(f"{path} has {_mib(free)} free of {_mib(size)}: too little for any store; free some "
                        f"(`shmkv ls`, `shmkv gc`) or {how_to_get(size - free + 256 * MiB)}")
    if fs is not None and fs != "tmpfs" and size:
        notes.append(f"{path} is {fs}, not tmpfs: shared memory there may be slower or backed by disk")
    fit = max(0, free // per)
    if tokens is not None and size and tokens > fit:
        problems.append(f"{tokens} tokens of this layout need {_mib(tokens * per)} ({per} bytes a token); "
                        f"{path} has {_mib(free)} free: {how_to_get(tokens * per + size - free)}")
    if size and size <= 64 * MiB:
        notes.append(f"{path} is {_mib(size)} (Docker's default): `shmkv demo` fits; `shmkv bench` and real "
                     f"models need more (the bench says how much); {how_to_get(1024 * MiB)}")

    from shmkv._engine.spans import stitch as _stitch  # here: its ctypes set-up is not import shmkv's to pay

    limit = _int_file("/proc/sys/vm/max_map_count")
    in_use = _maps_in_use()
    stitched = 2 * _stitch.CACHE_LIMIT  # a process's cache of stitched views (shared prefix pages), at most
    mappable = None
    if limit is not None and in_use is not None:
        mappable = max(0, (limit - in_use - stitched) // MAPS_PER_STORE)
        if limit - in_use < stitched + 1024:
            notes.append(f"vm.max_map_count is {limit} and this process already has {in_use} mappings; a process's "
                         f"stitched views of shared prefix pages may take {stitched} more: raise it "
                         "(`sysctl -w vm.max_map_count=262144`) or a process may fail to map views or stores")

    ns, initial = _pid_ns()
    proc_ours = _proc_is_ours()
    cross = _liveness.CROSS_NAMESPACE_LIVENESS
    if proc_ours is False and cross:
        notes.append(f"/proc belongs to another PID namespace than this process (pid {os.getpid()} here): stores "
                     "do not mind (liveness is a kernel lock), but tools that read /proc will show other processes")
    elif proc_ours is False:
        problems.append(f"/proc belongs to another PID namespace than this process (pid {os.getpid()} here): "
                        "liveness checks would read other processes' /proc entries; mount a /proc of this "
                        "namespace (`unshare --pid --fork --mount-proc`, or the container's own /proc)")
    if initial is False and not cross:
        notes.append("this process runs in a PID namespace of its own (a container): liveness is judged by pid, "
                     "and a pid of another PID namespace names another process here (or none), so processes of "
                     "other containers that share this /dev/shm look dead to this one (their leases can be "
                     "taken, their stores collected) or, by chance, alive; give them one PID namespace "
                     "(`docker run --pid=host` or `--pid=container:NAME`, a Kubernetes pod with "
                     "shareProcessNamespace: true)")

    extras = _extras()
    return Doctor(ok=not problems, problems=tuple(problems), notes=tuple(notes), system=system, machine=machine,
                  supported_platform=supported, python=".".join(map(str, sys.version_info[:3])),
                  numpy=np.__version__, shmkv=_version(), shm_path=path, shm_fs=fs, shm_size=size, shm_free=free,
                  shm_writable=writable, layout=layout, bytes_per_token=per, tokens_fit=fit,
                  max_map_count=limit, maps_in_use=in_use, stores_mappable=mappable, pid_namespace=ns,
                  initial_pid_namespace=initial, proc_matches_pid_namespace=proc_ours,
                  cross_namespace_liveness=cross, extras=extras)
