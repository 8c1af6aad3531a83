"""Per-worker metrics, read at scrape time from `StatsResponse`s.

The router already polls every worker's Stats; `CLUSTER` (a prometheus Collector in
kvmesh's REGISTRY) turns the last answer of each into metric families labelled
`worker` (an opaque id, `worker_label`) and `role`, so the router's /metrics covers the
whole cluster. /metrics is open (scrapers carry no API key), so it never names a worker
address a client could dial: the id is `<role>-<8 hex>`, an HMAC of the address keyed by
the internal token (stable across routers and restarts of one deployment) or, without
one, by a per-process random key. A worker process started with --metrics-port registers its own Stats as a
source too (a series per address: the first source that has it wins).

| name | type | extra labels |
|---|---|---|
| kvmesh_worker_healthy | gauge | |
| kvmesh_requests_running, kvmesh_requests_waiting | gauge | |
| kvmesh_kv_blocks_used, kvmesh_kv_blocks_free | gauge | |
| kvmesh_kv_held_transfers | gauge | |
| kvmesh_worker_requests_total | counter | |
| kvmesh_worker_prompt_tokens_total | counter | |
| kvmesh_worker_cached_prompt_tokens_total | counter | source = local, store, transfer |
| kvmesh_preemptions_total | counter | |
| kvmesh_spec_decode_proposed_tokens_total, _accepted_tokens_total | counter | |
| kvmesh_kv_transfer_bytes_total, kvmesh_kv_transfer_blocks_total | counter | direction = sent, received |
| kvmesh_kv_pull_failures_total, kvmesh_kv_transfers_expired_total | counter | |
| kvmesh_kv_store_bytes_total | counter | direction = read, written |
| kvmesh_lora_slots | gauge | (workers with LoRA on: max_loras, the adapters one step batches) |
| kvmesh_lora_adapters | gauge | state = loaded (host memory), resident (a device slot) |
| kvmesh_lora_requests | gauge | adapter (waiting or running under it; bounded by max_cpu_loras) |

The same values under vLLM's names (vllm:num_requests_running, kv_cache_usage_perc,
prefix_cache_queries / hits, ...; see kvmesh.telemetry.vllm) come from the same getters.

Prefix hit rate of a worker: rate(cached_prompt_tokens_total) / rate(prompt_tokens_total),
split by where the reused KV came from.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh._proto import worker_pb2
from kvmesh.telemetry.metrics import REGISTRY

logger = logging.getLogger(__name__)

Stats = worker_pb2.StatsResponse
# One source: the (stats, healthy) pairs it knows, read at scrape time.
StatsSource = Callable[[], Iterable[tuple[Stats, bool]]]



# Getters shared by kvmesh's families and their vllm: names (one source for both).
def _running(s: Stats) -> float:
    return s.num_running


def _waiting(s: Stats) -> float:
    return s.num_waiting


def _blocks_used(s: Stats) -> float:
    return s.num_usable_blocks - s.num_free_blocks


def _blocks_free(s: Stats) -> float:
    return s.num_free_blocks


def _kv_usage(s: Stats) -> float:
    """Used / (used + free) KV blocks, in [0, 1] (vllm:kv_cache_usage_perc)."""
    used, free = _blocks_used(s), _blocks_free(s)
    return used / (used + free) if used + free > 0 else 0.0


def _prompt_tokens(s: Stats) -> float:
    return s.prompt_tokens_total


def _local_hits(s: Stats) -> float:
    return s.cached_prompt_tokens_local


def _preemptions(s: Stats) -> float:
    return s.num_preemptions


def _spec_proposed(s: Stats) -> float:
    return s.spec_proposed_tokens


def _spec_accepted(s: Stats) -> float:
    return s.spec_accepted_tokens


_GAUGES: tuple[tuple[str, str, Callable[[Stats], float]], ...] = (
    ("kvmesh_requests_running", "Requests in the worker's running batch.", _running),
    ("kvmesh_requests_waiting", "Requests queued at the worker, not yet admitted.", _waiting),
    ("kvmesh_kv_blocks_used", "KV blocks in use by requests (usable - free).", _blocks_used),
    ("kvmesh_kv_blocks_free", "KV blocks free, evictable prefix-cached blocks included.", _blocks_free),
    ("kvmesh_kv_held_transfers", "Prefilled KV held for a decode worker to pull.",
     lambda s: s.num_held_transfers),
)
_COUNTERS: tuple[tuple[str, str, Callable[[Stats], float]], ...] = (
    ("kvmesh_worker_requests", "Requests the worker finished.", lambda s: s.requests_total),
    ("kvmesh_worker_prompt_tokens", "Prompt tokens of requests the worker finished.", _prompt_tokens),
    ("kvmesh_preemptions", "Requests preempted (KV freed, recomputed later) for lack of KV blocks.", _preemptions),
    ("kvmesh_spec_decode_proposed_tokens", "Draft tokens proposed by speculative decoding (0 when it is off).",
     _spec_proposed),
    ("kvmesh_spec_decode_accepted_tokens", "Draft tokens the target model accepted; acceptance rate = "
     "rate(accepted) / rate(proposed).", _spec_accepted),
    ("kvmesh_kv_pull_failures", "KV pulls that failed (the prompt was recomputed).",
     lambda s: s.kv_pull_failures),
    ("kvmesh_kv_transfers_expired", "Held transfers released by TTL, never pulled.",
     lambda s: s.transfers_expired),
)
_SPLIT_COUNTERS: tuple[tuple[str, str, str, tuple[tuple[str, Callable[[Stats], float]], ...]], ...] = (
    ("kvmesh_worker_cached_prompt_tokens",
     "Prompt tokens of finished requests whose KV was reused, by source: local prefix cache, shared "
     "store, or pulled from a prefill worker.", "source",
     (("local", _local_hits), ("store", lambda s: s.cached_prompt_tokens_store),
      ("transfer", lambda s: s.cached_prompt_tokens_transfer))),
    ("kvmesh_kv_transfer_bytes", "KV bytes moved between workers by PullKV.", "direction",
     (("sent", lambda s: s.kv_sent_bytes), ("received", lambda s: s.kv_received_bytes))),
    ("kvmesh_kv_transfer_blocks", "KV blocks moved between workers by PullKV.", "direction",
     (("sent", lambda s: s.kv_sent_blocks), ("received", lambda s: s.kv_received_blocks))),
    ("kvmesh_kv_store_bytes", "KV bytes read from / written to the shared KV store.", "direction",
     (("read", lambda s: s.kv_store_bytes_read), ("written", lambda s: s.kv_store_bytes_written))),
)
# The vllm: names of the same values (kvmesh.telemetry.vllm); labelled model_name too.
_VLLM_GAUGES: tuple[tuple[str, str, Callable[[Stats], float]], ...] = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", _running),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", _waiting),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", _kv_usage),
)
_VLLM_COUNTERS: tuple[tuple[str, str, Callable[[Stats], float]], ...] = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", _prompt_tokens),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", _local_hits),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", _preemptions),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", _spec_proposed),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", _spec_accepted),
)
_LABELS = ["worker", "role"]
_VLLM_LABELS = ["model_name", *_LABELS]
# Keys the worker label; KVMESH_INTERNAL_TOKEN is the deployment's shared secret (rpc/internal_auth.py).
_LABEL_KEY = os.environ.get("KVMESH_INTERNAL_TOKEN", "").encode() or os.urandom(32)


def worker_label(address: str, role: str = "") -> str:
    """The `worker` label value of a worker: opaque, stable for a given address."""
    digest = hmac.new(_LABEL_KEY, address.encode(), hashlib.sha256).hexdigest()[:8]
    return f"{role or 'worker'}-{digest}"


def stats_families(items: Iterable[tuple[Stats, bool]]) -> list:
    """Metric families of the given workers' stats (the first entry per address wins)."""
    healthy = GaugeMetricFamily("kvmesh_worker_healthy", "1 when the router routes to the worker.",
                                labels=_LABELS)
    gauges = [(GaugeMetricFamily(n, doc, labels=_LABELS), get) for n, doc, get in _GAUGES]
    counters = [(CounterMetricFamily(n, doc, labels=_LABELS), get) for n, doc, get in _COUNTERS]
    vllm = [(GaugeMetricFamily(n, doc, labels=_VLLM_LABELS), get) for n, doc, get in _VLLM_GAUGES]
    vllm += [(CounterMetricFamily(n, doc, labels=_VLLM_LABELS), get) for n, doc, get in _VLLM_COUNTERS]
    split = [(CounterMetricFamily(n, doc, labels=[*_LABELS, label]), parts)
             for n, doc, label, parts in _SPLIT_COUNTERS]
    lora_slots = GaugeMetricFamily("kvmesh_lora_slots", "LoRA adapters the worker's device slots hold "
                                   "(max_loras): the most distinct adapters one step batches.", labels=_LABELS)
    lora_adapters = GaugeMetricFamily("kvmesh_lora_adapters", "LoRA adapters the worker holds: loaded in host "
                                      "memory, resident in a device slot.", labels=[*_LABELS, "state"])
    lora_requests = GaugeMetricFamily("kvmesh_lora_requests", "Requests waiting or running under each LoRA "
                                      "adapter the worker holds.", labels=[*_LABELS, "adapter"])
    seen: set[str] = set()
    for stats, ok in items:
        if stats.address in seen:
            continue
        seen.add(stats.address)
        labels = [worker_label(stats.address, stats.role), stats.role]
        healthy.add_metric(labels, 1.0 if ok else 0.0)
        for fam, get in (*gauges, *counters):
            fam.add_metric(labels, get(stats))
        for fam, get in vllm:
            fam.add_metric([stats.model_id, *labels], get(stats))
        for fam, parts in split:
            for value, get in parts:
                fam.add_metric([*labels, value], get(stats))
        if stats.lora_enabled:
            lora_slots.add_metric(labels, stats.max_loras)
            lora_adapters.add_metric([*labels, "loaded"], len(stats.loras))
            lora_adapters.add_metric([*labels, "resident"], sum(i.resident for i in stats.loras))
            for info in stats.loras:
                lora_requests.add_metric([*labels, info.name], info.num_requests)
    return [healthy, *(f for f, _ in gauges), *(f for f, _ in counters), *(f for f, _ in split),
            lora_slots, lora_adapters, lora_requests, *(f for f, _ in vllm)]


