"""kvmesh's router as a Gateway API Inference Extension endpoint picker (EPP): an Envoy
`ext_proc` service (envoy.service.ext_proc.v3.ExternalProcessor) in front of an
InferencePool of kvmesh pods.

Per HTTP request the gateway opens one Process stream and sends the request headers,
then the body. Once the body is complete the picker chooses the worker
(`router.picker.EndpointPicker`: prefix affinity, load, free KV, LoRA) and answers, as the
EPP protocol asks, with both
  - the header `x-gateway-destination-endpoint: <ip:port>`, and
  - dynamic metadata `{"envoy.lb": {"x-gateway-destination-endpoint": "<ip:port>"}}`;
the body goes on unchanged. A request the picker refuses (no body, not JSON, no prompt:
400; unknown model: 404; no eligible worker: 503) gets an `immediate_response` with an
OpenAI-style error body at once, and the stream ends: never a hang.

Body modes (`ProcessingRequest.protocol_config`, sent by Envoy >= 1.33; else `default_mode`):
  - BUFFERED: headers are answered CONTINUE at once; the one body message (end_of_stream)
    is answered with the header mutation.
  - FULL_DUPLEX_STREAMED (what GIE gateways configure): nothing is answered until the
    body's last chunk; then a headers response carrying the mutation and a body response
    streaming the whole body back (`streamed_response`). Response headers / body chunks are
    passed back as they come.
The messages are kvmesh's wire-compatible copies of Envoy's (protos/kvmesh/v1/ext_proc.proto),
served at Envoy's method path; the xds-protos package is not needed (and not wanted: it
overwrites opentelemetry-proto's modules).

The chosen worker counts one request in flight (`WorkerHandle.in_flight`, part of its load)
from the pick until the stream ends: to the end of the response when the gateway sends
response phases (GIE does), else until Envoy closes the stream.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf import struct_pb2

from kvmesh._proto import ext_proc_pb2 as ep
from kvmesh.router.picker import EndpointPicker, Pick, PickError
from kvmesh.router.registry import WorkerPool
from kvmesh.rpc import CHANNEL_OPTIONS, add_health_and_reflection, set_serving
from kvmesh.telemetry.metrics import start_metrics_server
from kvmesh.telemetry.workers import CLUSTER, pool_source

logger = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD = f"/{SERVICE_NAME}/Process"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# ProcessingMode.BodySendMode values (envoy.extensions.filters.http.ext_proc.v3).
BUFFERED = 2
FULL_DUPLEX = 4
OVERWRITE_IF_EXISTS_OR_ADD = 2  # HeaderValueOption.HeaderAppendAction
MAX_BODY_BYTES = 64 << 20  # a body over this is refused (413) rather than buffered


def _header(key: str, value: str) -> ep.HeaderValueOption:
    # Overwrite: a client's own x-gateway-destination-endpoint must not survive next to the pick.
    return ep.HeaderValueOption(header=ep.HeaderValue(key=key, raw_value=value.encode()),
                                append_action=OVERWRITE_IF_EXISTS_OR_ADD)


def immediate(status: int, body: bytes, details: str) -> ep.ProcessingResponse:
    """The gateway answers the client with this at once (the request goes nowhere)."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=ep.HttpStatus(code=status), body=body, details=details[:200],
        headers=ep.HeaderMutation(set_headers=[_header("content-type", "application/json")])))


