"""The OpenAI-compatible HTTP API (`python -m kvmesh.router --http-port`) over real
worker processes, with an API key: the official `openai` client, OpenAI-style errors,
batched prompts, logprobs, a client that disconnects mid-stream (its KV blocks come
back), and the same key on gRPC."""

from __future__ import annotations

import asyncio
import os
import re
import time

import grpc
import httpx
import pytest

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh_procs import spawn_router, stop, wait_idle, wait_ready, worker_stats

pytestmark = pytest.mark.timeout(300)
KEY = "sk-test-kvmesh"


@pytest.fixture(scope="module")
def router(workers, tiny_llama, tmp_path_factory):
    from kvmesh.rpc import free_port

    port = free_port()
    os.environ["KVMESH_API_KEY"] = KEY  # inherited by the router process only
    try:
        proc = spawn_router("router-http", tiny_llama, workers, tmp_path_factory.mktemp("http-logs"),
                            extra=["--http-port", str(port)])
    finally:
        del os.environ["KVMESH_API_KEY"]
    wait_ready(proc)
    try:
        yield proc.address, f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def client(base: str, key: str = KEY):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def test_api_key_on_http_and_grpc(router):
    from openai import AuthenticationError

    address, base = router
    with pytest.raises(AuthenticationError) as e:
        client(base, "wrong").models.list()
    assert "Bearer" in str(e.value)
    assert [m.id for m in client(base).models.list().data] == ["kvmesh"]
    assert httpx.get(f"{base}/health").status_code == 200  # health and metrics stay open
    with grpc.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.ListModels(llm_pb2.ListModelsRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.ListModels(llm_pb2.ListModelsRequest(), metadata=[("authorization", f"Bearer {KEY}")]).models


def test_completions_batch_logprobs_and_stop(router):
    _, base = router
    c = client(base)
    one = c.completions.create(model="kvmesh", prompt="The quick brown fox", max_tokens=6, temperature=0)
    batch = c.completions.create(model="kvmesh", prompt=["The quick brown fox", "Paged attention"], max_tokens=6,
                                 temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert batch.choices[0].text == one.choices[0].text
    assert batch.usage.completion_tokens == 12
    lp = c.completions.create(model="kvmesh", prompt="The quick brown fox", max_tokens=4, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.choices[0].logprobs.top_logprobs)
    assert "".join(lp.choices[0].logprobs.tokens) == lp.choices[0].text
    stop_at = one.choices[0].text[2:4]
    stopped = c.completions.create(model="kvmesh", prompt="The quick brown fox", max_tokens=6, temperature=0,
                                   stop=[stop_at])
    assert stopped.choices[0].finish_reason == "stop" and stop_at not in stopped.choices[0].text


def test_n_echo_logit_bias_and_prompt_logprobs(router):
    """n > 1 (greedy choices agree with n = 1; seeded choice j equals a single request
    with seed + j; usage counts the prompt once), echo with logprobs (the prompt's tokens
    first, the first one's logprob null), logit_bias forcing a token, vLLM's
    prompt_logprobs, and a streamed n = 2 reassembling to the same choices."""
    _, base = router
    c = client(base)
    prompt = "The quick brown fox"
    one = c.completions.create(model="kvmesh", prompt=prompt, max_tokens=5, temperature=0)
    three = c.completions.create(model="kvmesh", prompt=prompt, max_tokens=5, temperature=0, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert all(ch.text == one.choices[0].text for ch in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    seeded = c.completions.create(model="kvmesh", prompt=prompt, max_tokens=6, temperature=1.0, seed=7, n=2)
    for j in range(2):
        single = c.completions.create(model="kvmesh", prompt=prompt, max_tokens=6, temperature=1.0, seed=7 + j)
        assert seeded.choices[j].text == single.choices[0].text
    batch = c.completions.create(model="kvmesh", prompt=[prompt, "Paged attention"], max_tokens=3, temperature=0,
                                 n=2)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3] and batch.choices[0].text == batch.choices[1].text

    echo = c.completions.create(model="kvmesh", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    ch = echo.choices[0]
    assert ch.text.startswith(prompt) and ch.text[len(prompt):] == c.completions.create(
        model="kvmesh", prompt=prompt, max_tokens=3, temperature=0).choices[0].text
    n_prompt = echo.usage.prompt_tokens
    assert len(ch.logprobs.tokens) == n_prompt + 3 and ch.logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in ch.logprobs.token_logprobs[1:])

    forced = c.completions.create(model="kvmesh", prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={"42": 100})
    ids = httpx.post(f"{base}/tokenize", json={"prompt": forced.choices[0].text, "add_special_tokens": False},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["tokens"]
    assert ids and set(ids) == {42}

    plp = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}).json()
    entries = plp["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == plp["usage"]["prompt_tokens"]
    assert all(all(v["logprob"] <= 0 for v in e.values()) for e in entries[1:])

    texts = ["", ""]
    finishes = [None, None]
    for chunk in c.completions.create(model="kvmesh", prompt=prompt, max_tokens=5, temperature=0, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [one.choices[0].text] * 2 and finishes == ["length", "length"]


def test_constrained_logprobs_are_finite_json(router):
    """A grammar rules most tokens out (logprob -inf): the top alternatives still render
    as JSON numbers (-9999.0 at the floor, as vLLM), not -Infinity."""
    _, base = router
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"prompt": "Answer:", "max_tokens": 2, "temperature": 0, "logprobs": 5,
                         "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    values = [v for top in tops for v in top.values()]
    assert values and all(-9999.0 <= v <= 0 for v in values) and min(values) == -9999.0


def test_openai_style_errors(router):
    _, base = router
    h = {"Authorization": f"Bearer {KEY}"}
    cases = [
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "", "max_tokens": 2}, 400, "prompt"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
        ({"max_tokens": 2}, 400, "prompt"),
        ({"prompt": "x", "model": "nope"}, 404, "model"),
        ({"prompt": "x", "stream": True, "top_p": 7}, 400, "top_p"),  # before the first token: not a 200 stream
    ]
    for body, status, field in cases:
        r = httpx.post(f"{base}/v1/completions", json=body, headers=h, timeout=30)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert field in err["message"] and err["type"], (body, err)
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   headers=h, timeout=30)
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]  # the tiny tokenizer has none


def test_disconnect_mid_stream_frees_blocks(router, workers):
    _, base = router
    full = [asyncio.run(worker_stats(a)).num_free_blocks for a in workers]
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{base}/v1/completions", headers=h, timeout=60,
                      json={"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True,
                            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for i, line in enumerate(r.iter_lines()):
            if i >= 6:
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while [asyncio.run(worker_stats(a)).num_free_blocks for a in workers] != full:
        assert time.monotonic() < deadline, "KV blocks of the abandoned stream were not freed"
        time.sleep(0.2)
    asyncio.run(wait_idle(workers))


def test_metrics_endpoint(router):
    _, base = router
    text = httpx.get(f"{base}/metrics", timeout=10).text
    assert re.search(r"^kvmesh_time_to_first_token_seconds_count\{.*\} [1-9]", text, re.M), text[:2000]
    assert "kvmesh_kv_blocks_free" in text
    # vLLM's names of the same series (telemetry/vllm.py), from the same observations.
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def total(name, **labels):
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    assert total("vllm:time_to_first_token_seconds_count", model_name="kvmesh") == total(
        "kvmesh_time_to_first_token_seconds_count", model="kvmesh") > 0
    assert total("vllm:generation_tokens_total", model_name="kvmesh") == total(
        "kvmesh_request_generation_tokens_total", model="kvmesh")
    assert any(s.name == "vllm:kv_cache_usage_perc" and s.labels["model_name"] == "kvmesh" for s in samples)


def test_prompt_compression_option(router):
    """`compression` (kvmesh extension) shortens the marked context at the router; the
    usage shows both counts; a bad option is a 400 naming the field."""
    _, base = router
    h = {"Authorization": f"Bearer {KEY}"}
    passages = "\n\n".join([
        "The quick brown fox jumps over the lazy dog.",
        "Paged attention stores keys and values in fixed-size blocks.",
        "Continuous batching admits new requests at every step.",
        "Prefix caching reuses blocks whose tokens were computed before.",
    ])
    prompt = f"Answer briefly.\n<context>{passages}</context>\nQuestion: what does paged attention store?"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0,
            "compression": {"method": "passage", "target_ratio": 2}}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=h, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["original_prompt_tokens"] > usage["prompt_tokens"]
    plain = httpx.post(f"{base}/v1/completions", headers=h, timeout=60,
                       json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()["usage"]
    assert plain["prompt_tokens"] == usage["prompt_tokens_details"]["original_prompt_tokens"]
    assert "original_prompt_tokens" not in plain["prompt_tokens_details"]
    r = httpx.post(f"{base}/v1/completions", headers=h, timeout=30,
                   json={**body, "compression": {"method": "zip", "target_ratio": 2}})
    assert r.status_code == 400 and "compression" in r.json()["error"]["message"], r.text
