"""One trace per request across router, prefill worker, KV pull and decode worker."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.telemetry import tracing

pytestmark = pytest.mark.timeout(120)

SPANS = ("client", "kvmesh.router.generate", "kvmesh.worker.prefill", "kvmesh.kv_transfer.pull",
         "kvmesh.worker.decode")


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    try:
        yield provider, exporter
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()


async def _generate(address: str, ids: list[int], metadata=None, max_tokens: int = 6):
    req = llm_pb2.GenerateRequest(request_id="traced-1", prompt_token_ids=ids, params=llm_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as ch:
        return [m async for m in llm_pb2_grpc.LLMStub(ch).Generate(req, timeout=30, metadata=metadata)]


def _wait_spans(exporter, names, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        spans = {s.name: s for s in exporter.get_finished_spans()}
        if all(n in spans for n in names) or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def test_pd_request_is_one_trace_with_correct_parents(cluster, exporter):
    provider, exporter = exporter
    client = provider.get_tracer("test").start_span("client")
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(client))
    ids = list(range(10, 50))  # 10 full blocks
    msgs = cluster.loop.run(_generate(cluster.pd_router.address, ids, tuple(carrier.items())))
    client.end()
    assert sum(len(m.token_ids) for m in msgs) == 6

    spans = _wait_spans(exporter, SPANS)
    assert set(SPANS) <= set(spans), sorted(spans)
    assert len({spans[n].context.trace_id for n in SPANS}) == 1
    parent_of = {n: spans[n].parent.span_id for n in SPANS[1:]}
    span_id = {n: spans[n].context.span_id for n in SPANS}
    assert parent_of == {
        "kvmesh.router.generate": span_id["client"],
        "kvmesh.worker.prefill": span_id["kvmesh.router.generate"],
        "kvmesh.worker.decode": span_id["kvmesh.router.generate"],
        "kvmesh.kv_transfer.pull": span_id["kvmesh.worker.decode"],
    }
    router = spans["kvmesh.router.generate"].attributes
    assert router["kvmesh.request_id"] == "traced-1" and router["kvmesh.mode"] == "pd"
    assert router["kvmesh.prompt_tokens"] == 40 and router["kvmesh.completion_tokens"] == 6
    assert router["kvmesh.prefill_worker"] == cluster.prefill.address
    assert router["kvmesh.decode_workers"] == cluster.decode.address
    pull = spans["kvmesh.kv_transfer.pull"].attributes
    assert pull["kvmesh.kv_blocks"] == 10 and pull["kvmesh.kv_bytes"] > 0
    assert spans["kvmesh.kv_transfer.pull"].kind == trace.SpanKind.CLIENT
    prefill = spans["kvmesh.worker.prefill"].attributes
    assert prefill["kvmesh.worker"] == cluster.prefill.address and prefill["kvmesh.prompt_tokens"] == 40
    assert spans["kvmesh.worker.decode"].attributes["kvmesh.role"] == "decode"
    # The pull happens inside the decode span, before its first token.
    assert spans["kvmesh.worker.decode"].start_time <= spans["kvmesh.kv_transfer.pull"].start_time
    assert spans["kvmesh.kv_transfer.pull"].end_time <= spans["kvmesh.worker.decode"].end_time


def test_unified_request_and_router_root_span(cluster, exporter):
    _, exporter = exporter
    cluster.loop.run(_generate(cluster.uni_router.address, list(range(60, 70))))
    spans = _wait_spans(exporter, ("kvmesh.router.generate", "kvmesh.worker.generate"))
    router, worker = spans["kvmesh.router.generate"], spans["kvmesh.worker.generate"]
    assert router.parent is None  # no incoming context: the router starts the trace
    assert worker.parent.span_id == router.context.span_id
    assert router.attributes["kvmesh.mode"] == "unified"
    assert worker.attributes["kvmesh.finish_reason"] == "length"
    assert "kvmesh.worker.prefill" not in spans


def test_an_ingress_span_parents_the_router_span(cluster, exporter):
    _, exporter = exporter
    with tracing.span("http.ingress", {"http.route": "/v1/completions"}) as ingress:
        cluster.loop.run(_generate(cluster.uni_router.address, list(range(70, 80)), tracing.grpc_metadata(ingress)))
    spans = _wait_spans(exporter, ("http.ingress", "kvmesh.router.generate"))
    assert spans["kvmesh.router.generate"].parent.span_id == spans["http.ingress"].context.span_id


def test_failed_request_marks_the_router_span(cluster, exporter):
    _, exporter = exporter

    async def bad():
        req = llm_pb2.GenerateRequest(prompt_token_ids=[5], params=llm_pb2.SamplingParams(temperature=-1))
        async with grpc.aio.insecure_channel(cluster.uni_router.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await llm_pb2_grpc.LLMStub(ch).Generate(req, timeout=10).read()
            return e.value.code()

    assert cluster.loop.run(bad()) == grpc.StatusCode.INVALID_ARGUMENT
    span = _wait_spans(exporter, ("kvmesh.router.generate",))["kvmesh.router.generate"]
    assert span.status.status_code == trace.StatusCode.ERROR and "temperature" in span.status.description
    assert span.attributes["kvmesh.finish_reason"] == "error"


def test_tracing_off_makes_no_spans_and_sends_no_context(cluster):
    assert not tracing.enabled()
    assert tracing.grpc_metadata(None) is None
    with tracing.server_span("x", None) as span:
        assert span is None
    msgs = cluster.loop.run(_generate(cluster.pd_router.address, list(range(100, 120))))
    assert sum(len(m.token_ids) for m in msgs) == 6


def test_configure_tracing_is_off_without_endpoint():
    from kvmesh.serve.config import TracingConfig

    assert tracing.configure_tracing(None) is None
    assert tracing.configure_tracing(TracingConfig()) is None
    assert not tracing.enabled()


def test_configure_tracing_with_endpoint_installs_an_otlp_provider():
    # In a child process: the global provider can be set only once per process.
    code = """
from opentelemetry import trace
from kvmesh.serve.config import TracingConfig
from kvmesh.telemetry import tracing
p = tracing.configure_tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9", service_name="t", sample_ratio=0.0))
assert p is trace.get_tracer_provider() and tracing.enabled()
assert tracing.configure_tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9")) is p
assert p.resource.attributes["service.name"] == "t"
with tracing.server_span("s", None) as span:
    assert tracing.grpc_metadata(span)[0][0] == "traceparent"
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]
