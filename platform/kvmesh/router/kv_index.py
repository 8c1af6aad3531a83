"""The router's exact view of one worker's prefix cache, kept from the worker's KV events.

The approximate view (`WorkerHandle.prefix_blocks`: what this router sent there plus a
bounded sample of reported hashes) keeps believing in blocks the worker has long
evicted and knows nothing of blocks other routers placed. This index holds exactly the
hashes the worker reported stored and not since removed (engine.kv_events), as of the
last Stats poll: the `precise_prefix` scorer reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVIndex:
    """Block hashes one worker holds, with the cursor of the events applied so far."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.epoch = 0  # 0: nothing applied yet (the worker answers with a snapshot)
        self.seq = 0

    def cursor(self) -> dict[str, int]:
        """The StatsRequest fields that ask for the events after this cursor."""
        return {"kv_events": True, "kv_events_epoch": self.epoch, "kv_events_after": self.seq}

    def apply(self, epoch: int, seq: int, reset: bool, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Apply one batch of events (a snapshot when `reset`)."""
        if reset:
            self.hashes = set(stored)
        else:
            self.hashes.update(stored)
            self.hashes.difference_update(removed)
        self.epoch, self.seq = epoch, seq

    def apply_stats(self, stats) -> bool:
        """Apply the events in a StatsResponse; False when it carries none (events not
        asked for, or a worker that predates them)."""
        if not stats.kv_events_epoch:
            return False
        self.apply(stats.kv_events_epoch, stats.kv_events_seq, stats.kv_events_reset, stats.kv_stored,
                   stats.kv_removed)
        return True

    def prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt the worker holds."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.hashes)
