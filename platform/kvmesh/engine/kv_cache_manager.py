"""Per-request block tables over a BlockPool, with automatic prefix caching.

A request's block table is append-only while it runs: blocks are added as tokens
are scheduled and all released together when it finishes or is preempted. Full
blocks are registered under their chained hash as soon as the step that computes
them is scheduled; within a step every layer writes all K/V before any attention
reads, so another request scheduled in the same step may already hit them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.block_pool import BlockPool, KVBlock
from kvmesh.engine.hashing import block_hashes
from kvmesh.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    """The leading cached blocks of a waiting request, and the tokens they cover."""

    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_fingerprint: str,
        enable_prefix_caching: bool = True,
    ):
        self.block_size = block_size
        self.fingerprint = model_fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Blocks of finished requests kept alive for a consumer (P/D transfer), by id.
        self.held: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the cache.
        self._num_cached: dict[str, int] = {}
        # Prefix-cache stats (queried tokens, hit tokens) for metrics.
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def update_block_hashes(self, request: Request) -> None:
        request.block_hashes = block_hashes(
            request.all_token_ids, self.block_size, self.fingerprint, request.block_hashes, request.cache_salt
        )

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Longest run of leading full blocks already cached.

        At least one token is always left to compute: the model must run on the last
        token to produce the logits for the next one.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        self.query_tokens += request.num_tokens
        self.hit_tokens += len(hit) * self.block_size
        return PrefixHit(hit, len(hit) * self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` could ever fit in the whole pool."""
        return cdiv(num_tokens, self.block_size) <= self.num_usable_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> list[KVBlock] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens.

        `prefix` (admission only) are cached blocks covering the request's first
        `prefix.num_tokens` tokens. Returns the newly allocated blocks, or None (and
        changes nothing) when the pool cannot supply them.
        """
        prefix = prefix or PrefixHit([], 0)
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + prefix.num_tokens
        total = num_computed + num_new_tokens
        num_needed = cdiv(total, self.block_size) - len(blocks) - len(prefix.blocks)
        # Prefix blocks sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in prefix.blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(prefix.blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        if request.request_id in self.req_blocks:
            blocks.extend(new_blocks)
        else:
            blocks = list(prefix.blocks) + new_blocks
            self.req_blocks[request.request_id] = blocks
            self._num_cached[request.request_id] = len(prefix.blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Only tokens whose ids are known can be hashed (the sampled-next token is not).
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached[request.request_id]
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def hold(self, request: Request) -> list[int]:
        """Detach a finishing request's blocks and keep their references under its id
        until `release`, so a consumer (a decode worker's pull) can still read them."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.held[request.request_id] = blocks
        return [b.block_id for b in blocks]

    def release(self, hold_id: str) -> bool:
        blocks = self.held.pop(hold_id, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks
