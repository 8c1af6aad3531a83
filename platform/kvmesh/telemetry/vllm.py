"""vLLM-compatible metric names next to kvmesh's own, so dashboards, alerts, autoscalers
and endpoint pickers written against vLLM's /metrics read kvmesh unchanged.

Every `vllm:` series has the same source as a kvmesh series (no second bookkeeping that
could drift from the first):

| vllm series | type | source (kvmesh series) | labels |
|---|---|---|---|
| vllm:time_to_first_token_seconds | histogram | same observation as kvmesh_time_to_first_token_seconds | model_name |
| vllm:inter_token_latency_seconds | histogram | same observation as kvmesh_inter_token_latency_seconds | model_name |
| vllm:time_per_output_token_seconds | histogram | the same inter-token gaps (as vLLM observes it; deprecated there) | model_name |
| vllm:request_time_per_output_token_seconds | histogram | same observation as kvmesh_time_per_output_token_seconds | model_name |
| vllm:e2e_request_latency_seconds | histogram | same observation as kvmesh_e2e_request_latency_seconds | model_name |
| vllm:prompt_tokens_total | counter | kvmesh_request_prompt_tokens_total, summed over mode | model_name |
| vllm:generation_tokens_total | counter | kvmesh_request_generation_tokens_total, summed over mode | model_name |
| vllm:request_success_total | counter | kvmesh_requests_finished_total, summed over mode | model_name, finished_reason |
| vllm:num_requests_running / _waiting | gauge | kvmesh_requests_running / _waiting (a worker's batch / queue) | model_name, worker, role |
| vllm:kv_cache_usage_perc | gauge | kvmesh_kv_blocks_used / (used + free), in [0, 1] | model_name, worker, role |
| vllm:prefix_cache_queries_total | counter | kvmesh_worker_prompt_tokens_total (tokens) | model_name, worker, role |
| vllm:prefix_cache_hits_total | counter | kvmesh_worker_cached_prompt_tokens_total{source="local"} (tokens) | model_name, worker, role |
| vllm:num_preemptions_total | counter | kvmesh_preemptions_total | model_name, worker, role |
| vllm:spec_decode_num_draft_tokens_total / _num_accepted_tokens_total | counter | kvmesh_spec_decode_*_tokens_total | model_name, worker, role |

Histograms use vLLM's bucket boundaries (which differ from kvmesh's), so each latency is
observed once per histogram at the one call site in `telemetry.router`. Counters are not
kept twice: `RouterCounters` reads kvmesh's counters at scrape time. Worker series come
from the same `StatsResponse` getters as kvmesh's worker families (`telemetry.workers`).

`model_name` is the served model name (the router's model id; a worker's `--served-model-name`).
As in vLLM, requests under a LoRA adapter count under the base model's name. The
request series are the router's view (the router sees every token of every request);
the gauges and prefix-cache counters are each worker's, as vLLM's are each engine's.
vLLM counts prefix-cache queries when a request is scheduled, kvmesh when it finishes;
over a rate() window the two agree. Hits are the worker's own prefix cache only (KV
read from the shared store or pulled from a prefill worker is in kvmesh's `source` split).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvmesh.telemetry import metrics as m

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_M = ("model_name",)

TTFT = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _M,
                 buckets=TTFT_BUCKETS, registry=m.REGISTRY)
ITL = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _M,
                buckets=TOKEN_BUCKETS, registry=m.REGISTRY)
TPOT = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds "
                 "(each inter-token gap, as vLLM observes it; vLLM deprecates it for "
                 "vllm:inter_token_latency_seconds).", _M, buckets=TOKEN_BUCKETS, registry=m.REGISTRY)
REQUEST_TPOT = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
                         "per request: (last token - first token) / (tokens - 1).", _M, buckets=TOKEN_BUCKETS,
                         registry=m.REGISTRY)
E2E = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _M,
                buckets=REQUEST_LATENCY_BUCKETS, registry=m.REGISTRY)


def _sum_by(counter, keep: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """A kvmesh counter's `_total` samples summed over every label but `keep`."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[tuple(s.labels[k] for k in keep)] += s.value
    return out


class RouterCounters(Collector):
    """vllm:prompt_tokens, generation_tokens and request_success, read from kvmesh's
    router counters at scrape time (their `model` label becomes `model_name`)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, doc, source in (("vllm:prompt_tokens", "Number of prefill tokens processed.", m.PROMPT_TOKENS),
                                  ("vllm:generation_tokens", "Number of generation tokens processed.",
                                   m.GENERATION_TOKENS)):
            fam = CounterMetricFamily(name, doc, labels=_M)
            for (model,), v in sorted(_sum_by(source, ("model",)).items()):
                fam.add_metric([model], v)
            yield fam
        fam = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                  labels=[*_M, "finished_reason"])
        for (model, reason), v in sorted(_sum_by(m.FINISHED, ("model", "finish_reason")).items()):
            fam.add_metric([model, reason], v)
        yield fam

    def describe(self) -> list:
        return []


ROUTER_COUNTERS = RouterCounters()
m.REGISTRY.register(ROUTER_COUNTERS)
