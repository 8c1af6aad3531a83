"""Tool calling and reasoning over HTTP with the official `openai` client.

The app and the templating are the real ones (the embedded SmolLM2's tokenizer and chat
template); only the router behind the app is a scripted backend that replies with a given
text in small pieces, so each test pins what the model "said" and checks what the client
gets: parsed tool_calls, streamed deltas that reassemble to the same calls,
reasoning_content, tool results sent back, and 400s that name the field."""

from __future__ import annotations

import json

import openai
import pytest

from kvmesh._proto import llm_pb2
from kvmesh.chat import ChatConfig
from kvmesh.serve.openai import Backend, create_app, serve_http_in_thread
from kvmesh.serve.openai import chat as chat_route

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TWO_CALLS = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
USER = [{"role": "user", "content": "Weather in Oslo, and the time?"}]


class ScriptedBackend(Backend):
    """The real Backend's templating, with a router that replies `reply` in 3-char pieces."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, "kvmesh")
        self.reply = ""
        self.requests: list[llm_pb2.GenerateRequest] = []

    def prompt(self, i: int = -1) -> str:
        return self.tokenizer.decode(list(self.requests[i].prompt_token_ids))

    def _stream(self, request, metadata):
        self.requests.append(request)
        return self._pieces(request)

    async def _pieces(self, request):
        text = self.reply
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or [""]
        n = request.params.n if request.params.HasField("n") else 1
        for i, piece in enumerate(pieces):
            for index in range(n):  # n > 1: every choice replies the same, their messages interleaved
                msg = llm_pb2.GenerateResponse(request_id=request.request_id, text=piece, token_ids=[5], index=index)
                if i == len(pieces) - 1:
                    msg.finish_reason = "stop"
                    msg.usage.CopyFrom(llm_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                     completion_tokens=len(pieces)))
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


@pytest.fixture(scope="module")
def default(server):
    return server()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def stream_reply(client, **kw):
    """(content, reasoning, {index: (id, name, arguments)}, finish_reason) of a streamed reply."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="kvmesh", stream=True, **kw):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for c in delta.tool_calls or []:
            if c.id is not None:
                assert c.index not in calls and c.type == "function"
                calls[c.index] = [c.id, c.function.name, ""]
            calls[c.index][2] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


def test_tools_request_just_works(default):
    """A newcomer's tools=[...] against the embedded model: the template ignores tools, so
    kvmesh injects them; the hermes-format reply comes back as tool_calls."""
    client, backend = default
    backend.reply = TWO_CALLS
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME])
    msg = r.choices[0].message
    assert calls_of(msg) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert msg.content == "I will look.\n\n"
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    assert r.choices[0].finish_reason == "tool_calls"
    prompt = backend.prompt()
    assert "# Tools" in prompt and json.dumps(WEATHER) in prompt and "<tool_call>" in prompt

    backend.reply = "It is sunny."  # a plain answer stays plain
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER])
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == ("It is sunny.", None)
    assert r.choices[0].finish_reason == "stop"


def test_streamed_calls_reassemble_to_the_same_calls(default):
    client, backend = default
    backend.reply = TWO_CALLS
    whole = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME]).choices[0].message
    content, reasoning, calls, finish = stream_reply(client, messages=USER, tools=[WEATHER, TIME])
    assert content == whole.content and reasoning == ""
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments)
                                                     for c in whole.tool_calls]
    assert finish == "tool_calls" and len({i for i, _, _ in calls.values()}) == 2


def test_tool_results_round_trip(default):
    client, backend = default
    backend.reply = TWO_CALLS
    first = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME]).choices[0].message
    backend.reply = "3 degrees in Oslo at noon."
    follow_up = [*USER, first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temp": 3}'},
                 {"role": "tool", "tool_call_id": first.tool_calls[1].id, "content": "12:00"}]
    r = client.chat.completions.create(model="kvmesh", messages=follow_up, tools=[WEATHER, TIME])
    assert r.choices[0].message.content == "3 degrees in Oslo at noon."
    prompt = backend.prompt()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\n{\"temp\": 3}\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in prompt


def test_tool_choice_none_renders_no_tools_and_parses_nothing(default):
    client, backend = default
    backend.reply = TWO_CALLS
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == TWO_CALLS and r.choices[0].message.tool_calls is None
    assert "# Tools" not in backend.prompt()


def test_parallel_tool_calls_false_keeps_one(default):
    client, backend = default
    backend.reply = TWO_CALLS
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME],
                                       parallel_tool_calls=False)
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "required": "x"}}}]},
     "tools[0].function.parameters.required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(default, kw, param):
    client, _ = default
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kvmesh", messages=USER, **kw)
    assert e.value.body["param"] == param


def test_bad_past_tool_call_is_a_400(default):
    client, _ = default
    bad = [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": ""}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kvmesh", messages=bad)
    assert "messages.1.tool_calls.0.function.name" in e.value.body["param"]


def test_required_and_named_read_the_constrained_output(server, monkeypatch):
    """With the grammar holding the output to tools.output_schema (stood in for here: the
    scripted reply is what the grammar allows), required / named replies are JSON."""
    monkeypatch.setattr(chat_route, "constrain_to_schema", lambda params, schema: True)
    client, backend = server()
    backend.reply = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME], tool_choice="required")
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Oslo"})]
    assert r.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_weather"}}
    backend.reply = '{"city": "Bergen"}'
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME], tool_choice=named)
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Bergen"})]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None  # as OpenAI: named -> stop
    _, _, calls, finish = stream_reply(client, messages=USER, tools=[WEATHER, TIME], tool_choice=named)
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", '{"city": "Bergen"}')] and finish == "stop"
    assert "You must call the function get_weather." in backend.prompt()


