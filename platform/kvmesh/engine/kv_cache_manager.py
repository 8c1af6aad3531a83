"""Per-request block tables over a BlockPool, with automatic prefix caching.

A request's block table is append-only while it runs: blocks are added as tokens
are scheduled and all released together when it finishes or is preempted. Full
blocks are registered under their chained hash as soon as the step that computes
them is scheduled; within a step every layer writes all K/V before any attention
reads, so another request scheduled in the same step may already hit them.

Sliding window (`sliding_window`, set when every layer of the model slides, as vLLM's
SlidingWindowManager does): once a request's next chunk starts at position p0, its queries
see keys >= p0 - window + 1 only, and so do all its later queries (p0 never goes back:
a speculative rollback stops at or after the chunk's start, a preemption frees the whole
table). A block wholly before that is returned to the pool as soon as the chunk is
scheduled; its table entry becomes the null block, which no attention backend reads (they
start at the window) and no token is written to (new tokens land after p0). A returned
block that was registered keeps its hash and stays a prefix-cache hit until evicted, like
a finished request's. A request then holds at most `blocks_per_request` blocks, whatever
its length. Requests that hold their KV after finishing (P/D transfer, pinned prompts)
keep every block: a consumer reads them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.block_pool import BlockPool, KVBlock
from kvmesh.engine.hashing import block_hashes
from kvmesh.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_per_request(num_tokens: int, block_size: int, window: int | None, max_chunk: int) -> int:
    """The most blocks one request of up to `num_tokens` tokens holds at once, scheduled in
    chunks of up to `max_chunk` tokens: all of them without a window; with one, a chunk at
    p0 keeps positions [p0 - window + 1, p0 + chunk), at most window - 1 + chunk tokens
    spread over at most one block more than they fill."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    return min(full, cdiv(window - 1 + max_chunk, block_size) + 1)


