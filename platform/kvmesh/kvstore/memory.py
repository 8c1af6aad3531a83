"""In-process KV store: bounded by bytes, LRU, pins exempt from eviction.

The embedded default (one process, or tests). Thread-safe: the engine thread reads,
the connector's writer thread writes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from urllib.parse import parse_qs, urlparse

from kvmesh.kvstore.base import register_backend


class MemoryKVStore:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, tuple[bytes, float | None]] = OrderedDict()
        self._pinned: set[bytes] = set()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def _alive(self, key: bytes) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and key not in self._pinned and time.monotonic() > expires:
            self._remove(key)
            return None
        return value

    def _remove(self, key: bytes) -> None:
        value, _ = self._data.pop(key)
        self._bytes -= len(value)
        self._pinned.discard(key)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            out = []
            for k in keys:
                v = self._alive(k)
                if v is not None:
                    self._data.move_to_end(k)
                out.append(v)
            return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None) -> None:
        with self._lock:
            for key, value in items:
                if key in self._data:
                    self._remove(key)
                expires = None if ttl_s is None else time.monotonic() + ttl_s
                self._data[key] = (value, expires)
                self._bytes += len(value)
            self._evict()

    def _evict(self) -> None:
        for key in list(self._data):
            if self._bytes <= self.max_bytes:
                return
            if key not in self._pinned:
                self._remove(key)
                self.evictions += 1

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [self._alive(k) is not None for k in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                if k in self._data:
                    self._remove(k)

    def pin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pinned.update(k for k in keys if k in self._data)

    def unpin(self, keys: Sequence[bytes], ttl_s: float | None) -> None:
        with self._lock:
            for k in keys:
                self._pinned.discard(k)
                if k in self._data and ttl_s is not None:
                    self._data[k] = (self._data[k][0], time.monotonic() + ttl_s)

    def stats(self) -> dict[str, float]:
        return {"bytes": self._bytes, "keys": len(self._data), "evictions": self.evictions}

    def close(self) -> None:
        pass


@register_backend("memory")
def _from_url(url: str) -> MemoryKVStore:
    q = parse_qs(urlparse(url).query)
    return MemoryKVStore(int(q.get("max_bytes", [1 << 30])[0]))
