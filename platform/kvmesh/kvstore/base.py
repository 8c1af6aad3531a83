"""The KV store protocol and a registry of backends by URL scheme.

Keys are opaque bytes (see codec.block_key); values are encoded blocks. Every method
is best-effort: a backend that cannot answer returns misses / drops writes and counts
the fault, never raises into the engine, so a store outage means recomputation, not
failed requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlparse


class KVStore(Protocol):
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for keys, None where missing (one round trip)."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None) -> None:
        """Store values; ttl_s None keeps them until evicted (pinned)."""
        ...

    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def delete(self, keys: Sequence[bytes]) -> None: ...

    def pin(self, keys: Sequence[bytes]) -> None:
        """Exempt keys from TTL expiry (and, where supported, from eviction)."""
        ...

    def unpin(self, keys: Sequence[bytes], ttl_s: float | None) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


_BACKENDS: dict[str, Callable[[str], KVStore]] = {}


def register_backend(scheme: str):
    def deco(factory: Callable[[str], KVStore]):
        _BACKENDS[scheme] = factory
        return factory

    return deco


def create_store(url: str) -> KVStore:
    """`memory` / `memory://?max_bytes=N` or `redis://host:port/db?timeout_ms=50`."""
    # The backends registered when the kvmesh.kvstore package (always imported before
    # this module) imported them.
    scheme = urlparse(url).scheme or url
    if scheme not in _BACKENDS:
        raise ValueError(f"kv_store: unknown store {url!r}; use one of {sorted(_BACKENDS)} URLs")
    return _BACKENDS[scheme](url)
