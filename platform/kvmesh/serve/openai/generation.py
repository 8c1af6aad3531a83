"""What the completion and chat routes share, from a validated body to the router and back.

`BackendSource` holds the app's backend getter (on `app.state`; the Ray replica sets its
backend after the app object is built, so the getter is called per request). The
helpers below turn a body into `GenerateRequest`s (model check, kvmesh's `compression`
extension), collect or merge the router's response streams, and render OpenAI usage and
server-sent events. The backend fails with typed kvmesh errors; `APIError.of` renders
them. `stream_response` starts a stream but turns an error before the first token into
a plain HTTP error, so a bad request never looks like a 200 stream; an error after it
becomes an error event, and every stream ends with `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh._proto import llm_pb2
from kvmesh.compress import CompressionOptions, options_from_openai, options_to_proto
from kvmesh.errors import InvalidRequestError, KVMeshError
from kvmesh.serve.openai.backend import Backend
from kvmesh.serve.openai.protocol import APIError, SamplingFields


class BackendSource:
    """The app's backend getter; `require()` is the backend a request is served by."""

    def __init__(self, get_backend: Callable[[], Backend | None]):
        self.get = get_backend

    def require(self) -> Backend:
        b = self.get()
        if b is None:
            raise APIError(503, "the server is starting; retry shortly", "service_unavailable")
        return b

    @staticmethod
    def of(request: Request) -> BackendSource:
        return request.app.state.kvmesh_backends


async def check_model(b: Backend, model: str | None) -> str:
    """The model a body names: the base model (also when unset) or a LoRA adapter the
    router serves; anything else is OpenAI's 404 `model_not_found`, naming what is served."""
    if not model or model == b.model_id:
        return b.model_id
    try:
        ids = await b.model_ids()
    except KVMeshError as e:
        raise APIError.of(e) from None
    if model in ids:
        return model
    served = ", ".join(f"`{m}`" for m in ids or [b.model_id])
    raise APIError(404, f"The model `{model}` does not exist; this server serves {served}",
                   "not_found_error", param="model", code="model_not_found")


def compression_options(body: SamplingFields) -> CompressionOptions | None:
    """Validated `compression` options (a kvmesh extension), or None."""
    if body.compression is None:
        return None
    try:
        return options_from_openai({"compression": body.compression})
    except (InvalidRequestError, ValueError) as e:
        raise APIError(400, str(e), param=getattr(e, "field", "compression")) from None


def build_request(rid: str, prompt: str | list[int], params: llm_pb2.SamplingParams,
                  body: SamplingFields, model: str = "") -> llm_pb2.GenerateRequest:
    """`model`: the base model or a LoRA adapter (the router resolves it)."""
    req = llm_pb2.GenerateRequest(request_id=rid, params=params, cache_salt=body.cache_salt or "", model=model)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    if isinstance(prompt, str):  # the router compresses text prompts (chat is compressed here)
        comp = compression_options(body)
        if comp is not None:
            req.compression.CopyFrom(options_to_proto(comp))
    return req


async def collect(b: Backend, req: llm_pb2.GenerateRequest) -> tuple[str, list[llm_pb2.GenerateResponse]]:
    msgs = []
    try:
        async for msg in b.generate(req):
            msgs.append(msg)
    except KVMeshError as e:
        raise APIError.of(e) from None
    return "".join(m.text for m in msgs), msgs


