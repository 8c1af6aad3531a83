"""`POST /v1/completions`: text completion over the router, one choice per prompt.

A body may carry one prompt (text or token ids) or a batch of them; each becomes its own
`GenerateRequest` (`<id>-<i>`), run concurrently, and its choice keeps the prompt's
index. Without `stream` the reply waits for all choices and adds their usage up; with
`stream` the choices' chunks are interleaved in arrival order as server-sent events,
followed by the summed usage when `stream_options.include_usage` asks for it.
`max_tokens` defaults to 16, as in OpenAI's API; `echo` and `suffix` are refused. A batch
is capped at `max_prompts_per_request` and each text prompt at `max_prompt_chars`; a
non-streaming request is cancelled when its client disconnects.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kvmesh._proto import llm_pb2
from kvmesh.serve.openai.backend import Backend
from kvmesh.serve.openai.generation import (
    BackendSource,
    build_request,
    check_model,
    collect,
    merge_streams,
    sse,
    stream_response,
    sum_usage,
    usage,
)
from kvmesh.serve.openai.limits import check_prompt_chars, limits_of, until_disconnected
from kvmesh.serve.openai.protocol import APIError, CompletionRequest


# POST /v1/completions, registered by create_app. No docstring: FastAPI would publish it in the
# OpenAPI schema.
async def completions(body: CompletionRequest, request: Request):
    b = BackendSource.of(request).require()
    body.check_unsupported()
    if body.echo:
        raise APIError(400, "echo is not supported; leave it false", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported; leave it unset", param="suffix")
    model = check_model(b, body.model)
    params = body.to_proto(body.logprobs, default_max_tokens=16)
    cid = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model}
    prompts = body.prompts()
    limits = limits_of(request)
    if len(prompts) > limits.max_prompts_per_request:
        raise APIError(400, f"prompt: a batch of {len(prompts)} prompts is over the limit of "
                            f"{limits.max_prompts_per_request} per request; split it", param="prompt")
    for p in prompts:
        if isinstance(p, str):
            check_prompt_chars(limits, len(p), "prompt")
    reqs = [build_request(f"{cid}-{i}", p, params, body) for i, p in enumerate(prompts)]
    if not body.stream:
        return await until_disconnected(request, _complete(b, body, reqs, head))
    return await stream_response(_events(b, body, reqs, head))


async def _complete(b: Backend, body: CompletionRequest, reqs: list[llm_pb2.GenerateRequest],
                    head: dict[str, Any]) -> dict[str, Any]:
    results = await asyncio.gather(*(collect(b, r) for r in reqs))
    choices, usages = [], []
    for i, (text, msgs) in enumerate(results):
        last = msgs[-1] if msgs else llm_pb2.GenerateResponse()
        choices.append({"index": i, "text": text, "logprobs": _logprobs(b, body, msgs),
                        "finish_reason": last.finish_reason or None})
        usages.append(usage(last.usage))
    return {**head, "choices": choices, "usage": sum_usage(usages)}


async def _events(b: Backend, body: CompletionRequest, reqs: list[llm_pb2.GenerateRequest],
                  head: dict[str, Any]) -> AsyncIterator[str]:
    usages = []
    async for i, msg in merge_streams([b.generate(r) for r in reqs]):
        yield sse({**head, "choices": [{"index": i, "text": msg.text, "logprobs": _logprobs(b, body, [msg]),
                                        "finish_reason": msg.finish_reason or None}]})
        if msg.finish_reason:
            usages.append(usage(msg.usage))
    if body.include_usage_in_stream():
        yield sse({**head, "choices": [], "usage": sum_usage(usages)})


def _logprobs(b: Backend, body: CompletionRequest, msgs: list[llm_pb2.GenerateResponse]) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs)."""
    if body.logprobs is None:
        return None
    tokens, lps, tops = [], [], []
    for m in msgs:
        for lp in m.logprobs:
            tokens.append(b.token_str(lp.token_id))
            lps.append(lp.logprob)
            tops.append({b.token_str(t.token_id): t.logprob for t in lp.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}
