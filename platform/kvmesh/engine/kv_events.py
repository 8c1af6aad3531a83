"""KV events: which block hashes a worker's prefix cache gained or lost, read by cursor.

A worker publishes them so a router can keep an exact index of what each worker holds
(llm-d's precise prefix scheduler and Dynamo's KV router do the same). The log hears
every change of a BlockPool's set of cached hashes (`BlockPool.on_event`) and numbers
them 1, 2, ... Readers ask for everything after the last number they applied:

- the answer is coalesced: each hash touched since the cursor is reported once, in the
  state it is in *now* (stored or removed), so applying it gives exactly the pool's set;
- a reader whose cursor belongs to another epoch (the worker restarted) or fell out of
  the bounded window gets `reset=True` and a snapshot of every cached hash instead.

Invariant: after `index = apply(index, log.since(epoch, seq))`, index == the pool's
cached hashes at that moment (tests assert it, including over gRPC).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from kvmesh.engine.block_pool import BlockPool
from kvmesh.engine.hashing import BlockHash


@dataclass
class KVEventBatch:
    """The change since a reader's cursor (or a snapshot, when `reset`)."""

    epoch: int
    seq: int  # the reader's next cursor
    reset: bool
    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)


class KVEventLog:
    """Sequence-numbered record of one BlockPool's cached-hash changes."""

    def __init__(self, pool: BlockPool, window: int = 1 << 16, epoch: int | None = None):
        if window < 1:
            raise ValueError(f"window must be >= 1 event, got {window}")
        if pool.on_event is not None:
            raise ValueError("this BlockPool already has an event listener")
        self.pool = pool
        # Nonzero: 0 means "no cursor yet" on the wire.
        self.epoch = epoch if epoch is not None else random.getrandbits(62) + 1
        self.seq = 0
        self._touched: deque[BlockHash] = deque(maxlen=window)  # hashes of events seq-len+1 .. seq
        pool.on_event = self._record

    def _record(self, block_hash: BlockHash, stored: bool) -> None:
        self.seq += 1
        self._touched.append(block_hash)

    def since(self, epoch: int, after: int) -> KVEventBatch:
        """What a reader that applied events up to `after` of `epoch` must apply next."""
        behind = self.seq - after
        if epoch != self.epoch or behind < 0 or behind > len(self._touched):
            stored = self.pool.cached_block_hashes(self.pool.num_cached_blocks)
            return KVEventBatch(self.epoch, self.seq, True, stored)
        batch = KVEventBatch(self.epoch, self.seq, False)
        touched = dict.fromkeys(islice(self._touched, len(self._touched) - behind, None))
        for h in touched:
            (batch.stored if self.pool.get_cached_block(h) is not None else batch.removed).append(h)
        return batch
