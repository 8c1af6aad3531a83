"""The Responses API (`POST /v1/responses`) with the official `openai` client.

Most tests run the real app and templating (the embedded SmolLM2's tokenizer and chat
template) over a scripted router that replies with a given text in small pieces, so
each test pins what the model "said": text and `output_text`, instructions, a function
call and its output sent back, reasoning items, streamed events that reassemble to the
whole response, incomplete at max_output_tokens, errors before and after the first
event, and 400s naming the Responses field. The reference for the chat translation is
the chat route itself: the same conversation sent both ways reaches the router as the
same prompt and parameters. The last test serves a tiny random model for real: greedy
`/v1/responses` text equals `/v1/chat/completions` text, and the KV blocks come back.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvmesh._proto import llm_pb2
from kvmesh.chat import ChatConfig
from kvmesh.errors import InvalidRequestError, UnavailableError
from kvmesh.serve.openai import Backend, create_app, serve_http_in_thread
from kvmesh.serve.openai.responses_input import response_format, responses_param

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, TIME)]
TWO_CALLS = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
QUESTION = "Weather in Oslo, and the time?"


class ScriptedBackend(Backend):
    """The real Backend's templating, with a router that replies `reply` in 3-char pieces,
    ending with `finish`; `fail` raises before the first piece ("before") or after two ("after")."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, "kvmesh")
        self.reply, self.finish, self.fail = "", "stop", None
        self.requests: list[llm_pb2.GenerateRequest] = []

    def prompt(self, i: int = -1) -> str:
        return self.tokenizer.decode(list(self.requests[i].prompt_token_ids))

    def _stream(self, request, metadata):
        self.requests.append(request)
        return self._pieces(request)

    async def _pieces(self, request):
        if self.fail == "before":
            raise InvalidRequestError("max_tokens", "is over this worker's limit")
        text = self.reply
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or [""]
        for i, piece in enumerate(pieces):
            if self.fail == "after" and i == 2:
                raise UnavailableError("the worker went away")
            msg = llm_pb2.GenerateResponse(request_id=request.request_id, text=piece, token_ids=[5])
            if request.params.HasField("logprobs"):
                msg.logprobs.add(token_id=5, logprob=-0.5 - i, top=[llm_pb2.TopLogprob(token_id=6, logprob=-1.0)]
                                 if request.params.logprobs else [])
            if i == len(pieces) - 1:
                msg.finish_reason = self.finish
                msg.usage.CopyFrom(llm_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                 completion_tokens=len(pieces), cached_prompt_tokens=2))
            yield msg

    async def list_models(self):
        return llm_pb2.ListModelsResponse(models=[llm_pb2.ModelInfo(id="kvmesh", max_model_len=8192)])

    async def healthy(self):
        return True


@pytest.fixture(scope="module")
def tokenizer():
    from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(None, progress=False))


@pytest.fixture(scope="module")
def server(tokenizer):
    """app(chat_config) -> (openai client, backend); servers are stopped at the end."""
    servers = []

    def start(chat_config: ChatConfig | None = None):
        backend = ScriptedBackend(tokenizer)
        srv = serve_http_in_thread(create_app(lambda: backend, chat_config=chat_config), "127.0.0.1", 0)
        servers.append(srv)
        port = srv.servers[0].sockets[0].getsockname()[1]
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30), backend

    yield start
    for srv in servers:
        srv.should_exit = True


@pytest.fixture
def default(server):
    client, backend = server()
    return client, backend


def events_of(client, **kw) -> list:
    return list(client.responses.create(model="kvmesh", stream=True, **kw))


def same_request(backend: ScriptedBackend) -> None:
    """The last two router requests (one per API) carry the same prompt and parameters."""
    a, b = backend.requests[-2], backend.requests[-1]
    assert list(a.prompt_token_ids) == list(b.prompt_token_ids)
    assert a.params == b.params


