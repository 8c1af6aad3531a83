"""End to end on a real local Ray instance: `kvmesh serve` with a disaggregated config
(1 router, 1 prefill, 1 decode replica) answers gRPC `Generate` and the official
`openai` client with the engine's offline greedy text; a redeploy that changes the
decode replica count is picked up by the router without failing in-flight requests."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
import yaml
from serve_procs import ClosedLoop, free_port, run_kvmesh, start_serve, stop_serve

from kvmesh._proto import llm_pb2, llm_pb2_grpc

PROMPTS = ["The quick brown fox", "Paged attention stores keys", "Continuous batching admits"]
CHAT = [{"role": "user", "content": "Prefix caching reuses blocks"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory):
    """The tiny model with a chat template (the tiny tokenizer has none)."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save_pretrained(path)
    return path


def serving_config(model, decode_replicas: int) -> dict:
    return {
        "name": "kvmesh-e2e",
        "engine": {"model": {"model": str(model), "max_model_len": 256},
                   "cache": {"block_size": 4, "num_blocks": 256}, "num_threads": 1},
        "router": {"resources": {"num_cpus": 0.1}, "config": {"decider": "always", "stats_interval_s": 0.2}},
        "prefill": {"replicas": 1, "resources": {"num_cpus": 0.5}},
        "decode": {"replicas": decode_replicas, "resources": {"num_cpus": 0.5}},
        "registry_ttl_s": 5,
    }


@pytest.fixture(scope="module")
def offline(chat_model):
    """Greedy outputs of the engine itself, in this process."""
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.llm import LLM

    llm = LLM(model=str(chat_model), max_model_len=256, block_size=4, num_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    chat_ids = llm.engine.encode_chat(CHAT)
    chat_text = llm.generate([chat_ids], params)[0].outputs[0].text
    return {"texts": texts, "chat": chat_text}


@pytest.fixture(scope="module")
def served(chat_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    cfg = d / "serving.yaml"
    cfg.write_text(yaml.safe_dump(serving_config(chat_model, 1)))
    s = start_serve(["--config", str(cfg), "--port", str(free_port()), "--http-port", str(free_port())],
                    d / "serve.log")
    try:
        yield s, d
    finally:
        rc = stop_serve(s)
        assert rc == 0, f"kvmesh serve exited with {rc}; log:\n{s.log.read_text()[-3000:]}"


def grpc_generate(address: str, prompt: str, max_tokens: int = MAX_TOKENS):
    with grpc.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMStub(ch)
        call = stub.Generate(llm_pb2.GenerateRequest(
            prompt=prompt, params=llm_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)), timeout=120)
        msgs = list(call)
        return msgs, dict(call.trailing_metadata())


def workers_view(http: str) -> dict:
    with urllib.request.urlopen(f"{http}/kvmesh/workers", timeout=10) as r:
        return json.loads(r.read())


def test_grpc_generate_disaggregated_matches_offline(served, offline):
    s, _ = served
    for prompt, want in zip(PROMPTS, offline["texts"]):
        msgs, trailer = grpc_generate(s.grpc, prompt)
        assert "".join(m.text for m in msgs) == want
        assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == MAX_TOKENS
        assert any("pd" in str(v) for v in trailer.values()), trailer  # prefill and decode on separate workers
    roles = sorted(w["role"] for w in workers_view(s.http)["workers"])
    assert roles == ["decode", "prefill"]


def test_openai_client_completions_and_chat(served, offline):
    from openai import BadRequestError, NotFoundError, OpenAI

    s, _ = served
    client = OpenAI(base_url=f"{s.http}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["kvmesh"]
    r = client.completions.create(model="kvmesh", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline["texts"][0]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    stream = client.completions.create(model="kvmesh", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline["texts"][1]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    c = client.chat.completions.create(model="kvmesh", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == offline["chat"]
    stream = client.chat.completions.create(model="kvmesh", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == offline["chat"]
    # OpenAI-style errors that say what to change.
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="kvmesh", prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="kvmesh", messages=CHAT, n=0)
    assert e.value.body["param"] == "n" and "n: must be" in str(e.value)


def _checked_request(address: str, max_tokens: int, expected: list[str]):
    """A request function for ClosedLoop: prompt i's greedy text must start as offline."""
    def request(i: int) -> str | None:
        msgs, _ = grpc_generate(address, PROMPTS[i % len(PROMPTS)], max_tokens)
        if msgs[-1].finish_reason != "length":
            return f"finish_reason {msgs[-1].finish_reason!r}"
        text = "".join(m.text for m in msgs)
        if not text.startswith(expected[i % len(PROMPTS)]):
            return f"wrong text {text!r}"
        return None
    return request


def _wait_decoders(http: str, n: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = workers_view(http)
        if sum(w["role"] == "decode" and w["healthy"] for w in view["workers"]) == n:
            return
        time.sleep(0.5)
    raise AssertionError(f"router never saw {n} decode workers: {workers_view(http)}")


def test_scaling_decode_replicas_without_failing_requests(served, chat_model, offline):
    s, d = served
    for replicas in (2, 1):
        cfg = d / f"serving-{replicas}.yaml"
        cfg.write_text(yaml.safe_dump(serving_config(chat_model, replicas)))
        load = ClosedLoop(_checked_request(s.grpc, 48, offline["texts"]), clients=3)
        try:
            out = run_kvmesh(["serve", "--address", "auto", "--config", str(cfg), "--detach",
                              "--port", s.grpc.rsplit(":", 1)[1], "--http-port", s.http.rsplit(":", 1)[1]])
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            _wait_decoders(s.http, replicas)
            before = load.done
            deadline = time.monotonic() + 60
            while load.done < before + 6 and time.monotonic() < deadline:  # traffic on the new placement
                time.sleep(0.2)
        finally:
            load.stop()
        assert not load.errors, load.errors[:5]
        assert load.done >= 6
        # The placement holds after the traffic: the router sees `replicas` healthy decode workers
        # (waited for, not sampled once: on 2 busy cores a worker's Stats poll can miss a beat).
        _wait_decoders(s.http, replicas, timeout=60)
