"""`http_ingress: ray_proxy` on a real local Ray instance: the OpenAI API reached through
Ray Serve's HTTP proxy (the path the Kubernetes operator renders, where KubeRay's
readiness probes need a proxy on every pod) streams the engine's offline greedy text,
and the router's worker view answers on the same port. The default ingress (the router
replicas serving HTTP themselves) is covered by test_ray_serve.py."""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml
from serve_procs import free_port, start_serve, stop_serve

PROMPT = "Paged attention stores keys"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-proxy")
    cfg = d / "serving.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "kvmesh-proxy",
        "engine": {"model": {"model": str(tiny_llama), "max_model_len": 256},
                   "cache": {"block_size": 4, "num_blocks": 128}, "num_threads": 1},
        "router": {"resources": {"num_cpus": 0.1}},
        "decode": {"replicas": 1, "resources": {"num_cpus": 0.5}},
        "http_ingress": "ray_proxy",
    }))
    s = start_serve(["--config", str(cfg), "--port", str(free_port()), "--http-port", str(free_port())],
                    d / "serve.log")
    try:
        yield s
    finally:
        rc = stop_serve(s)
        assert rc == 0, f"kvmesh serve exited with {rc}; log:\n{s.log.read_text()[-3000:]}"


def test_openai_stream_through_the_ray_proxy_matches_offline(served, tiny_llama):
    from openai import OpenAI

    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.llm import LLM

    want = LLM(model=str(tiny_llama), max_model_len=256, block_size=4, num_blocks=128).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].outputs[0].text
    client = OpenAI(base_url=f"{served.http}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model="kvmesh", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    with urllib.request.urlopen(f"{served.http}/kvmesh/workers", timeout=10) as r:
        assert [w["role"] for w in json.loads(r.read())["workers"]] == ["unified"]
        assert r.headers.get("x-request-id")  # stamped by Ray Serve's proxy: the request went through it