def test_text_reply_and_output_text(default):
    client, backend = default
    backend.reply = "Paris is the capital of France."
    r = client.responses.create(model="kvmesh", input="What is the capital of France?", max_output_tokens=40,
                                temperature=0, top_p=0.5, metadata={"k": "v"}, store=True,
                                extra_body={"seed": 7})
    assert r.output_text == "Paris is the capital of France."
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and r.model == "kvmesh"
    assert r.incomplete_details is None and r.error is None
    [msg] = r.output
    assert (msg.type, msg.role, msg.status) == ("message", "assistant", "completed") and msg.id.startswith("msg_")
    [part] = msg.content
    assert (part.type, part.text, part.annotations) == ("output_text", "Paris is the capital of France.", [])
    n_pieces = 11
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.input_tokens_details.cached_tokens,
            r.usage.output_tokens_details.reasoning_tokens) == (len(backend.requests[-1].prompt_token_ids),
                                                                n_pieces, 2, 0)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.max_output_tokens, r.temperature, r.top_p, r.metadata, r.store) == (40, 0, 0.5, {"k": "v"}, False)
    assert (r.tool_choice, r.tools, r.parallel_tool_calls, r.text.format.type) == ("auto", [], True, "text")
    client.chat.completions.create(model="kvmesh", messages=[{"role": "user", "content": "What is the capital of "
                                                                                            "France?"}],
                                   max_tokens=40, temperature=0, top_p=0.5, seed=7)
    same_request(backend)


def test_instructions_and_message_items_template_as_chat(default):
    client, backend = default
    backend.reply = "Bonjour."
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Say hello"}, {"type": "input_text",
                                                                                      "text": " in French."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Salut."}]},
             {"role": "developer", "content": "Be formal."},
             {"role": "user", "content": "Again."}]
    r = client.responses.create(model="kvmesh", input=items, instructions="You are a translator.")
    assert r.output_text == "Bonjour." and r.instructions == "You are a translator."
    client.chat.completions.create(model="kvmesh", messages=[
        {"role": "system", "content": "You are a translator."}, {"role": "user", "content": "Say hello in French."},
        {"role": "assistant", "content": "Salut."}, {"role": "system", "content": "Be formal."},
        {"role": "user", "content": "Again."}])
    same_request(backend)
    assert "<|im_start|>system\nYou are a translator.<|im_end|>" in backend.prompt()


def test_function_call_and_output_round_trip(default):
    client, backend = default
    backend.reply = TWO_CALLS
    first = client.responses.create(model="kvmesh", input=QUESTION, tools=[WEATHER, TIME])
    kinds = [item.type for item in first.output]
    assert kinds == ["message", "function_call", "function_call"], kinds
    assert first.output_text == "I will look.\n"
    calls = first.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls)
    assert first.status == "completed" and [t.name for t in first.tools] == ["get_weather", "now"]
    prompt = backend.prompt()
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt

    backend.reply = "3 degrees in Oslo at noon."
    follow_up = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 3}'},
                 {"type": "function_call_output", "call_id": calls[1].call_id, "output": "12:00"}]
    r = client.responses.create(model="kvmesh", input=follow_up, tools=[WEATHER, TIME])
    assert r.output_text == "3 degrees in Oslo at noon." and [i.type for i in r.output] == ["message"]
    prompt = backend.prompt()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\n{\"temp\": 3}\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in prompt
    # the chat route, sent the same conversation, asks the router for the same thing
    chat_calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for c in calls]
    client.chat.completions.create(model="kvmesh", tools=CHAT_TOOLS, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "I will look.\n",
                                                "tool_calls": chat_calls},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": '{"temp": 3}'},
        {"role": "tool", "tool_call_id": calls[1].call_id, "content": "12:00"}])
    same_request(backend)


