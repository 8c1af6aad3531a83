"""kvmesh's SLO autoscaling under a real Ray Serve: `kvmesh serve` (unified, autoscaling
1..2 replicas on kvmesh's signals, short Ray timing knobs) with a tiny model whose one
replica runs a single request at a time (`max_num_seqs: 1`). Closed-loop gRPC clients
keep several requests queued until the router sees a second worker, then stop; once
idle the deployment returns to one replica. Every request must succeed.

Ray Serve's default policy could not do this: the requests are gRPC streams from the
router to the workers, so Ray counts no ongoing requests on the worker deployment; only
`KvmeshAutoscalingPolicy` reading the replicas' queue depth scales it."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import yaml
from serve_procs import ClosedLoop, free_port, start_serve, stop_serve

from kvmesh._proto import llm_pb2, llm_pb2_grpc

CLIENTS = 6  # in flight at once: 1 running + 5 waiting on one replica -> queue pressure 5 / 4 > 1
MAX_TOKENS = 48


def serving_config(model) -> dict:
    return {
        "name": "kvmesh-autoscale",
        "engine": {"model": {"model": str(model), "max_model_len": 256},
                   "cache": {"block_size": 4, "num_blocks": 256}, "scheduler": {"max_num_seqs": 1},
                   "num_threads": 1},
        "router": {"resources": {"num_cpus": 0.1}, "config": {"stats_interval_s": 0.2}},
        "decode": {"resources": {"num_cpus": 0.5},
                   "autoscaling": {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1.0,
                                   "downscale_delay_s": 3.0, "look_back_period_s": 2.0,
                                   "metrics_interval_s": 0.5}},
        # Latency generous enough that the queue decides, and a short window so that the
        # burst's TTFT samples age out quickly once idle.
        "slo": {"ttft_s": 60.0, "tpot_s": 10.0, "window_s": 2.0},
        "registry_ttl_s": 5,
    }


def generate(address: str, prompt: str) -> list:
    with grpc.insecure_channel(address) as ch:
        call = llm_pb2_grpc.LLMStub(ch).Generate(llm_pb2.GenerateRequest(
            prompt=prompt, params=llm_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)),
            timeout=120)
        return list(call)


def unified_workers(http: str) -> int:
    with urllib.request.urlopen(f"{http}/kvmesh/workers", timeout=10) as r:
        return sum(w["role"] == "unified" and w["healthy"] for w in json.loads(r.read())["workers"])


def _request(address: str):
    """A request function for ClosedLoop: every request runs to MAX_TOKENS."""
    def request(i: int) -> str | None:
        msgs = generate(address, f"The quick brown fox {i}")
        if msgs[-1].finish_reason != "length" or msgs[-1].usage.completion_tokens != MAX_TOKENS:
            return f"finish {msgs[-1].finish_reason!r}, {msgs[-1].usage.completion_tokens} tokens"
        return None
    return request


def wait_workers(http: str, n: int, timeout_s: float) -> float:
    """Seconds until the router serves exactly `n` unified workers."""
    t0 = time.monotonic()
    while unified_workers(http) != n:
        assert time.monotonic() - t0 < timeout_s, f"router never saw {n} unified workers in {timeout_s:.0f} s"
        time.sleep(0.25)
    return time.monotonic() - t0


def test_unified_replicas_follow_the_queue_up_and_back_down(tiny_llama, tmp_path):
    cfg = tmp_path / "serving.yaml"
    cfg.write_text(yaml.safe_dump(serving_config(tiny_llama)))
    s = start_serve(["--config", str(cfg), "--port", str(free_port()), "--http-port", str(free_port())],
                    tmp_path / "serve.log")
    try:
        assert unified_workers(s.http) == 1
        load = ClosedLoop(_request(s.grpc), CLIENTS, join_s=180)
        try:
            wait_workers(s.http, 2, timeout_s=150)
            before = load.done
            deadline = time.monotonic() + 60
            while load.done < before + CLIENTS and time.monotonic() < deadline:  # traffic on both replicas
                time.sleep(0.2)
        finally:
            load.stop()
        assert not load.errors, load.errors[:5]
        assert load.done >= before + CLIENTS
        wait_workers(s.http, 1, timeout_s=150)  # idle: queue empty, latency samples aged out
        assert generate(s.grpc, "Paged attention")[-1].usage.completion_tokens == MAX_TOKENS
    finally:
        rc = stop_serve(s)
    assert rc == 0, f"kvmesh serve exited with {rc}; log:\n{s.log.read_text()[-3000:]}"
