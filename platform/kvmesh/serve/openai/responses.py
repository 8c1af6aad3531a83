"""`POST /v1/responses`: OpenAI's Responses API, text and function tools, over the chat path.

A thin layer: the body is read into a chat request (responses_input.py), checked,
templated and sampled by chat.py's `prepare_chat` (the same tools, tool_choice, reasoning
parsers and limits as `/v1/chat/completions`), and the reply's parsed deltas
(`parsed_deltas`) are rendered as Responses output items (responses_output.py): a
`reasoning` item for the reasoning parser's text, a `message` item of `output_text`, a
`function_call` item per tool call. A reply cut at max_output_tokens is `incomplete` with
`incomplete_details.reason` max_output_tokens.

Streams are the Responses event sequence (`response.created`, `response.in_progress`, the
items' added / delta / done events, then `response.completed` or `response.incomplete`
with the whole response), each event with `type` and an increasing `sequence_number`, and
no `[DONE]`. An error before the first output is a plain HTTP error (as the other routes);
after it, an `error` event and `response.failed`. Nothing is stored (kvmesh keeps no
conversation state): `store` is echoed false.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kvmesh._proto import llm_pb2
from kvmesh.errors import KVMeshError
from kvmesh.serve.openai import request_span
from kvmesh.serve.openai.backend import Backend
from kvmesh.serve.openai.chat import ChatGeneration, ParsedDelta, logprobs_of, parsed_deltas, prepare_chat
from kvmesh.serve.openai.generation import BackendSource, stream_response
from kvmesh.serve.openai.limits import until_disconnected
from kvmesh.serve.openai.protocol import APIError, ChatRequest
from kvmesh.serve.openai.responses_input import ResponsesRequest, responses_error, to_chat
from kvmesh.serve.openai.responses_output import OutputBuilder, item_id


class _Reply:
    """One request being served: the Responses body, its chat form and generation, and
    the response object's fixed fields."""

    def __init__(self, b: Backend, body: ResponsesRequest, chat: ChatRequest, gen: ChatGeneration):
        self.b, self.body, self.chat, self.gen = b, body, chat, gen
        self.id = item_id("resp")
        self.created_at = int(time.time())
        self.builder = OutputBuilder()
        self.last: llm_pb2.GenerateResponse | None = None

    def request(self) -> llm_pb2.GenerateRequest:
        return self.gen.request(self.id, self.chat)

    def step(self, p: ParsedDelta) -> list[dict[str, Any]]:
        self.last = p.msg or self.last
        lp = logprobs_of(self.b, self.chat, [p.msg]) if p.msg is not None else None
        return self.builder.step(p.delta, lp["content"] if lp else None)

    @property
    def incomplete(self) -> bool:
        return self.last is not None and self.last.finish_reason == "length"

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        u = self.last.usage if self.last is not None and self.last.HasField("usage") else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.gen.model,
            "output": self.builder.items if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text_format()}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_logprobs": body.top_logprobs, "truncation": "disabled", "background": False,
            "metadata": body.metadata or {}, "user": body.user,
            "usage": _usage(u) if u is not None and status != "in_progress" else None,
        }

    def final_status(self) -> str:
        return "incomplete" if self.incomplete else "completed"


def _usage(u: llm_pb2.Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


# POST /v1/responses, registered by create_app. No docstring: FastAPI would publish it in the OpenAPI schema.
async def responses(body: ResponsesRequest, request: Request):
    b = BackendSource.of(request).require()
    body.check_unsupported()
    try:
        chat = to_chat(body)
        gen = await prepare_chat(b, chat, request)
    except APIError as e:
        raise responses_error(e) from None
    reply = _Reply(b, body, chat, gen)
    request_span.describe(gen.model, gen.params, reply.id)
    if not body.stream:
        return await until_disconnected(request, _complete(reply))
    return await stream_response(_events(reply), preamble=2, done=None)


async def _complete(reply: _Reply) -> dict[str, Any]:
    try:
        async for p in parsed_deltas(reply.b.generate(reply.request()), reply.gen.spec):
            reply.step(p)
    except KVMeshError as e:
        raise responses_error(APIError.of(e)) from None
    reply.builder.finish(reply.incomplete)
    return reply.response(reply.final_status())


def sse_event(event: dict[str, Any]) -> str:
    """A Responses stream event: its type as the SSE event name, the event as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def _events(reply: _Reply) -> AsyncIterator[str]:
    seq = itertools.count()

    def event(e: dict[str, Any]) -> str:
        return sse_event({**e, "sequence_number": next(seq)})

    yield event({"type": "response.created", "response": reply.response("in_progress")})
    yield event({"type": "response.in_progress", "response": reply.response("in_progress")})
    started = False  # an output event went out: the stream is committed (a 200)
    try:
        async for p in parsed_deltas(reply.b.generate(reply.request()), reply.gen.spec):
            for e in reply.step(p):
                yield event(e)
                started = True
        for e in reply.builder.finish(reply.incomplete):
            yield event(e)
            started = True
    except Exception as exc:  # noqa: BLE001 - rendered: a plain HTTP error before any output, else events
        err = responses_error(APIError.of(exc))
        if not started:
            raise err from None
        yield event({"type": "error", "code": err.body()["error"]["code"], "message": err.message,
                     "param": err.param})
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        yield event({"type": "response.failed",
                     "response": reply.response("failed", {"code": code, "message": err.message})})
        return
    status = reply.final_status()
    yield event({"type": f"response.{status}", "response": reply.response(status)})