class ClusterCollector(Collector):
    """Per-worker families from every registered source (router pools, local workers)."""

    def __init__(self) -> None:
        self._sources: dict[object, StatsSource] = {}
        self._lock = threading.Lock()

    def add(self, key: object, source: StatsSource) -> None:
        with self._lock:
            self._sources[key] = source

    def remove(self, key: object) -> None:
        with self._lock:
            self._sources.pop(key, None)

    def collect(self) -> Iterator:
        with self._lock:
            sources = list(self._sources.values())
        if not sources:
            return

        def items() -> Iterator[tuple[Stats, bool]]:
            for source in sources:
                try:
                    yield from source()
                except Exception:  # a scrape never fails because one source did
                    logger.exception("metrics: a worker stats source failed")

        yield from stats_families(items())

    def describe(self) -> list:
        return []  # names depend on sources registered later; nothing to check up front


CLUSTER = ClusterCollector()
REGISTRY.register(CLUSTER)


def pool_source(pool) -> StatsSource:
    """The router's view: each worker's last polled Stats (kvmesh.router.registry.WorkerPool)."""

    def items() -> Iterator[tuple[Stats, bool]]:
        for w in pool.handles():
            if w.stats is not None:
                yield w.stats, w.healthy()

    return items


def loop_source(fetch: Callable[[], object], loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0
                ) -> StatsSource:
    """A worker's own Stats, computed on its event loop (between engine steps) when the
    scrape thread asks; the previous answer is reused while a long step blocks it.
    `fetch` is an async function returning a StatsResponse."""
    last: list[Stats] = []

    def items() -> Iterator[tuple[Stats, bool]]:
        try:
            stats = asyncio.run_coroutine_threadsafe(fetch(), loop).result(timeout_s)
            last[:] = [stats]
        except Exception as exc:
            logger.debug("metrics: fresh worker stats unavailable (%r); using the last ones", exc)
        for stats in last:
            yield stats, True

    return items