@dataclass
class PrefixHit:
    """The leading cached blocks of a waiting request, and the tokens they cover. With a
    sliding window the blocks before the window of the first token to compute may be the
    null block: they are not needed, so they need not be cached."""

    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_fingerprint: str,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.fingerprint = model_fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Blocks of finished requests kept alive for a consumer (P/D transfer), by id.
        self.held: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the cache.
        self._num_cached: dict[str, int] = {}
        # How many leading table entries of each request are the null block (sliding window).
        self._num_dropped: dict[str, int] = {}
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
            request.all_token_ids, self.block_size, self.fingerprint, request.block_hashes, request.cache_salt,
            request.lora_key,
        )

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Longest run of leading full blocks already cached.

        At least one token is always left to compute: the model must run on the last
        token to produce the logits for the next one. Requests that want prompt logprobs
        never hit (as in vLLM).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs come from the logits of every prompt position: a hit would skip them.
            return PrefixHit([], 0)
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is None or request.hold_kv:
            hit: list[KVBlock] = []
            for h in request.block_hashes[:max_blocks]:
                block = self.pool.get_cached_block(h)
                if block is None:
                    break
                hit.append(block)
        else:
            hit = self._windowed_hit(request.block_hashes[:max_blocks])
        self.query_tokens += request.num_tokens
        self.hit_tokens += len(hit) * self.block_size
        return PrefixHit(hit, len(hit) * self.block_size)

    def _windowed_hit(self, hashes: list[bytes]) -> list[KVBlock]:
        """The longest hit of n blocks whose blocks from the one holding key n * bs - window + 1
        (the first the next token sees) are all cached; earlier ones are the null block. A
        chained hash names its whole prefix, so a cached block stands for that prefix even when
        its predecessors were evicted."""
        found: list[KVBlock | None] = []
        best, run_start = 0, 0
        for i, h in enumerate(hashes):
            block = self.pool.get_cached_block(h)
            found.append(block)
            if block is None:
                run_start = i + 1
            elif run_start <= self._first_needed_block((i + 1) * self.block_size):
                best = i + 1
        skip = self._first_needed_block(best * self.block_size)
        return [self.pool.null_block] * skip + found[skip:best]

    def _first_needed_block(self, p0: int) -> int:
        """Index of the first block a chunk starting at position p0 reads (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, p0 - self.sliding_window + 1) // self.block_size

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
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        num_computed = request.num_computed_tokens + prefix.num_tokens
        total = num_computed + num_new_tokens
        keep_all = self.sliding_window is None or request.hold_kv
        if blocks is not None:
            # Whatever the allocation's outcome, blocks before this chunk's window are done
            # (registered first: a speculative step can complete a block and pass its window).
            if not keep_all:
                if self.enable_prefix_caching:
                    self._cache_full_blocks(request, blocks, num_computed)
                self._drop_outside_window(rid, blocks, num_computed)
            hits: list[KVBlock] = []
            skip = 0
            num_needed = cdiv(total, self.block_size) - len(blocks)
        else:
            # A hit's blocks before the window are never read: not touched, the null block instead.
            skip = 0 if keep_all else min(self._first_needed_block(num_computed), len(prefix.blocks))
            hits = [b for b in prefix.blocks[skip:] if b is not self.pool.null_block]
            assert len(hits) == len(prefix.blocks) - skip, "a prefix hit has the null block inside its window"
            num_needed = cdiv(total, self.block_size) - len(prefix.blocks)
        # Prefix blocks sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(hits)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        if blocks is not None:
            blocks.extend(new_blocks)
        else:
            blocks = [self.pool.null_block] * skip + hits + new_blocks
            self.req_blocks[rid] = blocks
            self._num_cached[rid] = len(prefix.blocks)
            self._num_dropped[rid] = skip
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, total)
        return new_blocks

    def _drop_outside_window(self, rid: str, blocks: list[KVBlock], p0: int) -> None:
        """Return the blocks wholly before the window of a chunk starting at p0 to the pool."""
        start, end = self._num_dropped[rid], self._first_needed_block(p0)
        if end <= start:
            return
        dropped = [b for b in blocks[start:end] if b is not self.pool.null_block]
        blocks[start:end] = [self.pool.null_block] * (end - start)
        self._num_dropped[rid] = end
        self.pool.free_blocks(reversed(dropped))

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Only tokens whose ids are known can be hashed (the sampled-next token is not).
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached[request.request_id]
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, num_full):
            if blocks[i] is not self.pool.null_block:  # (never registered: it stands for a dropped block)
                self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = num_full

    def fork_point(self, num_prompt_tokens: int) -> int:
        """How many leading prompt tokens the choices of an n > 1 request share: the full
        blocks before the prompt's last token (each choice computes that token itself, for
        its own first sample, so the block holding it is never shared)."""
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def fork(self, parent: Request, child: Request) -> int:
        """Give `child` a block table that shares `parent`'s first fork_point blocks by
        reference (no copy, no allocation, so it cannot fail); returns the tokens shared.

        The parent must have computed them. The partial last block is not shared: the
        child recomputes its few tokens (< block_size + 1) into a block of its own, which
        needs no KV-copy op in the executor and keeps every choice an ordinary request
        afterwards (preemption, speculation, prefix caching)."""
        assert child.request_id not in self.req_blocks, f"{child.request_id} already has blocks"
        num_tokens = min(self.fork_point(parent.num_prompt_tokens), parent.num_computed_tokens)
        n = num_tokens // self.block_size
        pid = parent.request_id
        shared = self.req_blocks.get(pid, [])[:n]
        assert len(shared) == n, f"{pid} holds {len(shared)} blocks, fewer than the {n} to fork"
        self.pool.touch(b for b in shared if b is not self.pool.null_block)
        rid = child.request_id
        self.req_blocks[rid] = list(shared)
        self._num_cached[rid] = min(self._num_cached.get(pid, 0), n)
        self._num_dropped[rid] = min(self._num_dropped.get(pid, 0), n)
        return num_tokens

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self._num_dropped.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed([b for b in blocks if b is not self.pool.null_block]))

    def hold(self, request: Request) -> list[int]:
        """Detach a finishing request's blocks and keep their references under its id
        until `release`, so a consumer (a decode worker's pull) can still read them."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self._num_dropped.pop(request.request_id, None)
        assert self.pool.null_block not in blocks, "a request that holds its KV keeps every block"
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
