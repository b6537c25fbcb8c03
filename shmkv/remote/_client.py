"""Reaching Redis for ``RemoteTier``: its settings checked, a redis-py client made (imported
only then: ``import shmkv.remote`` never imports redis), Redis failures recognised, and URLs
printed without their password."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from shmkv._engine.prefixes.hashes import BLOCK
from shmkv.errors import InvalidArgumentError, NotSupportedError

__all__ = ["check_settings", "connect", "is_redis_error", "redact"]

_NS = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


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


def check_settings(url: object, namespace: object, chunk_tokens: object, timeout: object) -> None:
    """RemoteTier's arguments checked (InvalidArgumentError naming the bad one)."""
    if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise InvalidArgumentError(
            f"url={redact(url) if isinstance(url, str) else url!r} must look like redis://host:port/db "
            "(rediss:// for TLS, unix:///path.sock)"
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
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"timeout={timeout!r} must be a number of seconds > 0")


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
