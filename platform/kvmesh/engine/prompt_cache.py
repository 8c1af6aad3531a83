"""The pinned prompts of one engine and their quota.

A pinned prompt (`LLMEngine.cache_prompt`, `prompt_cache` in the config) keeps its KV
blocks referenced until it is uncached or its TTL ends, so pins shrink the cache every
other request shares. Two limits keep that safe, checked when a pin is *asked for*
(before it is computed), so a pin that does not fit is refused at once and never waits
for blocks or spins the engine:

- pins together hold at most `max_fraction` of the usable blocks;
- whatever the fraction, the blocks left unpinned still hold one `max_model_len`
  request, so a normal request can always be served.

A pin being computed holds a reservation for its blocks, so two concurrent pins cannot
both pass the check and then overrun the quota together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvmesh.errors import InvalidRequestError, ResourceExhaustedError


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Pin:
    """One pinned prompt: the hold id its blocks are kept under, its store keys, expiry."""

    hold_id: str
    keys: list[bytes]
    expires: float | None
    num_blocks: int


class PinnedPrompts:
    def __init__(self, usable_blocks: int, block_size: int, max_model_len: int, max_fraction: float):
        self.usable_blocks = usable_blocks
        self.block_size = block_size
        self.cap = int(usable_blocks * max_fraction)
        # Blocks that must stay unpinned: one request of max_model_len tokens.
        self.floor = _cdiv(max_model_len, block_size)
        self.pins: dict[str, Pin] = {}
        self.reserved: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks held or reserved by pins."""
        return sum(p.num_blocks for p in self.pins.values()) + sum(self.reserved.values())

    def reserve(self, name: str, num_tokens: int) -> int:
        """Reserve the blocks of a `num_tokens` prompt under `name`, or raise
        ResourceExhaustedError naming the limit. Returns the reserved block count."""
        if name in self.reserved:
            raise InvalidRequestError("name", f"prompt {name!r} is being cached already; wait for that call")
        need = _cdiv(num_tokens, self.block_size)
        used = self.num_blocks - (self.pins[name].num_blocks if name in self.pins else 0)
        if used + need > self.cap:
            raise ResourceExhaustedError(
                "max_pinned_fraction",
                f"pinning {need} more KV blocks would hold {used + need} of {self.usable_blocks} blocks, over the "
                f"pinned-prompt quota of {self.cap}; uncache a prompt, or raise cache.max_pinned_fraction or the "
                "KV cache size")
        if self.usable_blocks - (used + need) < self.floor:
            raise ResourceExhaustedError(
                "max_pinned_fraction",
                f"pinning {need} more KV blocks would leave {self.usable_blocks - used - need} unpinned blocks, "
                f"fewer than one max_model_len request needs ({self.floor}); uncache a prompt or grow the KV cache")
        self.reserved[name] = need
        return need

    def unreserve(self, name: str) -> None:
        self.reserved.pop(name, None)

    def commit(self, name: str, hold_id: str, keys: list[bytes], ttl_s: float | None) -> None:
        """The reserved pin is computed: its blocks are now held under `hold_id`."""
        need = self.reserved.pop(name)
        expires = None if ttl_s is None else time.monotonic() + ttl_s
        self.pins[name] = Pin(hold_id, keys, expires, need)

    def pop(self, name: str) -> Pin | None:
        return self.pins.pop(name, None)

    def expired(self, now: float) -> list[str]:
        return [name for name, p in self.pins.items() if p.expires is not None and now >= p.expires]
