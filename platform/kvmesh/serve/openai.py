"""OpenAI-compatible HTTP API over the router's gRPC `kvmesh.v1.LLM` service.

`create_app(get_backend)` builds a FastAPI app with `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (server-sent events when `stream`), `/health` and `/metrics`.
The same app is the Ray Serve ingress of the router deployment (serve/app.py) and the
HTTP front of `kvmesh serve --local`; both talk to the router over loopback gRPC, so
the HTTP path gets exactly the routing, P/D and retries of the gRPC path.

Errors are OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status a gRPC status maps to (INVALID_ARGUMENT -> 400, UNAVAILABLE -> 503, ...).
Unknown request fields are ignored (as vLLM does); known but unsupported ones with a
non-default value (n > 1, echo, tools, ...) get a 400 that says what to change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.rpc import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code or self.status}}

    @classmethod
    def from_grpc(cls, exc: grpc.aio.AioRpcError) -> "APIError":
        status, type_ = _HTTP_OF_GRPC.get(exc.code(), (500, "internal_error"))
        message = exc.details() or exc.code().name
        # kvmesh's INVALID_ARGUMENT messages start with the field: "max_tokens: must be ..."
        m = re.match(r"([A-Za-z_][\w.]*): ", message) if status == 400 else None
        return cls(status, message, type_, param=m.group(1) if m else None, code=exc.code().name.lower())


# -- request bodies -------------------------------------------------------------


class _SamplingFields(BaseModel):
    """Fields common to completions and chat; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, description="Default 16 (completions) / until EOS (chat).")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    compression: dict[str, Any] | None = Field(
        None, description="kvmesh extension: prompt compression {method, target_ratio} (see kvmesh.compress)."
    )

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n must be 1: kvmesh returns one choice per request; send n requests", param="n")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported; leave it unset", param="best_of")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported; leave it unset", param="logit_bias")

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def to_proto(self, logprobs: int | None, default_max_tokens: int | None) -> llm_pb2.SamplingParams:
        msg = llm_pb2.SamplingParams(ignore_eos=self.ignore_eos,
                                     include_stop_str_in_output=self.include_stop_str_in_output)
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        scalars = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
                   "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                   "repetition_penalty": self.repetition_penalty, "skip_special_tokens": self.skip_special_tokens,
                   "logprobs": logprobs}
        for name, value in scalars.items():
            if value is not None:
                setattr(msg, name, value)
        if self.stop is not None:
            msg.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.stop_token_ids:
            msg.stop_token_ids.extend(self.stop_token_ids)
        return msg


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # a batch of prompts: one choice each


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content part of type {part.get('type')!r} is not supported; send text parts",
                               param="messages")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise APIError(400, "tools / function calling is not supported by kvmesh yet; remove tools",
                           param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {type: text} is supported", param="response_format")


# -- backend ---------------------------------------------------------------------


class GrpcBackend:
    """The router's gRPC API plus the tokenizer's chat template."""

    def __init__(self, address: str, tokenizer, model_id: str, timeout_s: float = 600.0):
        self.address = address
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.timeout_s = timeout_s
        self._stub: llm_pb2_grpc.LLMStub | None = None
        self._channel: grpc.aio.Channel | None = None
        from kvmesh.rpc.auth import api_key, bearer_metadata

        self.metadata = bearer_metadata(api_key())  # the router checks the same key

    @property
    def stub(self) -> llm_pb2_grpc.LLMStub:
        if self._stub is None:  # created on the serving event loop
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = llm_pb2_grpc.LLMStub(self._channel)
        return self._stub

    def chat_prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        conv = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in messages]
        ids = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def list_models(self) -> llm_pb2.ListModelsResponse:
        return await self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=10, metadata=self.metadata)

    def generate(self, request: llm_pb2.GenerateRequest) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """Stream from the router, in a `kvmesh.http.generate` span whose context the
        router continues (one trace from HTTP to the workers, when tracing is on)."""
        return self._generate(request)

    async def _generate(self, request: llm_pb2.GenerateRequest) -> AsyncIterator[llm_pb2.GenerateResponse]:
        from kvmesh.telemetry import tracing

        with tracing.span("kvmesh.http.generate") as s:
            metadata = (*self.metadata, *(tracing.grpc_metadata(s) or ())) or None
            async for msg in self.stub.Generate(request, timeout=self.timeout_s, metadata=metadata):
                yield msg

    async def healthy(self) -> bool:
        try:
            models = await self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=5, metadata=self.metadata)
            return len(models.models) > 0
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


# -- the app ---------------------------------------------------------------------


