"""Reaching Redis for ``RemoteTier``: its settings checked, a redis-py client made (imported
only then: ``import shmkv.remote`` never imports redis), Redis failures recognised, and URLs
printed without their password."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import numpy as np

from shmkv._engine.prefixes.hashes import BLOCK
from shmkv.errors import InvalidArgumentError, NotSupportedError

__all__ = ["check_settings", "connect", "is_redis_error", "redact"]

_NS = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_TIMEOUT_MAX = 86400.0  # seconds: a socket timeout past it is a mistake (inf or 1e20 overflow the socket's)


def redact(url: str) -> str:
    """The URL without its password (messages and repr must not print it)."""
    try:
        u = urlsplit(url)
        if u.password is None:
            return url
        host = u.hostname or ""
        if u.port is not None:
            host = f"{host}:{u.port}"
        user = f"{u.username}:***@" if u.username else ":***@"
        return urlunsplit((u.scheme, user + host, u.path, u.query, u.fragment))
    except ValueError:
        return "<unparsable url>"


def _url_problem(url: object) -> str | None:
    """Why redis-py could not use ``url`` (None when it can): the scheme, a port out of 1-65535 or
    not a number, a db (the path's number or ``?db=``) not a number, an IPv6 host not closed."""
    if not isinstance(url, str):
        return "is not a string"
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:  # ("Port out of range 0-65535", "Invalid IPv6 URL", a port not a number)
        return str(e)
    if u.scheme not in ("redis", "rediss", "unix"):
        return f"has scheme {u.scheme!r}"
    if port == 0:
        return "has port 0"
    dbs = parse_qs(u.query).get("db", []) + ([u.path.strip("/")] if u.scheme != "unix" and u.path.strip("/") else [])
    bad = [db for db in dbs if not db.isdigit()]
    return f"names db {bad[0]!r}, not a number" if bad else None


def check_settings(url: object, namespace: object, chunk_tokens: object, timeout: object) -> None:
    """RemoteTier's arguments checked (InvalidArgumentError naming the bad one)."""
    problem = _url_problem(url)
    if problem is not None:
        raise InvalidArgumentError(
            f"url={redact(url) if isinstance(url, str) else url!r} {problem}: it must look like "
            "redis://host:port/db (rediss:// for TLS, unix:///path.sock)"
        )
    if not isinstance(namespace, str) or not _NS.fullmatch(namespace):
        raise InvalidArgumentError(
            f"namespace={namespace!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
        )
    if (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer))
            or chunk_tokens < BLOCK or chunk_tokens % BLOCK):
        raise InvalidArgumentError(
            f"chunk_tokens={chunk_tokens!r} must be a positive multiple of {BLOCK} (the prefix hash's block)"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= _TIMEOUT_MAX:
        raise InvalidArgumentError(f"timeout={timeout!r} must be a number of seconds > 0 and at most "
                                   f"{_TIMEOUT_MAX:.0f} (a day)")


def connect(url: str, cluster: bool, timeout: float, call: Callable[[Callable[[], Any]], Any]) -> Any:
    """A redis-py client for ``url`` (``RedisCluster`` with ``cluster``; its constructor connects,
    so it runs under ``call``, which maps Redis failures)."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise NotSupportedError(
            "the remote tier needs redis-py: pip install 'shmkv[redis]'"
        ) from e
    # One immediate retry (a pooled connection gone stale after a server restart),
    # no backoff: a tier that is down must degrade a pull at once, not in seconds.
    kw: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                          "retry": Retry(NoBackoff(), 1)}
    if cluster:
        from redis.cluster import RedisCluster

        # RedisCluster connects in its constructor (to learn the slots): errors are ours to map
        return call(lambda: RedisCluster.from_url(url, **kw))
    return redis.Redis.from_url(url, **kw)


def is_redis_error(e: BaseException) -> bool:
    try:
        import redis.exceptions as rx
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (rx.RedisError, rx.RedisClusterException, OSError))


def what_to_do(e: BaseException, timeout: float) -> str:
    """The way out of Redis failure ``e``: a server that answered with an error (out of memory,
    a read-only replica, no permission) is up; one that did not answer may not be."""
    import redis.exceptions as rx

    if isinstance(e, rx.ResponseError):
        if isinstance(e, getattr(rx, "OutOfMemoryError", ())) or "maxmemory" in str(e):
            return ("the server is out of memory (maxmemory): raise it, or let it evict (maxmemory-policy "
                    "allkeys-lru)")
        return "the server refused the command: check the server's configuration and this user's permissions"
    return f"check that the server is up and reachable, or raise RemoteTier(timeout=) (now {timeout} s)"
