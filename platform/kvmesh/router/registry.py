"""Worker discovery and the router's live view of each worker.

A `WorkerRegistry` only answers "which addresses exist" (static list, DNS name of a
headless Service, in-process registry for local mode; keys in Ray's GCS store under Ray Serve, serve/registry.py).
`WorkerPool` turns addresses into `WorkerHandle`s (channel, stub, last Stats, affinity
memory) and polls Stats.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import grpc

from kvmesh._proto import worker_pb2, worker_pb2_grpc
from kvmesh.router.kv_index import KVIndex
from kvmesh.rpc.internal_auth import InternalAuth

logger = logging.getLogger(__name__)

# How long an adapter this router sent to (or loaded on) a worker counts as held there
# before the worker's Stats confirm it (the load runs with the request; Stats lag it).
LORA_ROUTED_TTL_S = 10.0


class WorkerRegistry(Protocol):
    def addresses(self) -> list[str]:
        """Current worker addresses ("host:port")."""
        ...


class StaticRegistry:
    """A fixed list of addresses (tests, hand-written deployments)."""

    def __init__(self, addresses: Sequence[str]):
        self._addresses = list(addresses)

    def addresses(self) -> list[str]:
        return list(self._addresses)


class DnsRegistry:
    """Every address a DNS name resolves to, at one port: a Kubernetes headless Service
    (`<svc>.<namespace>.svc`) lists its ready pods' IPs. Resolved at most every
    `refresh_s` (the Stats poll calls `addresses()` often); a failed lookup keeps the
    last answer, so a DNS hiccup does not empty the pool."""

    def __init__(self, host: str, port: int, refresh_s: float = 5.0):
        self.host, self.port, self.refresh_s = host, port, refresh_s
        self._addresses: list[str] = []
        self._at = float("-inf")

    def addresses(self) -> list[str]:
        now = time.monotonic()
        if now - self._at >= self.refresh_s:
            self._at = now
            try:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                logger.warning("DNS lookup of %s failed (%s); keeping %d workers", self.host, exc,
                               len(self._addresses))
            else:
                ips = sorted({info[4][0] for info in infos})
                self._addresses = [f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}" for ip in ips]
        return list(self._addresses)


class InProcessRegistry:
    """Workers register and unregister themselves (local mode, one process or launcher)."""

    def __init__(self) -> None:
        self._addresses: dict[str, None] = {}

    def register(self, address: str) -> None:
        self._addresses[address] = None

    def unregister(self, address: str) -> None:
        self._addresses.pop(address, None)

    def addresses(self) -> list[str]:
        return list(self._addresses)


class WorkerHandle:
    """One worker as the router sees it."""

    def __init__(self, address: str, affinity_capacity: int, auth: InternalAuth | None = None):
        self.address = address
        self._auth = auth or InternalAuth()  # internal token / mTLS of calls to this worker
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self.stats: worker_pb2.StatsResponse | None = None
        self.in_flight = 0
        self.unhealthy_until = 0.0
        # Hashes this router sent here (LRU) and the ones the worker reported cached.
        self._routed: OrderedDict[bytes, None] = OrderedDict()
        self._capacity = affinity_capacity
        self._reported: frozenset[bytes] = frozenset()
        # Exact: what the worker's KV events say it holds (filled when the pool asks for events).
        self.kv_index = KVIndex()
        # LoRA adapters: the worker's own report (Stats, or a LoadLoRA reply) by name, and
        # the ones this router sent here lately (monotonic time; see LORA_ROUTED_TTL_S).
        self.loras: dict[str, worker_pb2.LoRAInfo] = {}
        self._lora_routed: dict[str, float] = {}

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        # Created on first use: an aio channel belongs to the running event loop.
        if self._stub is None:
            self._channel = self._auth.channel(self.address)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def role(self) -> str:
        return self.stats.role if self.stats is not None else ""

    def healthy(self, now: float | None = None) -> bool:
        return self.stats is not None and (now or time.monotonic()) >= self.unhealthy_until

    def mark_unhealthy(self, cooldown_s: float) -> None:
        self.unhealthy_until = time.monotonic() + cooldown_s

    @property
    def load(self) -> int:
        """Requests queued or running; the router's own count covers Stats' staleness."""
        reported = self.stats.num_waiting + self.stats.num_running if self.stats is not None else 0
        return max(reported, self.in_flight)

    def prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt this worker likely has cached."""
        n = 0
        for h in hashes:
            if h not in self._routed and h not in self._reported:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[bytes]) -> None:
        if self._capacity <= 0:
            return
        for h in hashes:
            self._routed[h] = None
            self._routed.move_to_end(h)
        while len(self._routed) > self._capacity:
            self._routed.popitem(last=False)

    @property
    def lora_enabled(self) -> bool:
        return self.stats is not None and self.stats.lora_enabled

    def lora_level(self, name: str) -> float:
        """1: the adapter is resident on the device; 0.75: in host memory, or sent here by
        this router within LORA_ROUTED_TTL_S; 0: not here (a request would load it)."""
        info = self.loras.get(name)
        if info is not None:
            return 1.0 if info.resident else 0.75
        t = self._lora_routed.get(name)
        return 0.75 if t is not None and time.monotonic() - t < LORA_ROUTED_TTL_S else 0.0

    def holds_lora(self, name: str) -> bool:
        return self.lora_level(name) > 0

    def note_lora(self, name: str, info: worker_pb2.LoRAInfo | None = None) -> None:
        """This router sent a request for `name` here (or loaded it: `info`)."""
        self._lora_routed[name] = time.monotonic()
        if info is not None:
            self.loras[name] = info

    def forget_lora(self, name: str) -> None:
        self.loras.pop(name, None)
        self._lora_routed.pop(name, None)

    def update(self, stats: worker_pb2.StatsResponse) -> None:
        self.stats = stats
        self.loras = {i.name: i for i in stats.loras}
        now = time.monotonic()
        self._lora_routed = {n: t for n, t in self._lora_routed.items()
                             if n not in self.loras and now - t < LORA_ROUTED_TTL_S}
        self._reported = frozenset(stats.cached_block_hashes)
        self.kv_index.apply_stats(stats)


