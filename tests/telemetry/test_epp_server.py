"""The endpoint picker server (`kvmesh epp`'s EndpointPickerServer) over the in-process
cluster's real workers: it polls their Stats, answers gRPC health as the EPP protocol names
it, picks over a real ext_proc stream, and counts its picks in the shared /metrics."""

from __future__ import annotations

import asyncio
import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh._proto import ext_proc_pb2 as ep
from kvmesh.router.config import RouterConfig
from kvmesh.router.ext_proc import BUFFERED, EndpointPickerServer, destination_of, process_call
from kvmesh.router.picker import EndpointPicker
from kvmesh.router.registry import StaticRegistry, WorkerPool
from kvmesh.telemetry.metrics import REGISTRY
from kvmesh.telemetry.workers import worker_label


def test_picker_server_picks_a_real_worker_and_reports_health(cluster):
    cfg = RouterConfig(stats_interval_s=0.1)

    async def main():
        pool = WorkerPool(StaticRegistry([cluster.prefill.address, cluster.decode.address]), cfg.affinity_capacity,
                          cfg.max_block_hashes, cfg.stats_timeout_s, cfg.unhealthy_cooldown_s, kv_events=True)
        picker = EndpointPicker(pool, cfg, cluster.prefill.aengine.tokenizer, "kvmesh", target_port=8000)
        server = EndpointPickerServer(pool, picker, port=0, default_mode=BUFFERED, stats_interval_s=0.1)
        await server.start(wait_workers_s=30, min_workers=2)
        label = worker_label(cluster.decode.address, "decode")
        before = REGISTRY.get_sample_value("kvmesh_router_picks_total", {"stage": "decode", "worker": label}) or 0
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
                call = process_call(ch)()
                await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=ep.HeaderMap(
                    headers=[ep.HeaderValue(key=":path", raw_value=b"/v1/completions")]))))
                assert (await asyncio.wait_for(call.read(), 5)).HasField("request_headers")
                body = json.dumps({"model": "kvmesh", "prompt": "hello there, picker", "max_tokens": 4}).encode()
                await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
                header, meta = destination_of(await asyncio.wait_for(call.read(), 5))
                await call.done_writing()
                assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
        finally:
            await server.stop()
        # The decode worker (the role filter keeps prefill workers out of a unified request), at the HTTP port.
        host = cluster.decode.address.rpartition(":")[0]
        assert header == meta == f"{host}:8000"
        after = REGISTRY.get_sample_value("kvmesh_router_picks_total", {"stage": "decode", "worker": label})
        assert after == before + 1

    cluster.loop.run(main())
