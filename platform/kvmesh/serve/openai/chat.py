"""`POST /v1/chat/completions`: chat over the router, one choice per request.

The messages are rendered here with the tokenizer's chat template and sent as token ids,
so the router never needs the template. kvmesh's `compression` extension compresses the
`<context>...</context>` spans of each message here, before templating (the router only
compresses text prompts); usage then reports the uncompressed prompt length as
`prompt_tokens_details.original_prompt_tokens`. Without `max_tokens` /
`max_completion_tokens` a reply runs until EOS, bounded by the model's context
(max_tokens = max_model_len - prompt tokens). The messages' text is capped at
`max_prompt_chars` and templated off the event loop; a non-streaming request is
cancelled when its client disconnects.
Streams open with a role-only delta, as OpenAI's do.

Tools (`tools`, `tool_choice`, `parallel_tool_calls`) reach the template (or a Hermes-style
system prompt when it ignores them); the reply is read by the server's tool-call parser
(`--tool-call-parser`, auto by default) into `message.tool_calls` / streamed `tool_calls`
deltas, and by the reasoning parser (`--reasoning-parser`) into `reasoning_content`
(kvmesh.chat.output.ChatOutput, one reader for both, so a stream reassembles to the
whole message). A reply with calls ends with finish_reason `tool_calls`.

The template gets vLLM's `chat_template_kwargs` (its variables), `add_generation_prompt`,
`continue_final_message`, `documents` and `reasoning_effort` (ChatRequest.template_options),
and every message's `name` and `tool_call_id`. OpenAI's legacy `functions` / `function_call`
are served as tools and answered in their own shape (legacy.py).

`prepare_chat` (body -> `ChatGeneration`) and `ChoiceReader` / `parsed_deltas` (one
choice's router messages -> parsed deltas) are the chat generation path; this route and
`/v1/responses` (responses.py) only render them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from kvmesh._proto import llm_pb2
from kvmesh.chat import ChatConfig, ChatOutput, ChatOutputSpec, ToolSet, get_reasoning_parser, merge_deltas, output_spec
from kvmesh.chat.template import resolve_tool_parser, template_source
from kvmesh.compress import OPEN, CompressionOptions, compress_prompt
from kvmesh.errors import InvalidRequestError
from kvmesh.serve.openai import request_span
from kvmesh.serve.openai.backend import Backend
from kvmesh.serve.openai.generation import (
    BackendSource,
    build_request,
    check_model,
    choice_messages,
    choices_usage,
    collect_choices,
    compression_options,
    finite_logprob,
    prompt_logprobs_json,
    sse,
    stream_response,
)
from kvmesh.serve.openai.legacy import (
    legacy_delta,
    legacy_finish_reason,
    legacy_message,
    read_legacy_functions,
    uses_functions,
)
from kvmesh.serve.openai.limits import check_prompt_chars, limits_of, until_disconnected
from kvmesh.serve.openai.protocol import APIError, ChatMessage, ChatRequest, structured_outputs_for_schema


@dataclass
class ChatGeneration:
    """A validated chat body as the router sees it: the served model, the templated prompt's
    token ids, the sampling params and how the reply is read. `/v1/chat/completions` and
    `/v1/responses` both start from it (one templating, tools and sampling path)."""

    model: str
    ids: list[int]
    params: llm_pb2.SamplingParams
    spec: ChatOutputSpec
    original_tokens: int | None  # the prompt's length before compression (None: not compressed)
    legacy: bool = False  # the body used the legacy functions / function_call: so does the reply

    def request(self, rid: str, body: ChatRequest) -> llm_pb2.GenerateRequest:
        return build_request(rid, self.ids, self.params, body, self.model)


async def prepare_chat(b: Backend, body: ChatRequest, request: Request) -> ChatGeneration:
    """Check `body` and build its generation: tools, template, compression, max_tokens
    default; a 400 naming the field when something is wrong."""
    body.check_unsupported()
    legacy = uses_functions(body)
    read_legacy_functions(body)
    options = body.template_options()
    model = await check_model(b, body.model)
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    check_prompt_chars(limits_of(request), sum(len(m.text()) for m in body.messages), "messages")
    cfg: ChatConfig = request.app.state.kvmesh_chat
    tools = _tool_set(body, cfg)
    ids = await asyncio.to_thread(b.chat_prompt_ids, body.messages, tools, options=options)
    original_tokens = None
    comp = compression_options(body)
    if comp is not None:
        original_tokens = len(ids)
        messages = await compress_messages(body.messages, comp, b.tokenizer)
        ids = await asyncio.to_thread(b.chat_prompt_ids, messages, tools, options=options)
    n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.to_proto(n_logprobs, default_max_tokens=None)
    if body.max_tokens is None:
        # Until EOS, bounded by the model's context (a prompt too long for it is the
        # router's INVALID_ARGUMENT).
        context = await b.max_model_len()
        params.max_tokens = max(1, context - len(ids)) if context else 2**31 - 1
    spec = _output_spec(b, body, cfg, tools, ids, params)
    return ChatGeneration(model, ids, params, spec, original_tokens, legacy)


@dataclass
class ParsedDelta:
    """One step of a reply as the parsers read it: the OpenAI delta (`reasoning_content`,
    `content`, `tool_calls` fragments; {} while text is held back), the router message it
    came from (None for what is flushed when a stream ends without a finish reason) and
    the chat finish reason (`tool_calls` when the reply made calls)."""

    delta: dict[str, Any]
    msg: llm_pb2.GenerateResponse | None
    finish_reason: str | None


class ChoiceReader:
    """One choice's reply, read message by message: `read` each router message as it
    arrives (several choices' messages may interleave), then `end` once its stream is over."""

    def __init__(self, spec: ChatOutputSpec):
        self.out = ChatOutput(spec)

    def read(self, msg: llm_pb2.GenerateResponse) -> ParsedDelta:
        delta = self.out.feed(msg.text)
        if msg.finish_reason:  # the reply ends: what the parsers held back goes with it
            delta = merge_deltas([delta, self.out.finish()])
        return ParsedDelta(delta, msg, self.out.finish_reason(msg.finish_reason or None))

    def end(self) -> ParsedDelta | None:
        """What the parsers still hold when a stream ended without a finish reason."""
        if not self.out.finished and (rest := self.out.finish()):
            return ParsedDelta(rest, None, None)
        return None


async def parsed_deltas(stream: AsyncIterator[llm_pb2.GenerateResponse],
                        spec: ChatOutputSpec) -> AsyncIterator[ParsedDelta]:
    """One choice's stream of router messages as parsed deltas (one per message, then
    the held-back rest if the stream ended without a finish reason)."""
    reader = ChoiceReader(spec)
    async for msg in stream:
        yield reader.read(msg)
    if (rest := reader.end()) is not None:
        yield rest


# POST /v1/chat/completions, registered by create_app. No docstring: FastAPI would publish it in the
# OpenAPI schema.
async def chat_completions(body: ChatRequest, request: Request):
    b = BackendSource.of(request).require()
    gen = await prepare_chat(b, body, request)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    head = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": gen.model}
    req = gen.request(cid, body)
    request_span.describe(gen.model, gen.params, cid)
    if not body.stream:
        return await until_disconnected(request, _complete(b, body, req, head, gen))
    return await stream_response(_events(b, body, req, {**head, "object": "chat.completion.chunk"}, gen),
                                 preamble=body.n)


async def _complete(b: Backend, body: ChatRequest, req: llm_pb2.GenerateRequest, head: dict[str, Any],
                    gen: ChatGeneration) -> dict[str, Any]:
    results = await collect_choices(b, [req], body.n)
    choices = []
    for k, msgs in enumerate(results):
        out = ChatOutput(gen.spec)
        message = out.message("".join(m.text for m in msgs))
        last = msgs[-1] if msgs else None
        finish = out.finish_reason((last.finish_reason if last else "") or None)
        if gen.legacy:
            message, finish = legacy_message(message), legacy_finish_reason(finish)
        choice = {"index": k, "message": message, "logprobs": logprobs_of(b, body, msgs), "finish_reason": finish}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(b, msgs)
        choices.append(choice)
    return {**head, "choices": choices,
            "usage": choices_usage([m[-1] if m else None for m in results], body.n, gen.original_tokens)}


async def _events(b: Backend, body: ChatRequest, req: llm_pb2.GenerateRequest, head: dict[str, Any],
                  gen: ChatGeneration) -> AsyncIterator[str]:
    """Each choice opens with a role-only delta (all of them first, as OpenAI's streams
    do); the choices' parsed deltas then interleave in arrival order."""
    n = body.n
    for k in range(n):
        yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
    readers = [ChoiceReader(gen.spec) for _ in range(n)]
    finals: list[llm_pb2.GenerateResponse | None] = [None] * n
    async for k, msg in choice_messages(b, [req], n):
        p = readers[k].read(msg)
        delta, finish = p.delta, p.finish_reason
        if gen.legacy:
            delta, finish = legacy_delta(delta), legacy_finish_reason(finish)
        choice = {"index": k, "delta": delta, "logprobs": logprobs_of(b, body, [msg]), "finish_reason": finish}
        if body.prompt_logprobs is not None and msg.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(b, [msg])
        yield sse({**head, "choices": [choice]})
        if msg.finish_reason:
            finals[k] = msg
    for k, reader in enumerate(readers):
        if (rest := reader.end()) is not None:  # a stream that ended without a finish reason
            delta = legacy_delta(rest.delta) if gen.legacy else rest.delta
            yield sse({**head, "choices": [{"index": k, "delta": delta, "logprobs": None, "finish_reason": None}]})
    if body.include_usage_in_stream() and any(finals):
        yield sse({**head, "choices": [], "usage": choices_usage(finals, n, gen.original_tokens)})


def _tool_set(body: ChatRequest, cfg: ChatConfig) -> ToolSet | None:
    """The request's validated tools (None without tools: plain chat)."""
    if body.tools is None and body.tool_choice is None and body.parallel_tool_calls is None:
        return None
    tools = body.tool_set()
    if tools.choice == "auto" and not cfg.enable_auto_tool_choice:
        raise APIError(400, "tool_choice auto (the default with tools) is off on this server (start it with "
                            "--enable-auto-tool-choice); send tool_choice required or a named function",
                       param="tool_choice")
    return tools


def _output_spec(b: Backend, body: ChatRequest, cfg: ChatConfig, tools: ToolSet | None, ids: list[int],
                 params: llm_pb2.SamplingParams) -> ChatOutputSpec:
    """How this reply is read (tool-call and reasoning parsers); also constrains `params`
    for required / named tool choices and keeps the special tokens a format needs."""
    parser = None
    constrained = False
    if tools is not None and tools.active:
        try:
            parser = resolve_tool_parser(cfg.tool_call_parser, template_source(b.tokenizer))
        except ValueError as e:
            raise APIError(500, f"server misconfigured: {e}", "internal_error") from None
        schema = tools.output_schema()
        constrained = schema is not None and constrain_to_schema(params, schema)
        if parser.needs_special_tokens and body.skip_special_tokens is None:
            params.skip_special_tokens = False  # [TOOL_CALLS] is a special token
    reasoning = get_reasoning_parser(cfg.reasoning_parser) if cfg.reasoning_parser else None
    tail = b.tokenizer.decode(ids[-8:]) if reasoning is not None and b.tokenizer is not None else ""
    return output_spec(tools, parser, constrained, reasoning, tail)


def constrain_to_schema(params: llm_pb2.SamplingParams, schema: dict[str, Any]) -> bool:
    """Hold the output to `schema` with the grammar engine (tool_choice required / named),
    so the call always parses; returns whether it is held (a request's own
    response_format / structured_outputs conflicts with it: a 400)."""
    if params.HasField("structured_outputs"):
        raise APIError(400, "tool_choice required / a named function constrains the reply to the call; drop "
                            "response_format / structured_outputs, or use tool_choice auto", param="tool_choice")
    params.structured_outputs.CopyFrom(structured_outputs_for_schema(schema))
    return True


def logprobs_of(b: Backend, body: ChatRequest, msgs: list[llm_pb2.GenerateResponse]) -> dict[str, Any] | None:
    """The chat `logprobs` object: per token its text, logprob, bytes and top alternatives."""
    if not body.logprobs:
        return None
    content = []
    for m in msgs:
        for lp in m.logprobs:
            tok = b.token_str(lp.token_id)
            content.append({"token": tok, "logprob": finite_logprob(lp.logprob), "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": b.token_str(t.token_id), "logprob": finite_logprob(t.logprob),
                                              "bytes": list(b.token_str(t.token_id).encode())}
                                             for t in lp.top]})
    return {"content": content}


async def compress_messages(messages: list[ChatMessage], options: CompressionOptions,
                            tokenizer) -> list[ChatMessage]:
    """Compress the `<context>...</context>` spans of each chat message (off the event
    loop: the compressors run models). Messages without spans are unchanged."""
    if not any(OPEN in m.text() for m in messages):
        raise APIError(400, f"compression: no message has a {OPEN}...</context> span to compress; mark the "
                            "retrieved context or drop compression", param="compression")
    out = []
    for m in messages:
        text = m.text()
        if OPEN in text:
            try:
                result = await asyncio.to_thread(compress_prompt, text, options, tokenizer=tokenizer)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=getattr(e, "field", "compression")) from None
            m = m.model_copy(update={"content": result.text})
        out.append(m)
    return out