def _usage(u: llm_pb2.Usage, original_prompt_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.original_prompt_tokens` (kvmesh) appears
    when prompt compression shortened the prompt."""
    details: dict[str, Any] = {"cached_tokens": u.cached_prompt_tokens}
    original = original_prompt_tokens or u.original_prompt_tokens
    if original:
        details["original_prompt_tokens"] = original
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens, "prompt_tokens_details": details}


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of several choices (a batch of prompts) added up, details included."""
    total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    for u in usages:
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[k] += u[k]
        for k, v in u["prompt_tokens_details"].items():
            total["prompt_tokens_details"][k] = total["prompt_tokens_details"].get(k, 0) + v
    return total


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def create_app(get_backend: Callable[[], GrpcBackend], metrics: Callable[[], tuple[bytes, str]] | None = None,
               title: str = "kvmesh") -> FastAPI:
    """The OpenAI-compatible app. `get_backend` is called per request (the Ray replica
    sets its backend after the app object is built); `metrics` renders /metrics."""
    app = FastAPI(title=f"{title} OpenAI-compatible API")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(first.get("msg", exc))
        return JSONResponse(APIError(400, msg, param=loc or None).body(), status_code=400)

    from kvmesh.rpc.auth import api_key, authorized

    key = api_key()

    if key:
        @app.middleware("http")
        async def _check_key(request: Request, call_next):
            if request.url.path.startswith("/v1/") and not authorized(request.headers.get("authorization"), key):
                err = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                               "authentication_error", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
            return await call_next(request)

    def backend() -> GrpcBackend:
        b = get_backend()
        if b is None:
            raise APIError(503, "the server is starting; retry shortly", "service_unavailable")
        return b

    def check_model(b: GrpcBackend, model: str | None) -> str:
        if model and model != b.model_id:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{b.model_id}`",
                           "not_found_error", param="model", code="model_not_found")
        return b.model_id

    def compression_options(body: _SamplingFields):
        """Validated `compression` options (a kvmesh extension), or None."""
        if body.compression is None:
            return None
        from kvmesh.compress import options_from_openai
        from kvmesh.errors import InvalidRequestError

        try:
            return options_from_openai({"compression": body.compression})
        except (InvalidRequestError, ValueError) as e:
            raise APIError(400, str(e), param=getattr(e, "field", "compression")) from None

    def build_request(rid: str, prompt: str | list[int], params: llm_pb2.SamplingParams,
                      body: _SamplingFields) -> llm_pb2.GenerateRequest:
        req = llm_pb2.GenerateRequest(request_id=rid, params=params)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.extend(prompt)
        if isinstance(prompt, str):  # the router compresses text prompts (chat is compressed here)
            comp = compression_options(body)
            if comp is not None:
                from kvmesh.compress import options_to_proto

                req.compression.CopyFrom(options_to_proto(comp))
        return req

    async def collect(b: GrpcBackend, req: llm_pb2.GenerateRequest) -> tuple[str, list[llm_pb2.GenerateResponse]]:
        msgs = []
        try:
            async for msg in b.generate(req):
                msgs.append(msg)
        except grpc.aio.AioRpcError as e:
            raise APIError.from_grpc(e) from None
        return "".join(m.text for m in msgs), msgs

    @app.get("/health")
    async def health():
        b = get_backend()
        if b is None or not await b.healthy():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        if metrics is None:
            raise APIError(404, "metrics are not enabled", "not_found_error")
        body, content_type = metrics()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        b = backend()
        try:
            resp = await b.list_models()
        except grpc.aio.AioRpcError as e:
            raise APIError.from_grpc(e) from None
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": m.id, "object": "model", "created": now, "owned_by": "kvmesh", "max_model_len": m.max_model_len}
            for m in resp.models]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        b = backend()
        body.check_unsupported()
        if body.echo:
            raise APIError(400, "echo is not supported; leave it false", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported; leave it unset", param="suffix")
        model = check_model(b, body.model)
        params = body.to_proto(body.logprobs, default_max_tokens=16)
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        reqs = [build_request(f"{cid}-{i}", p, params, body) for i, p in enumerate(body.prompts())]

        def logprobs_obj(msgs: list[llm_pb2.GenerateResponse]) -> dict[str, Any] | None:
            if body.logprobs is None:
                return None
            tokens, lps, tops = [], [], []
            for m in msgs:
                for lp in m.logprobs:
                    tokens.append(b.token_str(lp.token_id))
                    lps.append(lp.logprob)
                    tops.append({b.token_str(t.token_id): t.logprob for t in lp.top})
            return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}

        if not body.stream:
            results = await asyncio.gather(*(collect(b, r) for r in reqs))
            choices, usages = [], []
            for i, (text, msgs) in enumerate(results):
                last = msgs[-1] if msgs else llm_pb2.GenerateResponse()
                choices.append({"index": i, "text": text, "logprobs": logprobs_obj(msgs),
                                "finish_reason": last.finish_reason or None})
                usages.append(_usage(last.usage))
            usage = _sum_usage(usages)
            return {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, "usage": usage}

        async def events() -> AsyncIterator[str]:
            usages = []
            try:
                async for i, msg in _merge([b.generate(r) for r in reqs]):
                    chunk = {"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i, "text": msg.text, "logprobs": logprobs_obj([msg]),
                                          "finish_reason": msg.finish_reason or None}]}
                    yield _sse(chunk)
                    if msg.finish_reason:
                        usages.append(_usage(msg.usage))
                if body.include_usage_in_stream():
                    yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": _sum_usage(usages)})
            except grpc.aio.AioRpcError as e:
                yield _sse(APIError.from_grpc(e).body())
            yield "data: [DONE]\n\n"

        return await _stream_response(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        b = backend()
        body.check_unsupported()
        model = check_model(b, body.model)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        ids = b.chat_prompt_ids(body.messages)
        original_tokens = None
        comp = compression_options(body)
        if comp is not None:
            original_tokens = len(ids)
            messages = await _compress_messages(body.messages, comp, b.tokenizer)
            ids = b.chat_prompt_ids(messages)
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.to_proto(n_logprobs, default_max_tokens=None)
        if body.max_tokens is None:
            # Until EOS, bounded by the model's context: the worker caps at max_model_len.
            params.ClearField("max_tokens")
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        req = build_request(cid, ids, params, body)

        def logprobs_obj(msgs: list[llm_pb2.GenerateResponse]) -> dict[str, Any] | None:
            if not body.logprobs:
                return None
            content = []
            for m in msgs:
                for lp in m.logprobs:
                    tok = b.token_str(lp.token_id)
                    content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                                    "top_logprobs": [{"token": b.token_str(t.token_id), "logprob": t.logprob,
                                                      "bytes": list(b.token_str(t.token_id).encode())}
                                                     for t in lp.top]})
            return {"content": content}

        if not body.stream:
            text, msgs = await collect(b, req)
            last = msgs[-1] if msgs else llm_pb2.GenerateResponse()
            return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": logprobs_obj(msgs), "finish_reason": last.finish_reason or None}],
                    "usage": _usage(last.usage, original_tokens)}

        async def events() -> AsyncIterator[str]:
            head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
            last = None
            try:
                async for msg in b.generate(req):
                    last = msg
                    delta = {"content": msg.text} if msg.text else {}
                    yield _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs_obj([msg]),
                                                     "finish_reason": msg.finish_reason or None}]})
                if body.include_usage_in_stream() and last is not None:
                    yield _sse({**head, "choices": [], "usage": _usage(last.usage, original_tokens)})
            except grpc.aio.AioRpcError as e:
                yield _sse(APIError.from_grpc(e).body())
            yield "data: [DONE]\n\n"

        return await _stream_response(events())

    return app


