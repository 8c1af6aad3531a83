"""The OpenAI-compatible HTTP app under schemathesis (generated from its own OpenAPI
schema) and under the hand-written bad requests of issue 19: never a 5xx, every error
OpenAI-shaped with a string `code`. The router behind the app is `FakeBackend` (which
validates as the router does), so this runs in seconds."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import schemathesis
from fake_backend import MAX_MODEL_LEN, FakeBackend
from hypothesis import HealthCheck, settings
from starlette.testclient import TestClient

from kvmesh.serve.loop import LoopThread
from kvmesh.serve.openai import create_app, serve_http_in_thread, start_http
from kvmesh.serve.openai.limits import HTTPLimits

BACKEND = FakeBackend()
APP = create_app(lambda: BACKEND, limits=HTTPLimits(max_body_bytes=64 << 10, max_prompts_per_request=4,
                                                      max_prompt_chars=2000))
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


def assert_openai_error(response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and isinstance(err["code"], str), err
    assert err["param"] is None or isinstance(err["param"], str)


@SCHEMA.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_generated_requests_never_5xx_and_errors_are_openai_shaped(case):
    response = case.call()
    assert response.status_code < 500, (case.body, response.text)
    if response.status_code >= 400:
        assert_openai_error(response)


@pytest.fixture(scope="module")
def client():
    with TestClient(APP) as c:
        yield c


def _post(client, path: str, raw: str):
    return client.post(path, content=raw.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})


# Each: (path, raw JSON body, the field the error must name). Raw strings, since JSON allows
# NaN / Infinity literals and "\ud800" escapes that json.dumps would refuse or fix.
BAD_BODIES = [
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "repetition_penalty": NaN}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "hi", "top_p": -Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4294967296}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "top_k": 99999999999}', "top_k"),
    ("/v1/completions", '{"prompt": "hi", "seed": 99999999999999999999}', "seed"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [4294967296]}', "stop_token_ids.0"),
    ("/v1/completions", '{"prompt": [-1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14, -15, -16, -17]}',
     None),
    ("/v1/completions", '{"prompt": [1, 2, 99999]}', "prompt_token_ids"),
    ("/v1/completions", '{"prompt": "\\ud800 lone surrogate"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"]}', "stop[0]"),
    ("/v1/completions", '{"prompt": ["a", "b", "c", "d", "e"]}', "prompt"),
    ("/v1/completions", '{"prompt": "' + "x" * 2001 + '"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', None),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    ("/v1/responses", '{"input": "hi", "temperature": NaN}', "temperature"),
    ("/v1/responses", '{"input": "\\ud800 lone surrogate"}', "input"),
    ("/v1/responses", '{"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}',
     "input[0].content[0].text"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 4294967296}', "max_output_tokens"),
    ("/v1/responses", '{"input": "' + "x" * 2001 + '"}', "input"),
    ("/v1/responses", '{"input": "hi", "previous_response_id": "resp_1"}', "previous_response_id"),
    ("/v1/completions", '[1, 2, 3]', None),
    ("/v1/completions", '{"prompt": "unterminated', None),
]


@pytest.mark.parametrize("path,raw,param", BAD_BODIES, ids=[b[1][:40] for b in BAD_BODIES])
def test_bad_bodies_are_400_naming_the_field(client, path, raw, param):
    r = _post(client, path, raw)
    assert r.status_code == 400, r.text
    assert_openai_error(r)
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()


def test_framework_errors_are_openai_shaped(client):
    for response, status in [(client.get("/v1/nope"), 404), (client.get("/v1/completions"), 405),
                             (client.delete("/v1/chat/completions"), 405)]:
        assert response.status_code == status
        assert_openai_error(response)


def test_body_over_the_limit_is_413_by_length_and_when_chunked(client):
    r = _post(client, "/v1/completions", json.dumps({"prompt": "x" * (70 << 10)}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it streams in
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert_openai_error(r)


def test_chat_without_max_tokens_runs_to_the_context_limit(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    sent = BACKEND.requests[-1]
    assert sent.params.max_tokens == MAX_MODEL_LEN - len(sent.prompt_token_ids)


def test_non_streaming_request_is_cancelled_when_the_client_disconnects():
    slow = FakeBackend(tokens_per_request=1000, token_delay_s=0.01)
    server = serve_http_in_thread(create_app(lambda: slow), "127.0.0.1", 0)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 1000},
                       timeout=0.5)
        deadline = time.monotonic() + 10
        while slow.cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.cancelled == 1  # the stream behind the dropped request was closed early
    finally:
        server.should_exit = True


def test_loop_server_stop_drains_then_cancels_streams_in_flight():
    """`start_http` (the router's own HTTP server): stop() returns while a stream is still
    running (the drain bound cancels it instead of waiting for its end), and the stream
    behind it is closed. The stream would run ~100 s; the timeouts are only hang guards."""
    slow = FakeBackend(tokens_per_request=10_000, token_delay_s=0.01)
    loop = LoopThread("http-stop-test")
    try:
        http = loop.run(start_http(create_app(lambda: slow), "127.0.0.1", 0, drain_s=0.5))
        body = {"prompt": "hi", "max_tokens": 10_000, "stream": True}
        got_first = threading.Event()
        lines: list[str] = []

        def stream() -> None:
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{http.port}/v1/completions", json=body,
                                  timeout=30) as r:
                    for line in r.iter_lines():
                        lines.append(line)
                        got_first.set()
            except httpx.HTTPError:
                pass  # the server ends the stream

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert got_first.wait(30)
        loop.run(http.stop(), timeout_s=60)
        deadline = time.monotonic() + 30
        while slow.cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.cancelled == 1  # the backend stream was closed before its last token
        client.join(30)
        assert not client.is_alive()
        # ... by the server's cancel, not by finishing: no final chunk, no [DONE].
        assert "data: [DONE]" not in lines and not any('"finish_reason": "length"' in x or
                                                       '"finish_reason":"length"' in x for x in lines)
        assert sum(x.startswith("data: ") for x in lines) < 10_000
    finally:
        loop.stop()


class _GatedBackend(FakeBackend):
    """Streams the first token at once and every later one only after `gate` is set."""

    def __init__(self):
        super().__init__(tokens_per_request=3)
        self.gate = threading.Event()

    async def _generate(self, request):
        first = True
        async for msg in super()._generate(request):
            if not first:
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)
            first = False
            yield msg


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": True}),
])
def test_first_token_is_streamed_before_the_second_exists(path, body):
    """The HTTP layer holds a stream back only until it knows the request did not fail
    (the first token, after chat's role chunk): never until the second token (TTFT)."""
    gated = _GatedBackend()
    server = serve_http_in_thread(create_app(lambda: gated), "127.0.0.1", 0)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        with httpx.stream("POST", f"http://127.0.0.1:{port}{path}", json=body, timeout=5) as r:
            assert r.status_code == 200
            texts = []
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "choices" in event:
                    choice = event["choices"][0]
                    text = choice.get("text") or choice.get("delta", {}).get("content")
                else:  # a Responses event
                    text = event["delta"] if event["type"] == "response.output_text.delta" else None
                if text:
                    texts.append(text)
                    gated.gate.set()  # only now can the backend produce the second token
        assert texts == ["a", "a", "a"]
    finally:
        server.should_exit = True


def test_router_replicas_share_the_http_port_with_reuse_port():
    """Router replicas on one host (or a replica draining next to its successor) bind the
    same HTTP port with SO_REUSEPORT: both serve, and the port keeps serving when one stops."""
    from kvmesh.rpc import free_port

    port = free_port()
    first = serve_http_in_thread(create_app(lambda: FakeBackend()), "127.0.0.1", port, reuse_port=True)
    second = serve_http_in_thread(create_app(lambda: FakeBackend()), "127.0.0.1", port, reuse_port=True)
    try:
        for _ in range(4):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aa"
        first.should_exit = True
        deadline = time.monotonic() + 10
        while any(srv.sockets for srv in first.servers) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first server's listening socket is closed
        assert not any(srv.sockets for srv in first.servers)
        for _ in range(4):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=10)
            assert r.status_code == 200
    finally:
        first.should_exit = second.should_exit = True