def _destination(endpoint: str) -> tuple[ep.CommonResponse, struct_pb2.Struct]:
    common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[_header(DESTINATION_HEADER, endpoint)]),
                               clear_route_cache=True)
    meta = struct_pb2.Struct()
    meta.update({METADATA_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return common, meta


def _headers_of(msg: ep.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _subset_of(req: ep.ProcessingRequest) -> list[str] | None:
    """The gateway's endpoint subset hint (EPP protocol), None when it sent none."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return [s.strip() for s in value.string_value.split(",") if s.strip()]


class _Exchange:
    """One HTTP request's Process stream: what has arrived and what was picked."""

    def __init__(self, default_mode: int):
        self.mode = default_mode
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.subset: list[str] | None = None
        self.pick: Pick | None = None


class ExternalProcessor:
    """The ext_proc servicer (see the module docstring); `add_to(server)` registers it."""

    def __init__(self, picker: EndpointPicker, default_mode: int = BUFFERED, pick_timeout_s: float = 10.0):
        self.picker = picker
        self.default_mode = default_mode
        self.pick_timeout_s = pick_timeout_s

    def add_to(self, server: grpc.aio.Server) -> None:
        """Serve Process at Envoy's path (the messages are kvmesh's wire-compatible copies,
        protos/kvmesh/v1/ext_proc.proto)."""
        handler = grpc.stream_stream_rpc_method_handler(
            self.Process, request_deserializer=ep.ProcessingRequest.FromString,
            response_serializer=ep.ProcessingResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Process": handler}),))

    async def Process(self, request_iterator, context):
        x = _Exchange(self.default_mode)
        try:
            async for req in request_iterator:
                if req.HasField("protocol_config") and req.protocol_config.request_body_mode:
                    x.mode = req.protocol_config.request_body_mode
                responses = await self._on(x, req)
                for resp in responses:
                    yield resp
                if any(r.HasField("immediate_response") for r in responses):
                    return
        finally:
            if x.pick is not None:
                x.pick.worker.in_flight -= 1

    async def _on(self, x: _Exchange, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = req.WhichOneof("request")
        duplex = x.mode == FULL_DUPLEX
        if kind == "request_headers":
            x.headers = _headers_of(req.request_headers)
            x.subset = _subset_of(req)
            if req.request_headers.end_of_stream:
                return [self._refuse(PickError(400, "the request has no body; send the OpenAI JSON request "
                                                    "(model, prompt or messages)"))]
            return [] if duplex else [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
        if kind == "request_body":
            x.body += req.request_body.body
            if len(x.body) > MAX_BODY_BYTES:
                return [self._refuse(PickError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB"))]
            if duplex and not req.request_body.end_of_stream:
                return []
            return await self._route(x, duplex)
        if kind == "response_headers":
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
        if kind == "response_body":
            if not duplex:
                return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
            chunk = ep.StreamedBodyResponse(body=req.response_body.body, end_of_stream=req.response_body.end_of_stream)
            return [ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
                body_mutation=ep.BodyMutation(streamed_response=chunk))))]
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    async def _route(self, x: _Exchange, duplex: bool) -> list[ep.ProcessingResponse]:
        try:
            pick = await asyncio.wait_for(self.picker.pick(bytes(x.body), x.headers, x.subset), self.pick_timeout_s)
        except PickError as exc:
            return [self._refuse(exc)]
        except asyncio.TimeoutError:
            return [self._refuse(PickError(503, f"the picker took over {self.pick_timeout_s:.0f} s; retry"))]
        except Exception as exc:  # noqa: BLE001  (a bug must answer, not hang the gateway)
            logger.exception("endpoint picker failed")
            return [self._refuse(PickError(500, f"the endpoint picker failed: {type(exc).__name__}"))]
        pick.worker.in_flight += 1
        x.pick = pick
        common, meta = _destination(pick.endpoint)
        if not duplex:
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=meta)]
        body = ep.CommonResponse(body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=bytes(x.body), end_of_stream=True)))
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=meta),
                ep.ProcessingResponse(request_body=ep.BodyResponse(response=body))]

    @staticmethod
    def _refuse(exc: PickError) -> ep.ProcessingResponse:
        return immediate(exc.status, exc.body(), f"kvmesh-epp: {exc.message}")


def destination_of(resp: ep.ProcessingResponse) -> tuple[str | None, str | None]:
    """(header value, envoy.lb metadata value) of the endpoint a response picked."""
    for phase in ("request_headers", "request_body"):
        if resp.HasField(phase):
            for h in getattr(resp, phase).response.header_mutation.set_headers:
                if h.header.key == DESTINATION_HEADER:
                    ns = resp.dynamic_metadata.fields.get(METADATA_NAMESPACE)
                    value = ns.struct_value.fields[DESTINATION_HEADER].string_value if ns is not None else None
                    return h.header.raw_value.decode(), value
    return None, None


def process_call(channel: grpc.aio.Channel):
    """The client side of Process (tests, debugging): `process_call(channel)()` opens a stream."""
    return channel.stream_stream(PROCESS_METHOD, request_serializer=ep.ProcessingRequest.SerializeToString,
                                 response_deserializer=ep.ProcessingResponse.FromString)


class EndpointPickerServer:
    """A started picker: the ext_proc service, gRPC health (overall, `liveness`, `readiness`
    and the ext_proc service, as the EPP protocol names them; NOT_SERVING while no worker
    is healthy) and the workers' Stats poller. With `metrics_port`, /metrics serves the
    workers' series and the picker's picks and scores (kvmesh_router_picks_total,
    kvmesh_router_scorer_score)."""

    HEALTH = [SERVICE_NAME, "liveness", "readiness"]

    def __init__(self, pool: WorkerPool, picker: EndpointPicker, host: str = "127.0.0.1", port: int = 9002,
                 metrics_port: int = 0, default_mode: int = BUFFERED, stats_interval_s: float = 0.5):
        self.pool, self.picker = pool, picker
        self.host, self.metrics_port, self.stats_interval_s = host, metrics_port, stats_interval_s
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.servicer = ExternalProcessor(picker, default_mode)
        self.servicer.add_to(self.server)
        self.health = add_health_and_reflection(self.server, self.HEALTH)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not listen on {host}:{port}; pick another --port")
        self.address = f"{host}:{self.port}"
        self.metrics_server = None
        self._tasks: list[asyncio.Task] = []

    async def start(self, wait_workers_s: float = 60.0, min_workers: int = 1) -> None:
        await self.pool.wait_ready(wait_workers_s, min_workers)
        CLUSTER.add(self, pool_source(self.pool))
        self.metrics_server = start_metrics_server(self.metrics_port, self.host)
        await self.server.start()
        await set_serving(self.health, self.HEALTH, True)
        self._tasks = [asyncio.create_task(self.pool.poll_forever(self.stats_interval_s)),
                       asyncio.create_task(self._watch())]

    async def _watch(self) -> None:
        serving = True
        while True:
            await asyncio.sleep(self.stats_interval_s)
            ok = any(w.healthy() for w in self.pool.handles())
            if ok != serving:
                await set_serving(self.health, [SERVICE_NAME, "readiness"], ok)
                serving = ok

    async def stop(self, grace: float = 1.0) -> None:
        for t in self._tasks:
            t.cancel()
        CLUSTER.remove(self)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        await self.server.stop(grace)
        await self.picker.loras.close()
        await self.pool.close()
