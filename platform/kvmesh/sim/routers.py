"""Router replicas in front of the simulated fleet.

A production router runs as several replicas behind a load balancer. Each replica is a
`WorkerScheduler` with its own `WorkerHandle` per worker, so each keeps its own
approximate prefix view (the hashes *it* routed, plus the bounded sample of cached
hashes every worker reports) and its own in-flight counts; what the workers report
(Stats, the sampled hashes, KV events) reaches every replica alike. With one replica
the approximate view knows every placement; with n, a follow-up turn lands on a replica
that routed the earlier turns only 1/n of the time. The exact index (KV events) is the
workers' own truth and does not depend on which replica routed what.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from kvmesh.router.plugins import RouteRequest, WorkerScheduler
from kvmesh.sim.worker import SimHandle, SimStats, SimWorker

Spread = Literal["round_robin", "random"]


class RouterTier:
    """`len(policies)` router replicas; requests spread over them by `spread` (round robin
    or a seeded random choice: deterministic either way)."""

    def __init__(self, policies: Sequence[WorkerScheduler], affinity_capacity: int,
                 spread: Spread = "round_robin", seed: int = 0):
        if not policies:
            raise ValueError("a router tier needs at least one replica (one WorkerScheduler each)")
        if spread not in ("round_robin", "random"):
            raise ValueError(f"router spread must be 'round_robin' or 'random', got {spread!r}")
        self.policies = list(policies)
        self.affinity_capacity = affinity_capacity
        self.spread = spread
        self._rng = random.Random(seed)
        self._turn = -1
        # replica -> worker index -> that replica's handle on the worker
        self.handles: list[dict[int, SimHandle]] = [{} for _ in self.policies]

    def __len__(self) -> int:
        return len(self.policies)

    def add_worker(self, w: SimWorker) -> None:
        for hs in self.handles:
            hs[w.index] = SimHandle(w, self.affinity_capacity)

    def poll(self, w: SimWorker, reported_hashes: int, kv_events: bool) -> None:
        """One Stats poll of `w` by every replica: the same load and sampled hashes for
        all; KV events from each replica's own cursor."""
        s = w.scheduler
        stats = SimStats(w.role, s.num_waiting, s.num_running, w.kv.num_free_blocks, w.kv.num_usable_blocks)
        reported = frozenset(w.kv.pool.cached_block_hashes(reported_hashes))
        for hs in self.handles:
            h = hs[w.index]
            h.stats, h._reported = stats, reported
            if kv_events:
                ev = w.events.since(h.kv_index.epoch, h.kv_index.seq)
                h.kv_index.apply(ev.epoch, ev.seq, ev.reset, ev.stored, ev.removed)

    def route(self, req: RouteRequest, serving: list[SimWorker]) -> SimHandle | None:
        """The replica the load balancer hands `req` to picks a worker (its handle on it),
        and remembers the placement in its own approximate view."""
        if self.spread == "random":
            r = self._rng.randrange(len(self.policies))
        else:
            self._turn += 1
            r = self._turn % len(self.policies)
        hs = self.handles[r]
        handle = self.policies[r].pick(req, [hs[w.index] for w in serving])
        if handle is not None:
            handle.in_flight += 1
            handle.remember(req.block_hashes)
        return handle