class WorkerPool:
    """Handles for the registry's workers, refreshed by polling Stats."""

    def __init__(self, registry: WorkerRegistry, affinity_capacity: int, max_block_hashes: int,
                 stats_timeout_s: float, unhealthy_cooldown_s: float, kv_events: bool = False,
                 auth: InternalAuth | None = None):
        self.registry = registry
        self.auth = auth or InternalAuth()  # credentials of every call to a worker
        self.kv_events = kv_events  # ask workers for KV events (WorkerHandle.kv_index)
        self.workers: dict[str, WorkerHandle] = {}
        self.affinity_capacity = affinity_capacity
        self.max_block_hashes = max_block_hashes
        self.stats_timeout_s = stats_timeout_s
        self.unhealthy_cooldown_s = unhealthy_cooldown_s
        self.fingerprint: str | None = None  # of the first worker seen; others must match
        self.block_size: int | None = None
        # Workers that left the registry (scale-down) but still stream requests: no new
        # work goes to them, their channels close once their last stream ends.
        self.retiring: dict[str, WorkerHandle] = {}

    def handles(self) -> list[WorkerHandle]:
        return list(self.workers.values())

    async def refresh(self) -> None:
        addresses = self.registry.addresses()
        for gone in set(self.workers) - set(addresses):
            self.retiring[gone] = self.workers.pop(gone)
        for addr, w in list(self.retiring.items()):
            if w.in_flight <= 0 or addr in addresses:
                del self.retiring[addr]
                if addr in addresses:
                    self.workers[addr] = w  # came back (a missed heartbeat, not a scale-down)
                else:
                    await w.close()
        for addr in addresses:
            if addr not in self.workers:
                self.workers[addr] = WorkerHandle(addr, self.affinity_capacity, self.auth)
        await asyncio.gather(*(self._poll(w) for w in self.workers.values()))

    async def _poll(self, w: WorkerHandle) -> None:
        try:
            cursor = w.kv_index.cursor() if self.kv_events else {}
            stats = await w.stub.Stats(worker_pb2.StatsRequest(max_block_hashes=self.max_block_hashes, **cursor),
                                       timeout=self.stats_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.stats is not None:
                # Busy, not gone: a worker deep in a long prefill answers Stats late. Skipping
                # it would turn overload into failed requests; keep routing on its last stats.
                logger.debug("worker %s answered Stats late; using its previous stats", w.address)
                return
            if w.stats is not None and w.healthy():
                logger.warning("worker %s missed its Stats poll (%s); skipping it for now", w.address, exc.code().name)
            w.mark_unhealthy(self.unhealthy_cooldown_s)
            return
        if self.fingerprint is None:
            self.fingerprint, self.block_size = stats.model_fingerprint, stats.block_size
        elif stats.model_fingerprint != self.fingerprint:
            logger.error("worker %s serves a different model (fingerprint %s, expected %s); not routing to it",
                         w.address, stats.model_fingerprint, self.fingerprint)
            w.mark_unhealthy(self.unhealthy_cooldown_s)
            return
        w.update(stats)

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    async def wait_ready(self, timeout_s: float, min_workers: int = 1) -> None:
        """Poll until `min_workers` workers answered Stats (startup)."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh()
            if sum(w.healthy() for w in self.workers.values()) >= min_workers:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {min_workers} of {self.registry.addresses()} answered Stats "
                                   f"within {timeout_s}s; are the workers running?")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        for w in [*self.workers.values(), *self.retiring.values()]:
            await w.close()
