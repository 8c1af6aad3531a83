"""vLLM-compatible series (telemetry/vllm.py) on a real /metrics after real requests through
the in-process cluster: every vllm: series the issue names is there, with vLLM's buckets,
and its value equals the kvmesh series it is derived from, in the same scrape."""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import MAX_TOKENS, _run

from kvmesh.telemetry import vllm
from kvmesh.telemetry.workers import worker_label

pytestmark = pytest.mark.timeout(120)

REQUIRED = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
            "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
            "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:request_success",
            "vllm:num_preemptions", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"]


class Scrape:
    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def get(self, name: str, **labels) -> float:
        """The sum of `name`'s samples whose labels include `labels`."""
        hits = [s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items()]
        assert hits, f"no sample {name}{labels}"
        return sum(hits)

    def value(self, name: str, **labels) -> float:
        """Like get, 0 when there is no such sample yet."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def buckets(self, name: str, **labels) -> list[float]:
        les = {float(s.labels["le"]) for s in self.samples
               if s.name == f"{name}_bucket" and labels.items() <= s.labels.items()}
        return sorted(les)


def scrape(port: int) -> Scrape:
    return Scrape(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def test_vllm_series_match_kvmeshs_own_after_real_requests(cluster):
    before = scrape(cluster.decode_metrics_port)
    prompts = [list(range(100, 124)), list(range(100, 124)), list(range(130, 139))]  # the 2nd reuses the 1st's KV

    async def traffic():
        for ids in prompts:
            assert await _run(cluster.uni_router.address, ids) == MAX_TOKENS
        assert await _run(cluster.pd_router.address, list(range(150, 170))) == MAX_TOKENS

    cluster.loop.run(traffic())
    m = scrape(cluster.decode_metrics_port)  # the decode worker's own /metrics port (one process, one registry)
    for name in REQUIRED:
        assert name in m.families, name

    # Request series (the router's view): model -> model_name, summed over kvmesh's `mode`.
    for model in ("uni", "pd"):
        own = {"model": model}
        compat = {"model_name": model}
        for ours, theirs in (("kvmesh_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
                             ("kvmesh_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
                             ("kvmesh_inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
                             ("kvmesh_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"),
                             ("kvmesh_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds")):
            assert m.get(f"{theirs}_count", **compat) == m.get(f"{ours}_count", **own), theirs
            assert math.isclose(m.get(f"{theirs}_sum", **compat), m.get(f"{ours}_sum", **own), rel_tol=1e-9), theirs
        for ours, theirs in (("kvmesh_request_prompt_tokens_total", "vllm:prompt_tokens_total"),
                             ("kvmesh_request_generation_tokens_total", "vllm:generation_tokens_total")):
            assert m.get(theirs, **compat) == m.get(ours, **own)
        reasons = defaultdict(float)
        for s in m.samples:
            if s.name == "kvmesh_requests_finished_total" and s.labels["model"] == model:
                reasons[s.labels["finish_reason"]] += s.value
        for reason, n in reasons.items():
            assert m.get("vllm:request_success_total", finished_reason=reason, **compat) == n
    # This test's traffic, counted once.
    assert m.value("vllm:prompt_tokens_total", model_name="uni") - before.value(
        "vllm:prompt_tokens_total", model_name="uni") == 24 + 24 + 9
    assert m.value("vllm:request_success_total", model_name="uni", finished_reason="length") - before.value(
        "vllm:request_success_total", model_name="uni", finished_reason="length") == 3
    assert m.get("vllm:generation_tokens_total", model_name="pd") >= MAX_TOKENS
    # vLLM's bucket boundaries, not kvmesh's.
    assert m.buckets("vllm:time_to_first_token_seconds", model_name="uni") == [*vllm.TTFT_BUCKETS, math.inf]
    assert m.buckets("vllm:inter_token_latency_seconds", model_name="uni") == [*vllm.TOKEN_BUCKETS, math.inf]
    assert m.buckets("vllm:e2e_request_latency_seconds", model_name="uni") == [*vllm.REQUEST_LATENCY_BUCKETS,
                                                                               math.inf]

    # Worker series: the same Stats getters, with the worker's served model name.
    for w, role in ((cluster.decode, "decode"), (cluster.prefill, "prefill")):
        lbl = {"worker": worker_label(w.address, role), "role": role}
        compat = {"model_name": "kvmesh", **lbl}
        assert m.get("vllm:num_requests_running", **compat) == m.get("kvmesh_requests_running", **lbl)
        assert m.get("vllm:num_requests_waiting", **compat) == m.get("kvmesh_requests_waiting", **lbl)
        used, free = m.get("kvmesh_kv_blocks_used", **lbl), m.get("kvmesh_kv_blocks_free", **lbl)
        assert m.get("vllm:kv_cache_usage_perc", **compat) == pytest.approx(used / (used + free))
        assert 0 <= m.get("vllm:kv_cache_usage_perc", **compat) <= 1
        assert m.get("vllm:prefix_cache_queries_total", **compat) == m.get("kvmesh_worker_prompt_tokens_total", **lbl)
        assert m.get("vllm:prefix_cache_hits_total", **compat) == m.get(
            "kvmesh_worker_cached_prompt_tokens_total", source="local", **lbl)
        assert m.get("vllm:num_preemptions_total", **compat) == m.get("kvmesh_preemptions_total", **lbl)
        assert m.get("vllm:spec_decode_num_draft_tokens_total", **compat) == m.get(
            "kvmesh_spec_decode_proposed_tokens_total", **lbl)
    dec = {"model_name": "kvmesh", "worker": worker_label(cluster.decode.address, "decode")}
    assert m.get("vllm:prefix_cache_hits_total", **dec) >= 20  # the repeated prompt's 5 full blocks, locally
    assert m.get("vllm:prefix_cache_queries_total", **dec) >= 24 + 24 + 9
