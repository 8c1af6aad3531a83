"""Redis KV store: pipelined MGET / SET EX over a connection pool, short timeouts, and a
circuit breaker so a dead Redis costs one timeout per cooldown, not one per request.

Redis should run with `maxmemory` and `maxmemory-policy allkeys-lru`: blocks then
behave as a shared LRU cache; pinned blocks (prompt cache) carry no TTL but can still
be evicted under memory pressure by Redis itself, so the local pin is what guarantees
them on a worker.

Authentication and encryption: `redis://:password@host:port/db` (or `user:password@`),
`rediss://` for TLS (`?ssl_ca_certs=/path/ca.pem` and the other redis-py URL options);
a URL without a password takes `KVMESH_REDIS_PASSWORD` from the environment (the operator
sets it from the managed Redis's Secret, so the password never sits in a config file).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from urllib.parse import parse_qs, urlparse

from kvmesh.kvstore.base import register_backend

logger = logging.getLogger(__name__)

PASSWORD_ENV = "KVMESH_REDIS_PASSWORD"


def password_kwargs(url: str) -> dict[str, str]:
    """`{"password": ...}` from KVMESH_REDIS_PASSWORD when `url` carries no password of its own."""
    env = os.environ.get(PASSWORD_ENV)
    return {"password": env} if env and urlparse(url).password is None else {}


class CircuitBreaker:
    """Open after `threshold` consecutive failures; stay open for `cooldown_s`, then
    let one call through (half-open) to probe."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0):
        self.threshold, self.cooldown_s = threshold, cooldown_s
        self.failures = 0
        self.opened_at: float | None = None
        self.trips = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return True
            if time.monotonic() - self.opened_at >= self.cooldown_s:
                self.opened_at = time.monotonic()  # half-open: one probe per cooldown
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self.opened_at = None

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.failures >= self.threshold and self.opened_at is None:
                self.opened_at = time.monotonic()
                self.trips += 1


class RedisKVStore:
    def __init__(self, url: str, timeout_s: float = 0.05, breaker: CircuitBreaker | None = None):
        import redis

        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
            health_check_interval=0, **password_kwargs(url),
        )
        self.breaker = breaker or CircuitBreaker()
        self.errors = 0
        self.skipped = 0

    def _call(self, what: str, fn, default):
        if not self.breaker.allow():
            self.skipped += 1
            return default
        try:
            result = fn()
        except Exception as exc:  # redis.RedisError, OSError, timeouts: all mean "miss"
            self.errors += 1
            self.breaker.failure()
            logger.warning("redis %s failed (%s); treating as a cache miss", what, exc)
            return default
        self.breaker.success()
        return result

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        return self._call("MGET", lambda: self._redis.mget(list(keys)), [None] * len(keys))

    def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None) -> None:
        if not items:
            return

        def run():
            pipe = self._redis.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, px=None if ttl_s is None else int(ttl_s * 1000))
            pipe.execute()

        self._call("SET", run, None)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        def run():
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(x) for x in pipe.execute()]

        return self._call("EXISTS", run, [False] * len(keys))

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call("DEL", lambda: self._redis.delete(*keys), None)

    def pin(self, keys: Sequence[bytes]) -> None:
        def run():
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.persist(k)
            pipe.execute()

        self._call("PERSIST", run, None)

    def unpin(self, keys: Sequence[bytes], ttl_s: float | None) -> None:
        if ttl_s is None:
            return

        def run():
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.pexpire(k, int(ttl_s * 1000))
            pipe.execute()

        self._call("PEXPIRE", run, None)

    def stats(self) -> dict[str, float]:
        return {"errors": self.errors, "skipped_breaker_open": self.skipped, "breaker_trips": self.breaker.trips}

    def close(self) -> None:
        self._redis.close()


@register_backend("redis")
@register_backend("rediss")
def _from_url(url: str) -> RedisKVStore:
    parsed = urlparse(url)
    q = parse_qs(parsed.query)
    timeout_ms = float(q.pop("timeout_ms", ["50"])[0])
    cooldown = float(q.pop("breaker_cooldown_s", ["5"])[0])
    clean = parsed._replace(query="").geturl()
    return RedisKVStore(clean, timeout_ms / 1000.0, CircuitBreaker(cooldown_s=cooldown))