class CacheSourceTracker:
    """The scheduler's KVLoader, wrapped to note where each request's reused prompt KV
    came from at its first admission: pulled from a prefill worker (the wrapped
    PulledKVLoader) or the shared store (its inner loader). Local prefix-cache hits
    are the rest of `RequestOutput.num_cached_tokens`.

    `load` runs in the engine's step thread, `split` on the event loop; entries are
    popped when read and capped, so aborted requests cannot grow it without bound.
    """

    _CAPACITY = 4096

    def __init__(self, loader) -> None:
        self.loader = loader
        self._first: OrderedDict[str, tuple[int, int]] = OrderedDict()  # request id -> (store, transfer)

    def lookup(self, request, num_local_tokens: int) -> int:
        return self.loader.lookup(request, num_local_tokens)

    def load(self, request, block_ids: list[int], start: int, num_tokens: int) -> int:
        before = self.loader.loaded_tokens
        got = self.loader.load(request, block_ids, start, num_tokens)
        if request.num_cached_tokens < 0:  # first admission: the scheduler sets it right after this
            transfer = self.loader.loaded_tokens - before
            self._first[request.request_id] = (got - transfer, transfer)
            while len(self._first) > self._CAPACITY:
                self._first.popitem(last=False)
        return got

    def split(self, request_id: str, num_cached_tokens: int) -> tuple[int, int, int]:
        """(local, store, transfer) tokens of a finished request's num_cached_tokens."""
        store, transfer = self._first.pop(request_id, (0, 0))
        return max(num_cached_tokens - store - transfer, 0), store, transfer
