"""Run a command in a private /dev/shm (a mount namespace with its own tmpfs) or a second
PID namespace, as a container would see them. Needs root (CI runs as root)
and util-linux's ``unshare``; ``available()`` says whether this machine allows it.

The private /dev/shm lives only as long as the command: nothing is left on the
machine's own /dev/shm, and the machine's stores are invisible to the command.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Sequence

PY = sys.executable

_PRIVATE_SHM = ('mount --make-rprivate / && mount -t tmpfs -o size="$SHM_SIZE" tmpfs /dev/shm '
                '&& exec "$@"')


@functools.cache
def available() -> str | None:
    """None if private mount and PID namespaces work here, else why not."""
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    r = subprocess.run(["unshare", "-m", "sh", "-c", _PRIVATE_SHM, "sh", "true"], env={"SHM_SIZE": "1m",
                       "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, capture_output=True, text=True, timeout=30)
    if r.returncode:
        return f"unshare -m + mount tmpfs is not allowed here (root needed): {r.stderr.strip()}"
    r = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, text=True, timeout=30)
    if r.returncode:
        return f"unshare -p is not allowed here: {r.stderr.strip()}"
    return None


def in_private_shm(cmd: Sequence[str], size: str, *, timeout: float = 300, env: dict[str, str] | None = None,
                   pid_ns: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with a fresh tmpfs of ``size`` (e.g. "64m") at /dev/shm, in a PID namespace
    of its own too with ``pid_ns``."""
    import os

    full_env = {**os.environ, **(env or {}), "SHM_SIZE": size}
    pre = ["unshare", "-m"] + (["-p", "-f", "--mount-proc"] if pid_ns else [])
    return subprocess.run([*pre, "sh", "-c", _PRIVATE_SHM, "sh", *cmd], env=full_env, capture_output=True,
                          text=True, timeout=timeout)
