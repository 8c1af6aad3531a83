"""Prometheus metrics: kvmesh's registry, the router's request metrics, exposition.

Everything lives in `REGISTRY`, a kvmesh-owned CollectorRegistry (never the global
default, so an embedding app's metrics and ours do not collide). The metric objects
are module globals: created once per process at import, shared by every router in
it. Per-worker numbers (KV blocks, queues, cache hits, transfers, preemptions) are
not stored here: `kvmesh.telemetry.workers` reads them from the workers' Stats at
scrape time, so one /metrics endpoint on the router covers the cluster.

Router metrics (labels):

| name | type | labels |
|---|---|---|
| kvmesh_time_to_first_token_seconds | histogram | model, mode |
| kvmesh_time_per_output_token_seconds | histogram | model, mode |
| kvmesh_inter_token_latency_seconds | histogram | model, mode |
| kvmesh_e2e_request_latency_seconds | histogram | model, mode |
| kvmesh_router_requests_running / _waiting | gauge | model |
| kvmesh_requests_finished_total | counter | model, mode, finish_reason |
| kvmesh_request_prompt_tokens_total, _cached_prompt_tokens_total, _generation_tokens_total | counter | model, mode |
| kvmesh_router_decisions_total | counter | mode |
| kvmesh_router_picks_total | counter | stage, worker |
| kvmesh_router_retries_total | counter | stage |
| kvmesh_router_scorer_score | histogram | scorer, stage |

`mode` is pd (prefill and decode on different workers) or unified (one worker did
both: no prefill workers, the decider said so, or every prefill worker failed).
`finish_reason`: stop, length, abort (client cancelled or went away), error.

vLLM's names of the same series (vllm:time_to_first_token_seconds, vllm:request_success_total,
...) are in `kvmesh.telemetry.vllm`, fed from the same observations and counters.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                  2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                480.0, 960.0)
_SCORE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

_REQ = ("model", "mode")

TTFT = Histogram("kvmesh_time_to_first_token_seconds",
                 "Time from the router receiving a request to streaming its first token.",
                 _REQ, buckets=_TTFT_BUCKETS, registry=REGISTRY)
TPOT = Histogram("kvmesh_time_per_output_token_seconds",
                 "Per request: (last token time - first token time) / (output tokens - 1).",
                 _REQ, buckets=_TOKEN_BUCKETS, registry=REGISTRY)
ITL = Histogram("kvmesh_inter_token_latency_seconds",
                "Gap between consecutive streamed messages of a request (one token, or several "
                "with speculative decoding).", _REQ, buckets=_TOKEN_BUCKETS, registry=REGISTRY)
E2E = Histogram("kvmesh_e2e_request_latency_seconds", "Time from receiving a request to its end.",
                _REQ, buckets=_E2E_BUCKETS, registry=REGISTRY)
REQUESTS_RUNNING = Gauge("kvmesh_router_requests_running",
                         "Requests in flight at the router that have streamed their first token.",
                         ("model",), registry=REGISTRY)
REQUESTS_WAITING = Gauge("kvmesh_router_requests_waiting",
                         "Requests in flight at the router still waiting for their first token.",
                         ("model",), registry=REGISTRY)
FINISHED = Counter("kvmesh_requests_finished", "Requests that ended, by finish reason "
                   "(stop, length, abort = client cancelled, error).",
                   ("model", "mode", "finish_reason"), registry=REGISTRY)
PROMPT_TOKENS = Counter("kvmesh_request_prompt_tokens", "Prompt tokens of ended requests.", _REQ,
                        registry=REGISTRY)
CACHED_PROMPT_TOKENS = Counter("kvmesh_request_cached_prompt_tokens",
                               "Prompt tokens of ended requests whose KV was reused (as reported by the "
                               "worker that prefilled them).", _REQ, registry=REGISTRY)
GENERATION_TOKENS = Counter("kvmesh_request_generation_tokens", "Tokens streamed to clients.", _REQ,
                            registry=REGISTRY)
DECISIONS = Counter("kvmesh_router_decisions", "P/D decider outcomes (pd or unified).", ("mode",),
                    registry=REGISTRY)
PICKS = Counter("kvmesh_router_picks", "Workers picked, by stage (prefill, decode).", ("stage", "worker"),
                registry=REGISTRY)
RETRIES = Counter("kvmesh_router_retries", "Worker calls that failed over to another worker.", ("stage",),
                  registry=REGISTRY)
SCORER_SCORE = Histogram("kvmesh_router_scorer_score",
                         "Each scorer's [0, 1] score (unweighted) of the worker that was picked.",
                         ("scorer", "stage"), buckets=_SCORE_BUCKETS, registry=REGISTRY)


def exposition() -> tuple[bytes, str]:
    """(body, content type) of every kvmesh metric in this process, for a /metrics route."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def start_metrics_server(port: int, host: str = "0.0.0.0"):
    """Serve REGISTRY on http://host:port/metrics from a daemon thread; returns the
    server (`.server_port`, `.shutdown()`), or None when `port` is 0 (off)."""
    if port <= 0:
        return None
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    logger.info("metrics: http://%s:%d/metrics", host, server.server_port)
    return server
