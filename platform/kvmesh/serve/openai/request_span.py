"""The span of one HTTP generation request, in OpenTelemetry's GenAI semantic conventions.

`TraceContext` (ASGI middleware) opens a SERVER span around each POST to a generation
route when tracing is on, as a child of the caller's W3C `traceparent` header (a
gateway's trace continues into kvmesh), and ends it after the last byte of the response,
streams included. Its name is `{gen_ai.operation.name} {gen_ai.request.model}` (e.g.
`chat kvmesh`) once the route knows the model. The attributes:

- from the route (`describe`): `gen_ai.request.model`, `gen_ai.request.max_tokens`,
  `gen_ai.request.temperature`, `gen_ai.request.top_p`, `gen_ai.response.id`;
- from the router's replies (`record_final`, called by the backend per finished choice):
  `gen_ai.usage.input_tokens` (each prompt once), `gen_ai.usage.output_tokens`,
  `gen_ai.response.finish_reasons`;
- fixed: `gen_ai.system` / `gen_ai.provider.name` "kvmesh", `gen_ai.operation.name`
  (chat, text_completion), `http.request.method`, `url.path`, `http.response.status_code`.

The router calls of the request (`kvmesh.http.generate`, one per prompt) are its
children, so the trace runs on to the router and the workers. With tracing off the
middleware passes requests straight through.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvmesh._proto import llm_pb2
from kvmesh.telemetry import tracing

# POST routes that generate, and their gen_ai.operation.name.
OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat", "/v1/responses": "chat"}
SYSTEM = "kvmesh"


@dataclass
class RequestSpan:
    """The open span of the HTTP request being served, and the usage its replies add up."""

    span: Span
    operation: str
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    _prompts: set[str] = field(default_factory=set)  # request ids whose prompt is counted


CURRENT: ContextVar[RequestSpan | None] = ContextVar("kvmesh_http_request_span", default=None)


def describe(model: str, params: llm_pb2.SamplingParams, response_id: str) -> None:
    """The request attributes of the current HTTP request's span (no-op without one)."""
    rs = CURRENT.get()
    if rs is None:
        return
    attrs: dict[str, tracing.AttrValue] = {"gen_ai.request.model": model, "gen_ai.response.id": response_id}
    for name in ("max_tokens", "temperature", "top_p"):
        if params.HasField(name):
            attrs[f"gen_ai.request.{name}"] = getattr(params, name)
    rs.span.set_attributes(attrs)
    rs.span.update_name(f"{rs.operation} {model}")


def record_final(request_id: str, msg: llm_pb2.GenerateResponse) -> None:
    """Add a finished choice's usage and finish reason to the current request's span."""
    rs = CURRENT.get()
    if rs is None or not msg.finish_reason:
        return
    if request_id not in rs._prompts:  # the n choices of one prompt share it: counted once
        rs._prompts.add(request_id)
        rs.input_tokens += msg.usage.prompt_tokens
    rs.output_tokens += msg.usage.completion_tokens
    rs.finish_reasons.append(msg.finish_reason)


class TraceContext:
    """ASGI middleware: the GenAI span of each generation request (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        operation = OPERATIONS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if operation is None or scope.get("method") != "POST" or not tracing.enabled():
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        attrs = {"gen_ai.system": SYSTEM, "gen_ai.provider.name": SYSTEM, "gen_ai.operation.name": operation,
                 "http.request.method": "POST", "url.path": scope["path"]}
        status: list[int] = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        with tracing.span(operation, attrs, SpanKind.SERVER, context=tracing.extract(headers)) as span:
            if span is None:  # tracing was switched off meanwhile
                await self.app(scope, receive, send)
                return
            rs = RequestSpan(span, operation)
            token = CURRENT.set(rs)
            try:
                await self.app(scope, receive, send_status)
            finally:
                CURRENT.reset(token)
                _end_attributes(rs, status[0] if status else None)


def _end_attributes(rs: RequestSpan, status: int | None) -> None:
    attrs: dict[str, tracing.AttrValue | tuple[str, ...]] = {
        "gen_ai.usage.input_tokens": rs.input_tokens, "gen_ai.usage.output_tokens": rs.output_tokens}
    if rs.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = tuple(rs.finish_reasons)
    if status is not None:
        attrs["http.response.status_code"] = status
        if status >= 500:
            rs.span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            attrs["error.type"] = str(status)
    rs.span.set_attributes(attrs)
