"""The body fields that change the output, over the real HTTP server, router and worker
(in-process, on one event loop, as `kvmesh router --http-port` runs them): min_tokens,
chat_template_kwargs, add_generation_prompt, continue_final_message, documents and the
messages' name / tool_call_id are honoured; known fields kvmesh does not serve are a 400
naming them; unknown ones are ignored and logged.

The prompt the worker really computed is read back from `prompt_logprobs` (every prompt
token after the first, by id) and compared with transformers' own apply_chat_template."""

from __future__ import annotations

import logging
import shutil

import httpx
import pytest

from kvmesh.serve.loop import LoopThread

pytestmark = pytest.mark.timeout(300)

TEMPLATE = (
    "{% if documents %}{% for d in documents %}<doc>{{ d['text'] }}</doc>\n{% endfor %}{% endif %}"
    "{% if tools %}tools: {{ tools | length }}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}{% if m.get('name') %}[{{ m['name'] }}]{% endif %}"
    "{% if m.get('tool_call_id') %}#{{ m['tool_call_id'] }}{% endif %}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant{% if style %}({{ style }}){% endif %}:{% endif %}")
USER = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory):
    """The tiny model with a template that renders names, tool_call_ids, documents and a
    `style` variable (the tiny tokenizer has no template of its own)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-fields")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def stack(chat_model):
    """(base URL, tokenizer, eos id) of an HTTP server over a router over one unified worker."""
    from kvmesh.build import build_worker
    from kvmesh.cli.processes import serve_router_http
    from kvmesh.config import EngineConfig
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.registry import StaticRegistry
    from kvmesh.router.server import RouterServer
    from kvmesh.worker.server import WorkerServerConfig

    loop = LoopThread("openai-fields-test")
    started = []

    async def start():
        worker = build_worker(EngineConfig.from_kwargs(model=str(chat_model), block_size=4, num_blocks=256,
                                                       max_model_len=256, num_threads=1), WorkerServerConfig())
        await worker.start()
        started.append(worker)
        tok = worker.aengine.tokenizer
        router = RouterServer(StaticRegistry([worker.address]), tok, RouterConfig(stats_interval_s=0.2))
        await router.start(min_workers=1)
        started.append(router)
        http = await serve_router_http(router, tok, "kvmesh", "127.0.0.1", 0)
        started.append(http)
        return f"http://127.0.0.1:{http.port}", tok, worker.aengine.engine.model_info.eos_token_id

    try:
        yield loop.run(start(), timeout_s=120)
    finally:
        async def stop():
            for s in reversed(started):
                await (s.stop() if hasattr(s, "should_exit") else s.stop(grace=0.5))

        try:
            loop.run(stop(), timeout_s=60)
        finally:
            loop.stop()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json={"model": "kvmesh", **body}, timeout=60)


def chat(base: str, **body) -> dict:
    r = post(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def computed_prompt(base: str, **body) -> list[int]:
    """The prompt's token ids after the first, as the worker computed them."""
    lps = chat(base, prompt_logprobs=0, **body)["choices"][0]["prompt_logprobs"]
    return [int(next(iter(entry))) for entry in lps[1:]]


def expected_prompt(tok, messages, **kwargs) -> list[int]:
    kwargs.setdefault("add_generation_prompt", True)
    ids = tok.apply_chat_template(messages, tokenize=True, **kwargs)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    return list(ids)[1:]


