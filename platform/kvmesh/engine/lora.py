"""Which LoRA adapter a request runs under, as the torch-free engine sees it.

The engine only needs an adapter's identity: `name` groups rows of a step by adapter and
caps how many distinct adapters one step batches (`LoRAConfig.max_loras`); `key`, the
adapter's content fingerprint, is mixed into the request's block hashes (engine/hashing.py)
so the prefix cache never shares KV across adapters. Weights live in the worker
(worker/lora.py, behind the `LoRAHost` protocol); a request reaches the scheduler only once
its adapter is in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LoRARequest:
    name: str
    key: str


@dataclass(frozen=True)
class LoRAInfo:
    """An adapter a worker knows: `loaded` in host memory, `resident` in a device slot;
    `num_requests` waiting or running under it (filled in by the engine)."""

    name: str
    path: str
    rank: int = 0
    key: str = ""
    loaded: bool = False
    resident: bool = False
    num_requests: int = 0


class LoRAHost(Protocol):
    """What the engine needs from the worker's adapter store (worker/lora.py LoRAManager).
    `read` may run on any thread (disk I/O and parsing, off the step loop); the others run
    on the engine's step thread."""

    max_loras: int

    def read(self, name: str, path: str) -> object:
        """Read and check a PEFT adapter folder; returns an opaque loaded adapter. Raises
        InvalidRequestError naming what to change (missing files, rank > max_lora_rank,
        modules this model does not have)."""
        ...

    def add(self, name: str, path: str, loaded: object, busy: frozenset[str] = frozenset()) -> LoRAInfo:
        """Hold a `read` adapter in host memory, evicting the least recently used adapter
        not in `busy` (those with requests in flight) when it is full."""
        ...

    def touch(self, name: str) -> None:
        """A request was queued under the adapter (its host-memory LRU order)."""
        ...

    def remove(self, name: str) -> bool:
        """Drop an adapter from host memory and its device slot; False if it was not held."""
        ...

    def get(self, name: str) -> LoRAInfo | None:
        """The held adapter, or None (never loaded, unloaded, or evicted from host memory)."""
        ...

    def adapters(self) -> list[LoRAInfo]:
        """Every adapter held in host memory."""
        ...
