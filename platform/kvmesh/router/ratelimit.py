"""Per-API-key rate limits: requests per minute and tokens per minute, as token buckets.

Each tenant (API key; one shared `anonymous` bucket when no keys are configured) has two
buckets that refill continuously: `requests_per_minute` (one per Generate) and
`tokens_per_minute` (prompt tokens + max_tokens charged at admission; the unused part
of max_tokens is refunded when the request ends). A request is admitted only if both
buckets hold enough, and then both are charged together.

With `redis_url` the buckets live in Redis and every check-and-charge is one Lua script
(atomic on the Redis server, clock from Redis `TIME`), so the limits hold across all
routers (a password in the URL or KVMESH_REDIS_PASSWORD, as for the KV store); without
it each router keeps them in memory. A Redis that fails falls back to
the in-memory buckets (logged), so an outage loosens limits instead of failing requests.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
KEY_PREFIX = "kvmesh:ratelimit:v1:"
REDIS_PASSWORD_ENV = "KVMESH_REDIS_PASSWORD"  # as kvmesh.kvstore.redis_store (the operator imports this module)


def password_kwargs(url: str) -> dict[str, str]:
    env = os.environ.get(REDIS_PASSWORD_ENV)
    return {"password": env} if env and urlparse(url).password is None else {}


class RateLimitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    requests_per_minute: int | None = Field(None, ge=1, description="Generate calls per API key per minute; "
                                            "None = unlimited.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt + max_tokens per API key per minute (unused max_tokens are refunded when "
        "a request ends); None = unlimited.")
    redis_url: str | None = Field(
        None, description="redis://[:password@]host:port/db or rediss://...: buckets shared by every router; "
        "None keeps them in this router's memory.")

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float = 0.0
    impossible: str = ""  # why the request can never fit (then allowed is False and retrying is useless)


# (capacity, refill per second, cost) for the request bucket, then the token bucket; capacity 0 = off.
_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local levels = {}
local wait = 0
for i = 1, 2 do
  local cap, rate, cost = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  if cap > 0 then
    local v = redis.call('HMGET', KEYS[i], 'level', 'ts')
    local level = cap
    if v[1] then level = math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * rate) end
    levels[i] = level
    if cost > level then wait = math.max(wait, (cost - level) / rate) end
  end
end
for i = 1, 2 do
  local cap, rate, cost = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  if cap > 0 then
    local level = levels[i]
    if wait == 0 then level = math.min(cap, level - cost) end
    redis.call('HSET', KEYS[i], 'level', tostring(level), 'ts', tostring(now))
    redis.call('PEXPIRE', KEYS[i], math.ceil(cap / rate * 1000) + 1000)
  end
end
return tostring(wait)
"""


class MemoryBuckets:
    """The same arithmetic as the Lua script, in this process (thread-safe)."""

    def __init__(self) -> None:
        self._levels: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, keys: tuple[str, str], args: list[float]) -> float:
        now = time.monotonic()
        with self._lock:
            levels: dict[int, float] = {}
            wait = 0.0
            for i in range(2):
                cap, rate, cost = args[3 * i: 3 * i + 3]
                if cap > 0:
                    level, ts = self._levels.get(keys[i], (cap, now))
                    levels[i] = min(cap, level + max(0.0, now - ts) * rate)
                    if cost > levels[i]:
                        wait = max(wait, (cost - levels[i]) / rate)
            for i, level in levels.items():
                cap, _, cost = args[3 * i: 3 * i + 3]
                self._levels[keys[i]] = (min(cap, level - cost) if wait == 0 else level, now)
            return wait


class RateLimiter:
    """`check(tenant, tokens)` before a request runs; `refund(tenant, tokens)` after."""

    def __init__(self, config: RateLimitConfig):
        self.config = config
        self.memory = MemoryBuckets()
        self.redis_errors = 0
        self._script = None
        if config.redis_url:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(config.redis_url, socket_timeout=0.25, socket_connect_timeout=0.25,
                                             **password_kwargs(config.redis_url))
            self._client = client
            self._script = client.register_script(_LUA)

    def _args(self, requests: int, tokens: int) -> list[float]:
        c = self.config
        rpm, tpm = c.requests_per_minute or 0, c.tokens_per_minute or 0
        return [rpm, rpm / 60.0, requests, tpm, tpm / 60.0, tokens]

    async def _take(self, tenant: str, requests: int, tokens: int) -> float:
        keys = (f"{KEY_PREFIX}{tenant}:requests", f"{KEY_PREFIX}{tenant}:tokens")
        args = self._args(requests, tokens)
        if self._script is not None:
            try:
                return float(await self._script(keys=list(keys), args=args))
            except Exception as exc:  # redis down / auth / timeout: limits fall back to this router
                self.redis_errors += 1
                logger.warning("rate limit redis call failed (%s); using this router's in-memory buckets", exc)
        return self.memory.take(keys, args)

    async def check(self, tenant: str | None, tokens: int) -> Decision:
        """Charge one request and `tokens` to the tenant's buckets, or say how long to wait."""
        c = self.config
        if not c.enabled:
            return Decision(True)
        if c.tokens_per_minute is not None and tokens > c.tokens_per_minute:
            return Decision(False, impossible=f"the request needs {tokens} tokens (prompt + max_tokens) but the "
                                              f"limit is {c.tokens_per_minute} tokens per minute; lower max_tokens "
                                              "or shorten the prompt")
        wait = await self._take(tenant or ANONYMOUS, 1, tokens if c.tokens_per_minute else 0)
        if wait > 0:
            return Decision(False, retry_after_s=max(1.0, math.ceil(wait)))
        return Decision(True)

    async def refund(self, tenant: str | None, tokens: int) -> None:
        """Give back tokens charged but not used (max_tokens not generated)."""
        if self.config.tokens_per_minute and tokens > 0:
            await self._take(tenant or ANONYMOUS, 0, -tokens)

    async def close(self) -> None:
        if self._script is not None:
            await self._client.aclose()
