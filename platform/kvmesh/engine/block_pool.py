"""A pool of fixed-size KV blocks with reference counts and an LRU free queue.

Invariants:
- Block 0 is the null block: never handed out, used by the runner as a padding slot.
- A block is in the free queue iff its ref_cnt == 0.
- A free block may still hold a cached hash: it is reusable by a prefix hit
  (`touch` takes it back out of the queue) until `get_new_blocks` evicts it, oldest
  freed first.
- `on_event`, when set, hears every change to the set of cached hashes, in order:
  (hash, True) when a block is registered, (hash, False) when it is evicted (the KV
  event stream the router's exact prefix index is built from; engine.kv_events).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvmesh.engine.hashing import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        # Insertion order == eviction order (least recently freed first).
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[BlockHash, KVBlock] = {}
        self.on_event: Callable[[BlockHash, bool], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks a request could ever hold (everything but the null block)."""
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_block_hashes(self, limit: int) -> list[BlockHash]:
        """Up to `limit` hashes of cached blocks, the most recently cached last (for
        the router's prefix-affinity view of this worker)."""
        if limit <= 0:
            return []
        hashes = list(self._cached)
        return hashes[-limit:]

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free queue (evicting cached ones)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail of the free queue.

        Callers pass a request's blocks in reverse order so its tail blocks (least
        likely to be shared) are evicted before its head blocks.
        """
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if self.enable_caching and block.block_hash is not None:
                    self._free[block.block_id] = block
                else:
                    block.block_hash = None
                    self._free[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block whose tokens are all known under its chained hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            # Another block already holds this content; keep that one canonical and
            # let this duplicate be recycled normally.
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.on_event is not None:
            self.on_event(block_hash, True)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.on_event is not None:
                    self.on_event(block.block_hash, False)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        if self.on_event is not None:
            for h in self._cached:
                self.on_event(h, False)
        self._cached.clear()
        return True
