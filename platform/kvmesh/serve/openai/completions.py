"""`POST /v1/completions`: text completion over the router.

A body may carry one prompt (text or token ids) or a batch of them; each becomes its own
`GenerateRequest` (`<id>-<i>`), run concurrently, with `n` choices each (sampled from one
computed prompt on the worker); choice `i * n + j` is prompt i's choice j. Without
`stream` the reply waits for all choices and adds their usage up (each prompt counted
once); with `stream` the choices' chunks are interleaved in arrival order as server-sent
events, followed by the usage when `stream_options.include_usage` asks for it.
`echo` puts the prompt before each choice's text (with `logprobs`, the prompt tokens'
logprobs first, the first token's null, as OpenAI's legacy API); `prompt_logprobs`
(vLLM's) adds each prompt token's logprobs to the choice. `max_tokens` defaults to 16, as
in OpenAI's API; `suffix` is refused. vLLM's `add_special_tokens: false` encodes a text
prompt here without the tokenizer's special tokens (no BOS). A batch is capped at `max_prompts_per_request` and
each text prompt at `max_prompt_chars`; a non-streaming request is cancelled when its
client disconnects.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kvmesh._proto import llm_pb2
from kvmesh.serve.openai import request_span
from kvmesh.serve.openai.backend import Backend
from kvmesh.serve.openai.generation import (
    BackendSource,
    build_request,
    check_model,
    choice_messages,
    choices_usage,
    collect_choices,
    finite_logprob,
    prompt_logprobs_json,
    sse,
    stream_response,
)
from kvmesh.serve.openai.limits import check_prompt_chars, limits_of, until_disconnected
from kvmesh.serve.openai.protocol import APIError, CompletionRequest


# POST /v1/completions, registered by create_app. No docstring: FastAPI would publish it in the
# OpenAPI schema.
async def completions(body: CompletionRequest, request: Request):
    b = BackendSource.of(request).require()
    body.check_unsupported()
    if body.suffix:
        raise APIError(400, "suffix is not supported; leave it unset", param="suffix")
    if body.echo and body.compression is not None:
        raise APIError(400, "echo returns the prompt as sent, which compression would rewrite; use one of them",
                       param="echo")
    model = await check_model(b, body.model)
    params = body.to_proto(body.logprobs, default_max_tokens=16)
    if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
        params.prompt_logprobs = body.logprobs  # the echoed prompt's tokens carry logprobs too
    cid = f"cmpl-{uuid.uuid4().hex}"
    request_span.describe(model, params, cid)
    head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model}
    prompts = body.prompts()
    limits = limits_of(request)
    if len(prompts) > limits.max_prompts_per_request:
        raise APIError(400, f"prompt: a batch of {len(prompts)} prompts is over the limit of "
                            f"{limits.max_prompts_per_request} per request; split it", param="prompt")
    for p in prompts:
        if isinstance(p, str):
            check_prompt_chars(limits, len(p), "prompt")
    if not body.add_special_tokens and body.compression is not None:
        raise APIError(400, "add_special_tokens false encodes the prompt here, but compression rewrites it at the "
                            "router; use one of them", param="add_special_tokens")
    texts = [p if isinstance(p, str) else b.decode(p) for p in prompts] if body.echo else []
    if body.echo or not body.add_special_tokens:
        # Encoded here, as the router would: echo needs the prompt's tokens (for their
        # logprobs), add_special_tokens false an encoding the router does not make.
        prompts = [await asyncio.to_thread(b.encode, p, body.add_special_tokens) if isinstance(p, str) else p
                   for p in prompts]
    echo = _Echo(b, prompts, texts, body) if body.echo else None
    reqs = [build_request(f"{cid}-{i}", p, params, body, model) for i, p in enumerate(prompts)]
    if not body.stream:
        return await until_disconnected(request, _complete(b, body, reqs, head, echo))
    return await stream_response(_events(b, body, reqs, head, echo))


class _Echo:
    """What `echo` puts before each choice: the prompt's text (and its tokens' logprobs)."""

    def __init__(self, b: Backend, prompts: list[list[int]], texts: list[str], body: CompletionRequest):
        self.b, self.prompts, self.texts, self.n = b, prompts, texts, body.n
        self.logprobs = body.logprobs is not None

    def text(self, choice: int) -> str:
        return self.texts[choice // self.n]

    def token_logprobs(self, choice: int, msgs: list[llm_pb2.GenerateResponse]) -> dict[str, list] | None:
        """The legacy logprobs of the prompt part: its tokens, null for the first token."""
        if not self.logprobs:
            return None
        ids = self.prompts[choice // self.n]
        first = next((m for m in msgs if m.prompt_logprobs), None)
        lps = list(first.prompt_logprobs) if first is not None else []
        tokens = [self.b.token_str(t) for t in ids]
        return {"tokens": tokens, "token_logprobs": [None] + [finite_logprob(lp.logprob) for lp in lps],
                "top_logprobs": [None] + [{self.b.token_str(t.token_id): finite_logprob(t.logprob) for t in lp.top} for lp in lps]}


async def _complete(b: Backend, body: CompletionRequest, reqs: list[llm_pb2.GenerateRequest],
                    head: dict[str, Any], echo: _Echo | None) -> dict[str, Any]:
    results = await collect_choices(b, reqs, body.n)
    choices = []
    for k, msgs in enumerate(results):
        last = msgs[-1] if msgs else None
        text = "".join(m.text for m in msgs)
        choice = {"index": k, "text": (echo.text(k) if echo else "") + text,
                  "logprobs": _logprobs(b, body, msgs, echo.token_logprobs(k, msgs) if echo else None),
                  "finish_reason": (last.finish_reason if last else "") or None}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(b, msgs)
        choices.append(choice)
    return {**head, "choices": choices, "usage": choices_usage([m[-1] if m else None for m in results], body.n)}


async def _events(b: Backend, body: CompletionRequest, reqs: list[llm_pb2.GenerateRequest],
                  head: dict[str, Any], echo: _Echo | None) -> AsyncIterator[str]:
    finals: list[llm_pb2.GenerateResponse | None] = [None] * (len(reqs) * body.n)
    started: set[int] = set()
    async for k, msg in choice_messages(b, reqs, body.n):
        text = msg.text
        prefix = None
        if k not in started:  # the choice's first chunk carries the echoed prompt
            started.add(k)
            if echo is not None:
                text = echo.text(k) + text
                prefix = echo.token_logprobs(k, [msg])
        choice = {"index": k, "text": text, "logprobs": _logprobs(b, body, [msg], prefix),
                  "finish_reason": msg.finish_reason or None}
        if body.prompt_logprobs is not None and msg.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(b, [msg])
        yield sse({**head, "choices": [choice]})
        if msg.finish_reason:
            finals[k] = msg
    if body.include_usage_in_stream():
        yield sse({**head, "choices": [], "usage": choices_usage(finals, body.n)})


def _logprobs(b: Backend, body: CompletionRequest, msgs: list[llm_pb2.GenerateResponse],
              prefix: dict[str, list] | None = None) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs),
    after `prefix` (the echoed prompt's)."""
    if body.logprobs is None:
        return None
    tokens, lps, tops = (list(prefix[k]) for k in ("tokens", "token_logprobs", "top_logprobs")) if prefix else \
        ([], [], [])
    for m in msgs:
        for lp in m.logprobs:
            tokens.append(b.token_str(lp.token_id))
            lps.append(lp.logprob)
            tops.append({b.token_str(t.token_id): finite_logprob(t.logprob) for t in lp.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}