def usage(u: llm_pb2.Usage, original_prompt_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.original_prompt_tokens` (kvmesh) appears
    when prompt compression shortened the prompt."""
    details: dict[str, Any] = {"cached_tokens": u.cached_prompt_tokens}
    original = original_prompt_tokens or u.original_prompt_tokens
    if original:
        details["original_prompt_tokens"] = original
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens, "prompt_tokens_details": details}


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of several choices (a batch of prompts) added up, details included."""
    total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    for u in usages:
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[k] += u[k]
        for k, v in u["prompt_tokens_details"].items():
            total["prompt_tokens_details"][k] = total["prompt_tokens_details"].get(k, 0) + v
    return total


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def stream_response(events: AsyncIterator[str], preamble: int = 0, done: str | None = SSE_DONE) -> Response:
    """Start the stream of `events` (server-sent events; an error raises), but turn an
    error before the first token into a plain HTTP error (a bad request must not look
    like a 200 stream). `preamble`: events that come before the first token (chat's role
    chunk); the response starts with the event after them, so the first token is never
    held back for the second (that cost completions one decode step of TTFT). A later
    error becomes an OpenAI error event; the stream ends with `done` (`[DONE]`; None for
    the Responses API, whose streams end with their last event and render their own errors)."""
    first: list[str] = []
    it = events.__aiter__()
    try:
        for _ in range(preamble + 1):
            first.append(await it.__anext__())
    except StopAsyncIteration:
        pass
    except Exception as e:
        await it.aclose()
        err = APIError.of(e)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)

    async def body() -> AsyncIterator[str]:
        for chunk in first:
            yield chunk
        try:
            async for chunk in it:
                yield chunk
        except Exception as e:
            yield sse(APIError.of(e).body())
        if done is not None:
            yield done

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def merge_streams(streams: list[AsyncIterator[llm_pb2.GenerateResponse]]):
    """Interleave several response streams as (index, message), in arrival order."""
    if len(streams) == 1:
        async for msg in streams[0]:
            yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[llm_pb2.GenerateResponse]) -> None:
        try:
            async for msg in s:
                await queue.put((i, msg))
        except BaseException as e:  # re-raised in the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


# -- choices: what completions and chat share ---------------------------------------
#
# A body becomes one GenerateRequest per prompt (completions may batch prompts; chat has
# one), each with `n` choices that the worker samples from one computed prompt. Choice k
# of the reply is request k // n, choice k % n (OpenAI's order for a batch with n > 1).


async def choice_messages(b: Backend, reqs: list[llm_pb2.GenerateRequest],
                          n: int) -> AsyncIterator[tuple[int, llm_pb2.GenerateResponse]]:
    """(choice index, message) of every request's choices, in arrival order."""
    async for i, msg in merge_streams([b.generate(r) for r in reqs]):
        yield i * n + msg.index, msg


async def collect_choices(b: Backend, reqs: list[llm_pb2.GenerateRequest],
                          n: int) -> list[list[llm_pb2.GenerateResponse]]:
    """Every choice's messages, once all have finished."""
    out: list[list[llm_pb2.GenerateResponse]] = [[] for _ in range(len(reqs) * n)]
    try:
        async for k, msg in choice_messages(b, reqs, n):
            out[k].append(msg)
    except KVMeshError as e:
        raise APIError.of(e) from None
    return out


def choices_usage(finals: list[llm_pb2.GenerateResponse | None], n: int,
                  original_prompt_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI usage of a reply: each prompt counted once (its choices share it), the
    completion tokens of every choice added up. `finals`: each choice's last message."""
    per_prompt = [usage(m.usage, original_prompt_tokens) for k, m in enumerate(finals) if m is not None and k % n == 0]
    total = sum_usage(per_prompt)
    completion = sum(m.usage.completion_tokens for m in finals if m is not None)
    total["completion_tokens"] = completion
    total["total_tokens"] = total["prompt_tokens"] + completion
    return total


# JSON has no -Infinity: a token a grammar or logit_bias ruled out reports this instead (as vLLM's server).
MIN_LOGPROB = -9999.0


def finite_logprob(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def prompt_logprobs_json(b: Backend, msgs: list[llm_pb2.GenerateResponse], prompt_ids: list[int] | None = None
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per
    token {token id: {logprob, decoded_token}} for it and its top alternatives."""
    first = next((m for m in msgs if m.prompt_logprobs), None)
    if first is None:
        return None
    out: list[dict[str, Any] | None] = [None]
    for lp in first.prompt_logprobs:
        entry = {str(lp.token_id): {"logprob": finite_logprob(lp.logprob), "decoded_token": b.token_str(lp.token_id)}}
        for t in lp.top:
            entry.setdefault(str(t.token_id), {"logprob": finite_logprob(t.logprob), "decoded_token": b.token_str(t.token_id)})
        out.append(entry)
    return out