def test_tool_choice_and_parallel_tool_calls_map_to_chat(default):
    client, backend = default
    backend.reply = '{"city": "Oslo"}'  # a named choice: the grammar holds the reply to the arguments
    r = client.responses.create(model="kvmesh", input=QUESTION, tools=[WEATHER, TIME], parallel_tool_calls=False,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert [i.type for i in r.output] == ["function_call"] and r.parallel_tool_calls is False
    assert json.loads(r.output[0].arguments) == {"city": "Oslo"}
    assert r.tool_choice.name == "get_weather"
    assert "You must call the function get_weather." in backend.prompt()
    backend.reply = TWO_CALLS
    r = client.responses.create(model="kvmesh", input=QUESTION, tools=[WEATHER], tool_choice="none")
    assert r.output_text == TWO_CALLS and "# Tools" not in backend.prompt()


def test_streamed_events_reassemble_to_the_response(default):
    client, backend = default
    for reply, kw in (("Paris is the capital of France.", {}), (TWO_CALLS, {"tools": [WEATHER, TIME]})):
        backend.reply = reply
        whole = client.responses.create(model="kvmesh", input=QUESTION, **kw)
        events = events_of(client, input=QUESTION, **kw)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        final = events[-1].response
        assert final.id == events[0].response.id and final.status == "completed"
        ids = {"id", "call_id"}  # fresh per response
        assert [i.model_dump(exclude=ids) for i in final.output] == [i.model_dump(exclude=ids) for i in whole.output]
        # deltas, per item, add up to the item
        for index, item in enumerate(final.output):
            mine = [e for e in events if getattr(e, "output_index", None) == index]
            assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
            assert mine[-1].item == item
            if item.type == "message":
                text = "".join(e.delta for e in mine if e.type == "response.output_text.delta")
                assert text == item.content[0].text == next(e.text for e in mine
                                                             if e.type == "response.output_text.done")
                assert [e.type for e in mine if "content_part" in e.type] == ["response.content_part.added",
                                                                             "response.content_part.done"]
                assert all(e.item_id == item.id for e in mine if hasattr(e, "item_id"))
            else:
                args = "".join(e.delta for e in mine if e.type == "response.function_call_arguments.delta")
                done = next(e for e in mine if e.type == "response.function_call_arguments.done")
                assert args == item.arguments == done.arguments and done.name == item.name
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text

    # the SDK's stream helper reads the same stream into its final response
    with client.responses.stream(model="kvmesh", input=QUESTION, tools=[WEATHER, TIME]) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in whole.output if c.type == "function_call"]


def test_stream_has_event_names_and_no_done_marker(default):
    client, backend = default
    backend.reply = "Hi."
    with httpx.stream("POST", f"{client.base_url}responses", json={"input": "hi", "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    blocks = [b for b in body.split("\n\n") if b]
    assert "[DONE]" not in body
    for block in blocks:
        name, data = block.split("\n")
        assert name.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]


def test_incomplete_at_max_output_tokens(default):
    client, backend = default
    backend.reply, backend.finish = "Paris is", "length"
    r = client.responses.create(model="kvmesh", input="Capital of France?", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Paris is" and r.output[0].status == "incomplete"
    assert backend.requests[-1].params.max_tokens == 3
    events = events_of(client, input="Capital of France?", max_output_tokens=3)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].content[0].text == "Paris is"


def test_reasoning_item(server):
    client, backend = server(ChatConfig(reasoning_parser="deepseek_r1"))
    backend.reply = "First, 2 + 2.</think>\n\nIt is 4."
    r = client.responses.create(model="kvmesh", input="2 + 2?")
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output[0].id.startswith("rs_")
    assert r.output[0].summary == [] and r.output[0].content[0].model_dump() == {"type": "reasoning_text",
                                                                                  "text": "First, 2 + 2."}
    assert r.output_text == "It is 4."
    events = events_of(client, input="2 + 2?")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "First, 2 + 2."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is 4."
    assert [i.model_dump(exclude={"id"}) for i in events[-1].response.output] == [
        i.model_dump(exclude={"id"}) for i in r.output]


def test_logprobs(default):
    client, backend = default
    backend.reply = "abcdef"
    r = client.responses.create(model="kvmesh", input="x", top_logprobs=1, include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert [lp.logprob for lp in lps] == [-0.5, -1.5] and len(lps[0].top_logprobs) == 1
    assert backend.requests[-1].params.logprobs == 1
    events = events_of(client, input="x", top_logprobs=1)
    assert sum(len(e.logprobs) for e in events if e.type == "response.output_text.delta") == 2


def test_errors_before_and_after_the_first_event(default):
    client, backend = default
    backend.reply, backend.fail = "Paris is the capital.", "before"
    with pytest.raises(openai.BadRequestError) as e:  # the router's error names chat's field; renamed
        client.responses.create(model="kvmesh", input="x")
    assert e.value.body["param"] == "max_output_tokens" and "max_output_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # before the first event: a plain 400, not a 200 stream
        events_of(client, input="x")
    assert e.value.body["param"] == "max_output_tokens"
    backend.fail = "after"
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(model="kvmesh", input="x")
    assert e.value.status_code == 503
    events = events_of(client, input="x")
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "the worker went away" and events[-2].code == "unavailable"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.output[0].type == "message"


@pytest.mark.parametrize("kw, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": WEATHER}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "required": "x"}}]},
     "tools[0].parameters.required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_bad_requests_are_400s_naming_the_field(default, kw, param):
    client, _ = default
    kw = {"input": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="kvmesh", **kw)
    assert e.value.body["param"] == param, e.value.body
    assert param.split("[")[0] in e.value.body["message"]