def test_min_tokens_holds_eos_back(stack):
    base, _, eos = stack
    forced = {str(eos): 100}
    body = {"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0, "logit_bias": forced}
    plain = post(base, "/v1/completions", body).json()
    assert plain["usage"]["completion_tokens"] == 1 and plain["choices"][0]["finish_reason"] == "stop"
    held = post(base, "/v1/completions", {**body, "min_tokens": 4}).json()
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
    streamed = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": USER, "max_tokens": 10, "min_tokens": 3, "temperature": 0, "logit_bias": forced,
        "stream": True, "stream_options": {"include_usage": True}})
    assert '"completion_tokens":4' in streamed.text
    r = post(base, "/v1/completions", {**body, "min_tokens": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_chat_template_kwargs_reach_the_template(stack):
    base, tok, _ = stack
    got = computed_prompt(base, chat_template_kwargs={"style": "terse"})
    assert got == expected_prompt(tok, USER, style="terse")
    assert got != computed_prompt(base)
    assert "assistant(terse):" in tok.decode(got)


def test_names_tool_call_ids_and_documents_reach_the_template(stack):
    base, tok, _ = stack
    messages = [{"role": "user", "name": "ada", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_7", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}]
    docs = [{"title": "a", "text": "Foxes are quick."}]
    got = computed_prompt(base, messages=messages, tools=tools, tool_choice="none", documents=docs)
    text = tok.decode(got)
    assert "user[ada]:" in text and "tool#call_7: sunny" in text and "Foxes are quick.</doc>" in text
    native = [{**m, "tool_calls": [{**m["tool_calls"][0], "function": {"name": "w", "arguments": {}}}]}
              if m.get("tool_calls") else m for m in messages]
    assert got == expected_prompt(tok, native, documents=docs)  # tool_choice none: no tools rendered


def test_continue_final_message_and_add_generation_prompt(stack):
    base, tok, _ = stack
    prefix = [*USER, {"role": "assistant", "content": "It jumps over"}]
    got = computed_prompt(base, messages=prefix, add_generation_prompt=False, continue_final_message=True)
    assert got == expected_prompt(tok, prefix, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(got).endswith("assistant: It jumps over")
    bare = computed_prompt(base, add_generation_prompt=False)
    assert bare == expected_prompt(tok, USER, add_generation_prompt=False)
    via_kwargs = computed_prompt(base, chat_template_kwargs={"add_generation_prompt": False})
    assert via_kwargs == bare
    r = post(base, "/v1/chat/completions", {"messages": prefix, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    assert "add_generation_prompt false" in r.json()["error"]["message"]


REFUSED = [
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": USER, "bad_words": ["fox"]}, "bad_words"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs.tokenize"),
    ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}], "tools": []}, "functions"),
    ("/v1/responses", {"input": "hi", "truncation": "auto"}, "truncation"),
]


@pytest.mark.parametrize("path,body,param", REFUSED, ids=[r[2] for r in REFUSED])
def test_output_changing_fields_kvmesh_does_not_serve_are_a_400(stack, path, body, param):
    base, _, _ = stack
    r = post(base, path, {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "not" in err["message"] or "give" in err["message"]


def test_inert_values_and_unknown_fields_are_accepted_and_unknown_ones_logged(stack, caplog):
    base, _, _ = stack
    caplog.set_level(logging.WARNING, logger="kvmesh.serve.openai.fields")
    r = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "use_beam_search": False,
                                       "length_penalty": 1.0, "priority": 3, "frobnicate": 1, "zorp": "x"})
    assert r.status_code == 200, r.text
    chat(base, messages=[{**USER[0], "sparkle": True, "refusal": None}])
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "kvmesh.serve.openai.fields"]
    assert any("/v1/completions" in m and "frobnicate, zorp" in m for m in logged), logged
    assert any("messages[]" in m and "sparkle" in m and "refusal" not in m for m in logged), logged
    assert not any("priority" in m or "use_beam_search" in m for m in logged)
    caplog.clear()
    post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": 2, "zorp": "y"})
    assert not caplog.records  # the same set of names is logged once


def test_add_special_tokens_false_encodes_the_prompt_here(stack):
    base, tok, _ = stack
    body = {"prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0}
    plain = post(base, "/v1/completions", body).json()
    bare = post(base, "/v1/completions", {**body, "add_special_tokens": False}).json()
    assert bare["usage"]["prompt_tokens"] == len(tok.encode("The quick brown fox", add_special_tokens=False))
    assert bare["choices"][0]["text"] == plain["choices"][0]["text"]  # the tiny tokenizer adds no BOS
    r = post(base, "/v1/completions", {**body, "add_special_tokens": False,
                                       "compression": {"method": "passage"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
