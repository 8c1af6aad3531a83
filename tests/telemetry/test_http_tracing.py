"""The OpenAI HTTP API continues a gateway's trace: a request with a W3C `traceparent`
header yields spans in that trace (HTTP request -> kvmesh.http.generate -> router ->
worker), the request span carrying the GenAI semantic-convention attributes. The HTTP
server is the real one, on the router's loop, over the in-process cluster's unified router."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.telemetry import tracing

pytestmark = pytest.mark.timeout(120)

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()


@pytest.fixture(scope="module")
def http(cluster):
    from kvmesh.cli.processes import serve_router_http

    router = cluster.uni_router
    server = cluster.loop.run(serve_router_http(router, cluster.prefill.aengine.tokenizer, "uni", "127.0.0.1", 0), timeout_s=30)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        cluster.loop.run(server.stop(), timeout_s=30)


def _spans(exporter, want: int, timeout: float = 10.0):
    """The finished spans, once the HTTP request span (it ends last) and `want` spans are in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = list(exporter.get_finished_spans())
        if len(spans) >= want and any("gen_ai.operation.name" in s.attributes for s in spans):
            return spans
        time.sleep(0.05)
    return list(exporter.get_finished_spans())


def test_traceparent_continues_into_kvmesh_spans_with_genai_attributes(http, exporter):
    r = httpx.post(f"{http}/v1/completions", headers={"traceparent": TRACEPARENT}, timeout=60, json={
        "model": "uni", "prompt": [5, 9, 14, 3, 77, 120, 8], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "ignore_eos": True, "seed": 3})
    assert r.status_code == 200, r.text
    spans = {s.name: s for s in _spans(exporter, 4)}
    names = ("text_completion uni", "kvmesh.http.generate", "kvmesh.router.generate", "kvmesh.worker.generate")
    assert set(names) <= set(spans), sorted(spans)
    assert {spans[n].context.trace_id for n in names} == {TRACE_ID}  # the gateway's trace, end to end
    request, call, router = (spans[n] for n in names[:3])
    assert request.parent.span_id == PARENT_ID and request.kind == trace.SpanKind.SERVER
    assert call.parent.span_id == request.context.span_id and call.kind == trace.SpanKind.CLIENT
    assert router.parent.span_id == call.context.span_id
    attrs = request.attributes
    assert attrs["gen_ai.system"] == "kvmesh" and attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "uni" and attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.temperature"] == 0.5 and attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.usage.input_tokens"] == 7 and attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.response.id"] == r.json()["id"]
    assert attrs["http.response.status_code"] == 200
    assert router.attributes["kvmesh.completion_tokens"] == 5  # kvmesh's own attributes stay


def test_a_streamed_batch_counts_each_prompt_once(http, exporter):
    with httpx.stream("POST", f"{http}/v1/completions", headers={"traceparent": TRACEPARENT}, timeout=60, json={
            "model": "uni", "prompt": [[5, 9, 14], [3, 77, 120, 8]], "n": 2, "max_tokens": 3, "ignore_eos": True,
            "stream": True}) as r:
        body = r.read().decode()
    assert body.rstrip().endswith("[DONE]")
    request = next(s for s in _spans(exporter, 7) if s.name == "text_completion uni")
    assert request.attributes["gen_ai.usage.input_tokens"] == 7  # two prompts, each once for its 2 choices
    assert request.attributes["gen_ai.usage.output_tokens"] == 12
    assert request.attributes["gen_ai.response.finish_reasons"] == ("length",) * 4
    calls = [s for s in exporter.get_finished_spans() if s.name == "kvmesh.http.generate"]
    assert len(calls) == 2 and all(c.parent.span_id == request.context.span_id for c in calls)


def test_without_traceparent_the_request_span_is_the_root(http, exporter):
    r = httpx.post(f"{http}/v1/completions", timeout=60, json={"model": "uni", "prompt": [5, 9], "max_tokens": 2})
    assert r.status_code == 200
    request = next(s for s in _spans(exporter, 4) if s.name == "text_completion uni")
    assert request.parent is None
    bad = httpx.post(f"{http}/v1/completions", timeout=60, json={"model": "uni", "prompt": [5], "temperature": "hot"})
    assert bad.status_code == 400
    failed = [s for s in _spans(exporter, 5) if s.attributes.get("http.response.status_code") == 400]
    assert failed and failed[0].name == "text_completion"  # refused before the model was known


def test_tracing_off_adds_no_span_and_serves(http):
    assert not tracing.enabled()
    r = httpx.post(f"{http}/v1/completions", headers={"traceparent": TRACEPARENT}, timeout=60,
                   json={"model": "uni", "prompt": [5, 9], "max_tokens": 2})
    assert r.status_code == 200
