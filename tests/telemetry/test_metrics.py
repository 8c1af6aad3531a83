"""Prometheus metrics after real requests through the in-process cluster: router
histograms and counters (unified, P/D, one cancelled), per-worker series from Stats,
and a worker's own /metrics endpoint."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.telemetry.metrics import REGISTRY, exposition
from kvmesh.telemetry.workers import CacheSourceTracker, worker_label

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 5


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _req(ids: list[int], max_tokens: int = MAX_TOKENS) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(prompt_token_ids=ids, params=llm_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def _run(address: str, ids: list[int]) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        return sum([len(m.token_ids) async for m in llm_pb2_grpc.LLMStub(ch).Generate(_req(ids), timeout=30)])


async def _cancel_after(address: str, ids: list[int], n_msgs: int) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        call = llm_pb2_grpc.LLMStub(ch).Generate(_req(ids, max_tokens=200), timeout=30)
        for _ in range(n_msgs):
            await call.read()
        call.cancel()


def _eventually(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_router_and_worker_metrics_count_requests(cluster):
    uni, pd = cluster.uni_router.address, cluster.pd_router.address
    hist = ("kvmesh_time_to_first_token_seconds", "kvmesh_time_per_output_token_seconds",
            "kvmesh_inter_token_latency_seconds", "kvmesh_e2e_request_latency_seconds")
    before = {(h, m): value(f"{h}_count", model=m, mode=mode)
              for h in hist for m, mode in (("uni", "unified"), ("pd", "pd"))}
    scored_before = {st: value("kvmesh_router_scorer_score_count", scorer="prefix", stage=st)
                     for st in ("prefill", "decode")}
    decisions_before = {m: value("kvmesh_router_decisions_total", mode=m) for m in ("pd", "unified")}
    uni_lbl, pd_lbl = dict(model="uni", mode="unified"), dict(model="pd", mode="pd")
    counters = [("kvmesh_requests_finished_total", dict(finish_reason="length", **uni_lbl)),
                ("kvmesh_requests_finished_total", dict(finish_reason="length", **pd_lbl)),
                ("kvmesh_requests_finished_total", dict(finish_reason="abort", **pd_lbl)),
                ("kvmesh_request_prompt_tokens_total", uni_lbl),
                ("kvmesh_request_generation_tokens_total", uni_lbl),
                ("kvmesh_request_cached_prompt_tokens_total", uni_lbl)]
    counters_before = [value(n, **lbl) for n, lbl in counters]
    prompts = [list(range(200, 220)), list(range(200, 220)), list(range(230, 241))]  # 2nd hits the 1st's blocks

    async def traffic():
        for ids in prompts:
            assert await _run(uni, ids) == MAX_TOKENS
        assert await _run(pd, list(range(250, 282))) == MAX_TOKENS  # 8 blocks pulled by the decode worker
        await _cancel_after(pd, list(range(290, 300)), 2)

    cluster.loop.run(traffic())

    # The cancelled request ends at the router once its handler sees the cancellation.
    def counted():
        return [value(n, **lbl) - b for (n, lbl), b in zip(counters, counters_before)]

    _eventually(lambda: _assert_eq(counted()[2], 1))
    finished_uni, finished_pd, aborted, prompt_tokens, gen_tokens, cached_tokens = counted()
    assert (finished_uni, finished_pd, aborted) == (3, 1, 1)
    delta = {k: value(f"{k[0]}_count", model=k[1], mode="unified" if k[1] == "uni" else "pd") - v
             for k, v in before.items()}
    # Unified: 3 requests x 5 one-token messages -> 3 TTFT, 4 gaps each, 3 TPOT, 3 e2e.
    assert [delta[(h, "uni")] for h in hist] == [3, 3, 12, 3]
    # P/D: the complete request and the cancelled one (2+ tokens before the cancel).
    assert delta[("kvmesh_time_to_first_token_seconds", "pd")] == 2
    assert delta[("kvmesh_e2e_request_latency_seconds", "pd")] == 2
    assert delta[("kvmesh_inter_token_latency_seconds", "pd")] >= 4 + 1
    assert prompt_tokens == 20 + 20 + 11 and gen_tokens == 3 * MAX_TOKENS
    assert cached_tokens == 16  # the second (identical) unified prompt reused 4 full blocks of the first
    assert value("kvmesh_router_requests_running", model="pd") == 0
    assert value("kvmesh_router_requests_waiting", model="pd") == 0
    assert value("kvmesh_router_requests_running", model="uni") == 0
    assert value("kvmesh_router_decisions_total", mode="unified") - decisions_before["unified"] == 3
    assert value("kvmesh_router_decisions_total", mode="pd") - decisions_before["pd"] == 2
    # One prefill pick per P/D request, one decode pick per request; every scorer observed.
    assert value("kvmesh_router_scorer_score_count", scorer="prefix", stage="prefill") - scored_before["prefill"] == 2
    assert value("kvmesh_router_scorer_score_count", scorer="prefix", stage="decode") - scored_before["decode"] == 5
    assert value("kvmesh_router_picks_total", stage="prefill", worker=worker_label(cluster.prefill.address, "prefill")) >= 2
    assert value("kvmesh_router_scorer_score_count", scorer="kv_free", stage="decode") >= 5

    # Per-worker series from the Stats the routers poll, in the same exposition.
    body, content_type = exposition()
    assert content_type.startswith("text/plain")
    dec = {"worker": worker_label(cluster.decode.address, "decode"), "role": "decode"}
    pre = {"worker": worker_label(cluster.prefill.address, "prefill"), "role": "prefill"}

    def worker_series():
        m = scrape(exposition()[0].decode())

        def get(name, **labels):
            return m[(name, frozenset(labels.items()))]

        assert get("kvmesh_kv_transfer_bytes_total", direction="received", **dec) > 0
        assert get("kvmesh_kv_transfer_bytes_total", direction="sent", **pre) == get(
            "kvmesh_kv_transfer_bytes_total", direction="received", **dec)
        assert get("kvmesh_kv_transfer_blocks_total", direction="received", **dec) >= 8
        assert get("kvmesh_worker_cached_prompt_tokens_total", source="transfer", **dec) >= 32
        assert get("kvmesh_worker_cached_prompt_tokens_total", source="local", **dec) >= 16
        assert get("kvmesh_worker_cached_prompt_tokens_total", source="store", **dec) == 0
        assert get("kvmesh_worker_prompt_tokens_total", **dec) >= 51
        assert get("kvmesh_kv_blocks_used", **dec) == 0 and get("kvmesh_kv_blocks_free", **dec) > 0
        assert get("kvmesh_requests_running", **dec) == 0 and get("kvmesh_requests_waiting", **pre) == 0
        assert get("kvmesh_worker_healthy", **pre) == 1
        assert get("kvmesh_preemptions_total", **dec) == 0
        assert get("kvmesh_kv_store_bytes_total", direction="read", **dec) == 0
        return m

    series = _eventually(worker_series)
    # Two routers poll the same workers: one series per worker, not two. (Counted over this
    # cluster's two workers: the registry is the process's, and other tests' routers may still
    # be exporting theirs.)
    ours = {dec["worker"], pre["worker"]}
    assert sum(1 for name, labels in series
               if name == "kvmesh_kv_blocks_free" and dict(labels).get("worker") in ours) == 2


def _assert_eq(a, b):
    assert a == b, (a, b)


def test_worker_metrics_port_serves_its_own_stats(cluster):
    url = f"http://127.0.0.1:{cluster.decode_metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    m = scrape(text)
    key = ("kvmesh_kv_blocks_free", frozenset({"worker": worker_label(cluster.decode.address, "decode"), "role": "decode"}.items()))
    assert m[key] > 0
    assert any(name == "process_cpu_seconds_total" for name, _ in m)


def test_cache_source_tracker_splits_store_and_transfer():
    class Pulled:  # PulledKVLoader: transfer for staged requests, else its inner (store) loader
        loaded_tokens = 0

        def lookup(self, request, n):
            return 8

        def load(self, request, block_ids, start, num_tokens):
            if request.request_id == "pulled":
                self.loaded_tokens += num_tokens
            return num_tokens

    class Req:
        def __init__(self, rid):
            self.request_id, self.num_cached_tokens = rid, -1

    t = CacheSourceTracker(Pulled())
    pulled, stored, again = Req("pulled"), Req("stored"), Req("again")
    assert t.lookup(pulled, 4) == 8
    assert t.load(pulled, [1, 2, 3], 4, 8) == 8 and t.load(stored, [1, 2], 0, 8) == 8
    again.num_cached_tokens = 4  # re-admitted after a preemption: not its first admission
    t.load(again, [1], 0, 4)
    assert t.split("pulled", 12) == (4, 0, 8)
    assert t.split("stored", 8) == (0, 8, 0)
    assert t.split("again", 4) == (4, 0, 0) and t.split("pulled", 12) == (12, 0, 0)  # popped once read


def test_exposition_is_the_kvmesh_registry_only():
    from prometheus_client import REGISTRY as DEFAULT

    body, _ = exposition()
    assert b"kvmesh_time_to_first_token_seconds" in body
    assert DEFAULT.get_sample_value("kvmesh_router_requests_running", {"model": "uni"}) is None


def test_lora_series_from_worker_stats():
    from kvmesh._proto import worker_pb2
    from kvmesh.telemetry.workers import stats_families

    lora = worker_pb2.StatsResponse(
        address="10.0.0.1:7000", role="unified", lora_enabled=True, max_loras=4, max_lora_rank=16,
        loras=[worker_pb2.LoRAInfo(name="sql", rank=8, resident=True, num_requests=3),
               worker_pb2.LoRAInfo(name="chat", rank=16, resident=False, num_requests=0)])
    plain = worker_pb2.StatsResponse(address="10.0.0.2:7000", role="unified")
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for fam in stats_families([(lora, True), (plain, True)]) for s in fam.samples}
    w = {"worker": worker_label(lora.address, "unified"), "role": "unified"}
    assert samples[("kvmesh_lora_slots", frozenset(w.items()))] == 4
    assert samples[("kvmesh_lora_adapters", frozenset({**w, "state": "loaded"}.items()))] == 2
    assert samples[("kvmesh_lora_adapters", frozenset({**w, "state": "resident"}.items()))] == 1
    assert samples[("kvmesh_lora_requests", frozenset({**w, "adapter": "sql"}.items()))] == 3
    assert samples[("kvmesh_lora_requests", frozenset({**w, "adapter": "chat"}.items()))] == 0
    other = worker_label(plain.address, "unified")
    assert not [k for k in samples if k[0].startswith("kvmesh_lora") and ("worker", other) in k[1]]
