"""Throwaway Redis servers on free loopback ports, for the remote tier's tests and benchmark.

Never a system service, never a fixed port: each server is a child of this
process on 127.0.0.1, with its own temporary directory, no persistence, and is
stopped (and its directory removed) by ``stop()``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A port free on 127.0.0.1 now (and port + 10000 too with ``bus``: a cluster node's bus port)."""
    for _ in range(200):
        p = random.randint(20000, 55000 - 1)
        if _free(p) and (not bus or _free(p + 10000)):
            return p
    raise RuntimeError("no free loopback port found")


def _ping(port: int, timeout: float = 0.5) -> bytes:
    """Raw PING over a socket (no redis-py needed): the server's reply, or b'' if none."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)
    except OSError:
        return b""


class RedisServer:
    """One redis-server child on 127.0.0.1. ``url`` reaches it; ``stop()`` ends it."""

    def __init__(self, *args: str, cluster: bool = False, tmp: str | None = None, timeout: float = 15.0,
                 port: int | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not on PATH (apt-get install -y redis-server)")
        self._own_tmp = tmp is None
        self.dir = tmp or tempfile.mkdtemp(prefix="shmkv-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        last = ""
        for _ in range(5 if port is None else 1):  # a port taken between the check and the bind: try another
            self.port = free_port(bus=cluster) if port is None else port
            cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                   "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
                   "--logfile", os.path.join(self.dir, f"redis-{self.port}.log")]
            if cluster:
                cmd += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                        "--cluster-node-timeout", "5000"]
            with open(os.path.join(self.dir, f"redis-{self.port}.err"), "wb") as err:
                self.proc = subprocess.Popen([*cmd, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=err, start_new_session=True)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if _ping(self.port).startswith(b"+PONG"):
                    return
                time.sleep(0.02)
            last = self._log()
            self._kill()
        self._cleanup()
        raise RuntimeError(f"redis-server did not start: {last[-2000:]}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _log(self) -> str:
        out = ""
        for ext in ("err", "log"):
            try:
                with open(os.path.join(self.dir, f"redis-{self.port}.{ext}")) as f:
                    out += f.read()
            except OSError:
                pass
        return out

    def _kill(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)  # a test may have stopped it
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def kill(self) -> None:
        """SIGKILL the server (the tier's 'server died' case); ``stop()`` still cleans up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def _cleanup(self) -> None:
        if self._own_tmp:
            shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self) -> None:
        self._kill()
        self._cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster:
    """``n`` cluster-enabled servers joined with ``redis-cli --cluster create``, no replicas."""

    def __init__(self, n: int = 3, timeout: float = 60.0) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not on PATH (apt-get install -y redis-server)")
        self.dir = tempfile.mkdtemp(prefix="shmkv-rcluster-")
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(n):
                self.nodes.append(RedisServer(cluster=True, tmp=self.dir))
            addrs = [f"127.0.0.1:{s.port}" for s in self.nodes]
            r = subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
            if r.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]!r} {r.stderr[-2000:]!r}")
            deadline = time.monotonic() + timeout
            while not all(self._ok(s.port) for s in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ok(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"CLUSTER INFO\r\n")
                data = b""
                while b"cluster_known_nodes" not in data:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            return b"cluster_state:ok" in data
        except OSError:
            return False

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for s in self.nodes:
            s.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def redis_server(*args: str) -> Iterator[Any]:
    s = RedisServer(*args)
    try:
        yield s
    finally:
        s.stop()