async def _stream_response(events: AsyncIterator[str]) -> Response:
    """Start the stream, but turn an error before the first token into a plain HTTP
    error (a bad request must not look like a 200 stream)."""
    first: list[str] = []
    it = events.__aiter__()
    try:
        first.append(await it.__anext__())
        first.append(await it.__anext__())
    except StopAsyncIteration:
        pass
    for chunk in first:
        if chunk.startswith('data: {"error"'):
            err = json.loads(chunk[len("data: "):])["error"]
            status = err.get("code") if isinstance(err.get("code"), int) else None
            code_name = err.get("code") if isinstance(err.get("code"), str) else None
            status = status or {"invalid_argument": 400, "not_found": 404, "unavailable": 503,
                                "deadline_exceeded": 504, "resource_exhausted": 429}.get(code_name or "", 500)
            return JSONResponse({"error": err}, status_code=status)

    async def body() -> AsyncIterator[str]:
        for chunk in first:
            yield chunk
        async for chunk in it:
            yield chunk

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _merge(streams: list[AsyncIterator[llm_pb2.GenerateResponse]]):
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


async def _compress_messages(messages: list[ChatMessage], options: Any, tokenizer) -> list[ChatMessage]:
    """Compress the `<context>...</context>` spans of each chat message (off the event
    loop: the compressors run models). Messages without spans are unchanged."""
    from kvmesh.compress import OPEN, compress_prompt
    from kvmesh.errors import InvalidRequestError

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
            m = ChatMessage(role=m.role, content=result.text)
        out.append(m)
    return out


def serve_http_in_thread(app: FastAPI, host: str, port: int):
    """Run `app` with uvicorn on its own thread and loop (leaves the caller's signal
    handling alone). Returns the uvicorn Server; set `server.should_exit = True` to stop."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True, name="kvmesh-http")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise OSError(f"the HTTP server did not start on {host}:{port}; is the port free?")
        time.sleep(0.05)
    return server
