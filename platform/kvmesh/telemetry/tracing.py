"""OpenTelemetry tracing: one trace per request across router, prefill and decode.

Span tree of a disaggregated request (W3C `traceparent` in gRPC metadata links them)::

    kvmesh.router.generate            router, child of the client's context if it sent one
      kvmesh.worker.prefill           prefill worker
      kvmesh.worker.decode            decode worker (kvmesh.worker.generate when unified)
        kvmesh.kv_transfer.pull       decode worker pulling the prefill worker's KV

Over HTTP two spans come first, the router span then being a child of the second:
`{operation} {model}` (e.g. `chat kvmesh`: the request, child of the caller's W3C
`traceparent` header, with the GenAI semantic-convention attributes;
serve/openai/request_span.py) and under it `kvmesh.http.generate` (one per router call).

Off by default: with no tracer provider installed every helper here returns None or
yields None after one isinstance check, and call sites pass None along (no span
objects, no context propagation). Spans are never made "current" (no contextvars):
the servicers are async generators that yield across the span's lifetime, so
parents are passed explicitly instead.

Turn it on with `configure_tracing(TracingConfig(otlp_endpoint=...))`, by installing
any SDK TracerProvider globally, or (tests) with `set_tracer_provider(provider)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvmesh.config import TracingConfig
from kvmesh.errors import ConfigError

logger = logging.getLogger(__name__)

_TRACER_NAME = "kvmesh"
_tracer: trace.Tracer | None = None
_provider = None  # the SDK provider configure_tracing installed (flushed by shutdown_tracing)

AttrValue = str | bool | int | float


def configure_tracing(cfg: TracingConfig | None):
    """Install a TracerProvider exporting to `cfg.otlp_endpoint` (OTLP/gRPC); a no-op
    returning None when `cfg` is None or has no endpoint. Returns the provider.

    Call once per process, before serving (the router process and every worker
    process each call it). A second call with an endpoint reuses the first provider.
    """
    global _provider
    if cfg is None or not cfg.otlp_endpoint:
        return None
    if _provider is not None:
        return _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:  # optional extra
        raise ConfigError("tracing.otlp_endpoint is set but the OTLP exporter is not installed: "
                          "pip install opentelemetry-exporter-otlp-proto-grpc (or unset otlp_endpoint)") from e
    endpoint = cfg.otlp_endpoint
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))))
    trace.set_tracer_provider(provider)
    set_tracer_provider(provider)
    _provider = provider
    logger.info("tracing: exporting spans to %s (sample ratio %s)", endpoint, cfg.sample_ratio)
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the provider configure_tracing installed (process exit)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def set_tracer_provider(provider: trace.TracerProvider | None) -> None:
    """Use `provider` for kvmesh spans (None: back to the global provider, i.e. off
    unless one is installed). Unlike the global one it can be swapped: tests use it."""
    global _tracer
    _tracer = provider.get_tracer(_TRACER_NAME) if provider is not None else None


def tracer() -> trace.Tracer | None:
    """kvmesh's tracer, or None when tracing is off."""
    global _tracer
    if _tracer is not None:
        return _tracer
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    _tracer = provider.get_tracer(_TRACER_NAME)
    return _tracer


def enabled() -> bool:
    return tracer() is not None


# -- spans ------------------------------------------------------------------------


@contextmanager
def server_span(name: str, context,
                attributes: Mapping[str, AttrValue] | None = None) -> Iterator[Span | None]:
    """A SERVER span for one call, child of the caller's trace context in its metadata:
    `context` is a gRPC servicer context, the call's (key, value) metadata pairs, or None.
    Yields None when tracing is off."""
    t = tracer()
    if t is None:
        yield None
        return
    parent = propagate.extract(_metadata_dict(context)) if context is not None else None
    span = t.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    with _ending(span, context if hasattr(context, "invocation_metadata") else None):
        yield span


@contextmanager
def span(name: str, attributes: Mapping[str, AttrValue] | None = None,
         kind: SpanKind = SpanKind.SERVER, context: Context | None = None) -> Iterator[Span | None]:
    """A span under `context` (a caller's, from `extract`) or else the current
    OpenTelemetry context (a root span when there is none), e.g. around an HTTP handler
    that calls the router: pass `grpc_metadata(span)` with the call. Yields None when
    tracing is off."""
    t = tracer()
    if t is None:
        yield None
        return
    s = t.start_span(name, context=context, kind=kind, attributes=attributes)
    with _ending(s, None):
        yield s


@contextmanager
def child_span(name: str, parent: Span | None, attributes: Mapping[str, AttrValue] | None = None,
               kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span | None]:
    """A span under `parent`; None (and no work) when `parent` is None."""
    t = tracer() if parent is not None else None
    if t is None:
        yield None
        return
    span = t.start_span(name, context=trace.set_span_in_context(parent), kind=kind, attributes=attributes)
    with _ending(span, None):
        yield span


@contextmanager
def _ending(span: Span, context: grpc.aio.ServicerContext | None) -> Iterator[None]:
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):
        span.set_attribute("kvmesh.cancelled", True)
        raise
    except grpc.aio.AbortError:
        # The handler already chose a status (context.abort); the cause, if any, is chained.
        code = context.code() if context is not None else None
        if code is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
        cause = context.details() if context is not None else None
        span.set_status(Status(StatusCode.ERROR, str(cause or "aborted")))
        raise
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()


def client_span(name: str, parent: Span | None,
                attributes: Mapping[str, AttrValue] | None = None):
    """A CLIENT span (an outgoing call) under `parent`; yields None when `parent` is None."""
    return child_span(name, parent, attributes, SpanKind.CLIENT)


def set_attributes(span: Span | None, attributes: Mapping[str, AttrValue]) -> None:
    if span is not None:
        span.set_attributes(attributes)


def set_request_output(span: Span | None, out) -> None:
    """Token counts and finish reason of a finished kvmesh.engine.outputs.RequestOutput."""
    if span is not None:
        c = out.outputs[0]
        span.set_attributes({"kvmesh.prompt_tokens": len(out.prompt_token_ids),
                             "kvmesh.cached_prompt_tokens": out.num_cached_tokens,
                             "kvmesh.completion_tokens": len(c.token_ids),
                             "kvmesh.finish_reason": c.finish_reason or ""})


def record_error(span: Span | None, exc: BaseException) -> None:
    """Mark a span failed by an exception the handler turns into a gRPC status."""
    if span is not None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


# -- propagation ------------------------------------------------------------------


def grpc_metadata(span: Span | None) -> tuple[tuple[str, str], ...] | None:
    """Metadata carrying `span` as the parent of the callee's spans (traceparent,
    tracestate), for an outgoing gRPC call; None when `span` is None."""
    if span is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract(headers: Mapping[str, str]) -> Context | None:
    """The caller's trace context in W3C `traceparent` / `tracestate` headers (HTTP),
    as the gRPC servers read it from metadata; None when tracing is off or none was sent."""
    if tracer() is None or "traceparent" not in headers:
        return None
    return propagate.extract(headers)


def _metadata_dict(context) -> dict[str, Any]:
    """The call's metadata as a dict: from a gRPC servicer context, or given as (key, value) pairs."""
    if hasattr(context, "invocation_metadata"):
        return {m.key: m.value for m in context.invocation_metadata() or ()}
    return dict(context)
