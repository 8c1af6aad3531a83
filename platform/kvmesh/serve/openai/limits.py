"""Limits of the HTTP front end, checked before any work is done for a request.

- `max_body_bytes`: a body over it gets 413 before it is parsed (by Content-Length, or
  while a chunked body streams in).
- `max_prompt_chars`: text prompts (completions) and the text of all chat messages,
  before tokenizing; tokenizing and chat templating then run off the event loop, so a
  big prompt never stalls other requests. The token limit (max_model_len) is the
  router's and the workers' check.
- `max_prompts_per_request`: the batch size of one /v1/completions body.

A non-streaming request whose client disconnects is cancelled (`until_disconnected`):
its worker calls are cancelled and their KV blocks freed, as for a dropped stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from kvmesh.serve.openai.protocol import APIError

T = TypeVar("T")


class HTTPLimits(BaseModel):
    """Per-request limits of the OpenAI-compatible HTTP API."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest request body, bytes (413 above).")
    max_prompt_chars: int = Field(
        1_000_000, ge=1, description="Longest prompt (or all chat messages together), characters, checked "
        "before tokenizing (400 above).")
    max_prompts_per_request: int = Field(32, ge=1, description="Prompts in one /v1/completions batch (400 above).")


class _BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """ASGI middleware: 413 (OpenAI-shaped) for bodies over `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _send_error(send, too_large(self.max_bytes))
            return
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        await self.app(scope, counting_receive, send)


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body is over the server's limit of {max_bytes} bytes; send a shorter prompt",
                    code="request_too_large")


def body_too_large_cause(exc: BaseException) -> bool:
    """FastAPI wraps an error while reading the body in a 400; this says it was ours."""
    return isinstance(exc.__cause__, _BodyTooLarge)


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def limits_of(request: Request) -> HTTPLimits:
    return request.app.state.kvmesh_limits


def check_prompt_chars(limits: HTTPLimits, num_chars: int, param: str) -> None:
    if num_chars > limits.max_prompt_chars:
        raise APIError(400, f"{param}: has {num_chars} characters, over the limit of {limits.max_prompt_chars}; "
                            "shorten it", param=param, code="prompt_too_long")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the HTTP client goes away first (then raise 499)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        raise APIError(499, "the client disconnected; the request was cancelled", "cancelled", code="cancelled")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    # The body is read already: the next ASGI message is the disconnect.
    while True:
        message: dict[str, Any] = await request.receive()
        if message["type"] == "http.disconnect":
            return