def test_field_names_and_formats_map_to_chat():
    assert responses_param("messages") == "input"
    assert responses_param("tools[3].function.parameters.properties") == "tools[3].parameters.properties"
    assert responses_param("tools[0].function") == "tools[0]"
    assert responses_param("tool_choice.function.name") == "tool_choice.name"
    assert responses_param("response_format") == "text.format"
    assert responses_param("temperature") == "temperature"
    assert response_format({"type": "text"}) is None
    assert response_format({"type": "json_object"}) == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format({"type": "json_schema", "name": "n", "schema": schema, "strict": True}) == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}


def test_route_is_behind_the_api_key(tokenizer, monkeypatch):
    monkeypatch.setenv("KVMESH_API_KEY", "sk-right")
    backend = ScriptedBackend(tokenizer)
    backend.reply = "ok"
    srv = serve_http_in_thread(create_app(lambda: backend), "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).responses.create(input="hi")
        ok = openai.OpenAI(base_url=base, api_key="sk-right", max_retries=0).responses.create(input="hi")
        assert ok.output_text == "ok"
    finally:
        srv.should_exit = True


# -- a real model behind the app --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_stack(tiny_llama, tmp_path_factory):
    """A tiny random Llama (with a chat template) served by a real worker and router, the
    app on the router's loop (InProcessBackend, as `kvmesh serve`): (openai client, engine)."""
    import shutil

    from transformers import AutoTokenizer

    from kvmesh.build import build_worker
    from kvmesh.config import EngineConfig
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.registry import StaticRegistry
    from kvmesh.router.server import RouterServer
    from kvmesh.rpc import free_port
    from kvmesh.serve.loop import LoopThread
    from kvmesh.serve.openai import InProcessBackend, start_http
    from kvmesh.worker.server import WorkerServerConfig

    path = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save_pretrained(path)
    loop = LoopThread("responses-test-loop")
    cfg = EngineConfig.from_kwargs(model=str(path), block_size=4, num_blocks=128, max_model_len=256, num_threads=1)
    port = free_port()

    async def start():
        w = build_worker(cfg, WorkerServerConfig(role="unified"))
        await w.start()
        r = RouterServer(StaticRegistry([w.address]), w.aengine.tokenizer, RouterConfig(stats_interval_s=0.1))
        await r.start(min_workers=1)
        backend = InProcessBackend(r.api, lambda: r.serving, w.aengine.tokenizer, "kvmesh")
        http = await start_http(create_app(lambda: backend), "127.0.0.1", port)
        return w, r, http

    w, r, http = loop.run(start(), timeout_s=300)  # a first run builds the native kernels
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120), w
    finally:
        loop.run(http.stop())
        loop.run(r.stop(grace=0.5))
        loop.run(w.stop(grace=0.5))
        loop.stop()


def test_greedy_responses_equal_chat_completions_on_a_real_model(tiny_chat_stack):
    """The reference test: the same greedy request through both APIs gives the same text
    and token counts (one generation path), streamed or not; the KV blocks come back."""
    import time

    client, w = tiny_chat_stack
    for max_tokens in (5, 24):
        chat = client.chat.completions.create(model="kvmesh", max_tokens=max_tokens, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}])
        r = client.responses.create(model="kvmesh", instructions="Be brief.", input="The quick brown fox",
                                    max_output_tokens=max_tokens, temperature=0)
        choice = chat.choices[0]
        assert r.usage.output_tokens == chat.usage.completion_tokens >= 1
        assert r.output_text == choice.message.content and r.output_text
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed")
        events = events_of(client, instructions="Be brief.", input="The quick brown fox",
                           max_output_tokens=max_tokens, temperature=0)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        assert events[-1].response.output_text == r.output_text and events[-1].response.status == r.status
    assert r.status == "incomplete" or chat.choices[0].finish_reason == "stop"
    engine = w.aengine.engine
    deadline = time.monotonic() + 30
    while engine.num_free_blocks != engine.num_usable_blocks:
        assert time.monotonic() < deadline, "KV blocks were not freed"
        time.sleep(0.1)