def test_auto_tool_choice_can_be_switched_off(server):
    client, backend = server(ChatConfig(enable_auto_tool_choice=False))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER])
    assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
    backend.reply = "hi"  # plain chat is unaffected
    assert client.chat.completions.create(model="kvmesh", messages=USER).choices[0].message.content == "hi"


def test_mistral_parser_keeps_special_tokens(server):
    client, backend = server(ChatConfig(tool_call_parser="mistral"))
    backend.reply = '[TOOL_CALLS][{"name": "now", "arguments": {}}]'
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[TIME])
    assert calls_of(r.choices[0].message) == [("now", {})]
    assert len(r.choices[0].message.tool_calls[0].id) == 9
    assert backend.requests[-1].params.skip_special_tokens is False


def test_reasoning_content(server):
    client, backend = server(ChatConfig(reasoning_parser="deepseek_r1"))
    backend.reply = "First, 2 + 2.</think>\n\nIt is 4."
    msg = client.chat.completions.create(model="kvmesh", messages=USER).choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == ("It is 4.", "First, 2 + 2.")
    content, reasoning, _, finish = stream_reply(client, messages=USER)
    assert (content, reasoning, finish) == ("It is 4.", "First, 2 + 2.", "stop")
    # with tools: the thought, then a call
    backend.reply = 'Need the weather.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    msg = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER]).choices[0].message
    assert msg.model_extra["reasoning_content"] == "Need the weather."
    assert calls_of(msg) == [("get_weather", {"city": "Oslo"})] and msg.content is None


def test_required_is_held_by_the_grammar(default):
    """tool_choice required / named send the tool schema to the grammar engine
    (SamplingParams.structured_outputs), so the call always parses."""
    client, backend = default
    backend.reply = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME], tool_choice=named)
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Oslo"})]
    schema = json.loads(backend.requests[-1].params.structured_outputs.json_schema)
    assert schema == WEATHER["function"]["parameters"]
    backend.reply = '[{"name": "now", "arguments": {}}]'
    client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME], tool_choice="required")
    assert backend.requests[-1].params.structured_outputs.json_schema
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER], tool_choice=named,
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"


def test_n_choices_each_parsed(default):
    """n > 1 on chat: every choice is read by its own parsers, whole and streamed; usage
    counts the prompt once."""
    client, backend = default
    backend.reply = TWO_CALLS
    r = client.chat.completions.create(model="kvmesh", messages=USER, tools=[WEATHER, TIME], n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert calls_of(c.message) == [("get_weather", {"city": "Oslo"}), ("now", {})]
        assert c.finish_reason == "tool_calls"
    assert r.usage.prompt_tokens == len(backend.requests[-1].prompt_token_ids)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="kvmesh", messages=USER, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] == TWO_CALLS  # without tools the reply is plain content


# -- OpenAI's legacy functions / function_call: served as tools, answered in the legacy shape ----------

FUNCTIONS = [WEATHER["function"], TIME["function"]]


def test_legacy_functions_are_served_as_tools(default):
    client, backend = default
    backend.reply = TWO_CALLS
    r = client.chat.completions.create(model="kvmesh", messages=USER, functions=FUNCTIONS, function_call="auto")
    msg, choice = r.choices[0].message, r.choices[0]
    assert msg.tool_calls is None and choice.finish_reason == "function_call"
    assert (msg.function_call.name, json.loads(msg.function_call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert json.dumps(WEATHER) in backend.prompt()  # the functions reached the prompt as tools
    name, args, finish = "", "", None
    for chunk in client.chat.completions.create(model="kvmesh", messages=USER, functions=FUNCTIONS, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.tool_calls
        if delta.function_call is not None:
            name += delta.function_call.name or ""
            args += delta.function_call.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Oslo"}, "function_call")


def test_legacy_function_round_trip_and_named_call(server, monkeypatch):
    monkeypatch.setattr(chat_route, "constrain_to_schema", lambda params, schema: True)
    client, backend = server()
    backend.reply = "3 degrees."
    past = [*USER, {"role": "assistant", "content": None,
                    "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"role": "function", "name": "get_weather", "content": '{"temp": 3}'}]
    r = client.chat.completions.create(model="kvmesh", messages=past, functions=FUNCTIONS)
    assert r.choices[0].message.content == "3 degrees." and r.choices[0].finish_reason == "stop"
    prompt = backend.prompt()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp": 3}\n</tool_response>' in prompt
    backend.reply = '{"city": "Bergen"}'
    r = client.chat.completions.create(model="kvmesh", messages=USER, functions=FUNCTIONS,
                                       function_call={"name": "get_weather"})
    assert r.choices[0].message.function_call.arguments == '{"city": "Bergen"}'
    assert "You must call the function get_weather." in backend.prompt()


def test_legacy_functions_mixed_with_tools_or_malformed_are_400s(default):
    client, _ = default
    for kw, param in (({"functions": FUNCTIONS, "tools": [WEATHER]}, "functions"),
                      ({"functions": FUNCTIONS, "function_call": "sometimes"}, "function_call"),
                      ({"functions": FUNCTIONS, "function_call": {"name": "nope"}}, "tool_choice.function.name")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="kvmesh", messages=USER, **kw)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kvmesh", messages=[*USER, {"role": "function", "content": "3"}])
    assert e.value.body["param"] == "messages[1].name"
