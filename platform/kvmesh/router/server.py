"""Router process: `python -m kvmesh.router --worker HOST:PORT ... [--config FILE.json]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import grpc

from kvmesh._proto import llm_pb2_grpc
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import StaticRegistry, WorkerPool, WorkerRegistry
from kvmesh.router.service import SERVICE_NAME, LLMServicer
from kvmesh.serve.protocol import CHANNEL_OPTIONS, add_health_and_reflection, run_until_signalled, set_serving
from kvmesh.telemetry.metrics import start_metrics_server
from kvmesh.telemetry.workers import CLUSTER, pool_source

logger = logging.getLogger(__name__)


class RouterServer:
    """A started router: the LLM service, health, reflection and the Stats poller.

    While started, its workers' Stats are in kvmesh's metrics registry (so
    `kvmesh.telemetry.metrics.exposition()` in this process covers the cluster); with
    `metrics_port` it also serves them on http://host:metrics_port/metrics."""

    def __init__(self, registry: WorkerRegistry, tokenizer, config: RouterConfig | None = None,
                 model_id: str = "kvmesh", host: str = "127.0.0.1", port: int = 0, metrics_port: int = 0):
        self.config = config = config or RouterConfig()
        self.host, self.metrics_port = host, metrics_port
        self.metrics_server = None
        self.pool = WorkerPool(registry, config.affinity_capacity, config.max_block_hashes,
                               config.stats_timeout_s, config.unhealthy_cooldown_s)
        from kvmesh.serve.auth import ApiKeyInterceptor, api_key

        key = api_key()
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS,
                                      interceptors=[ApiKeyInterceptor(key)] if key else None)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not listen on {host}:{port}; pick another --port")
        self.address = f"{host}:{self.port}"
        self.servicer = LLMServicer(self.pool, config, tokenizer, model_id)
        llm_pb2_grpc.add_LLMServicer_to_server(self.servicer, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self._poller: asyncio.Task | None = None

    async def start(self, wait_workers_s: float = 60.0, min_workers: int = 1) -> None:
        await self.pool.wait_ready(wait_workers_s, min_workers)
        self._poller = asyncio.create_task(self.pool.poll_forever(self.config.stats_interval_s))
        CLUSTER.add(self, pool_source(self.pool))
        self.metrics_server = start_metrics_server(self.metrics_port, self.host)
        await self.server.start()
        await set_serving(self.health, [SERVICE_NAME], True)

    async def stop(self, grace: float = 2.0) -> None:
        await set_serving(self.health, [SERVICE_NAME], False)
        if self._poller is not None:
            self._poller.cancel()
        CLUSTER.remove(self)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        await self.server.stop(grace)
        await self.pool.close()


def load_router_tokenizer(model: str | None):
    from kvmesh.models.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model, progress=False))


def start_http(router: RouterServer, tokenizer, model_id: str, host: str, port: int):
    """The OpenAI-compatible HTTP API in this process, over loopback gRPC to `router`."""
    from kvmesh.serve.openai import GrpcBackend, create_app, serve_http_in_thread

    backend = GrpcBackend(f"127.0.0.1:{router.port}" if host in ("0.0.0.0", "127.0.0.1") else router.address,
                          tokenizer, model_id)
    try:
        from kvmesh.telemetry.metrics import exposition
    except ImportError:  # pragma: no cover
        exposition = None
    return serve_http_in_thread(create_app(lambda: backend, exposition), host, port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvmesh.router", description="kvmesh gRPC router")
    p.add_argument("--worker", action="append", required=True, help="worker address HOST:PORT (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    p.add_argument("--model", default=None, help="checkpoint folder, for the tokenizer (default: embedded model)")
    p.add_argument("--model-id", default="kvmesh")
    p.add_argument("--config", default=None, help="RouterConfig as a JSON file")
    p.add_argument("--pd-threshold-tokens", type=int, default=None, help="overrides the config's value")
    p.add_argument("--picker", default=None, help="overrides the config's picker (e.g. round_robin)")
    p.add_argument("--min-workers", type=int, default=None, help="workers to wait for (default: all)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics (router + every worker's stats) on this port (0 = off)")
    p.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans here (OTLP/gRPC; default off)")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (default: off)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raw = json.loads(open(args.config).read()) if args.config else {}
    if args.pd_threshold_tokens is not None:
        raw["pd_threshold_tokens"] = args.pd_threshold_tokens
    if args.picker is not None:
        raw["picker"] = args.picker
    config = RouterConfig(**raw)
    if args.otlp_endpoint:
        from kvmesh.serve.config import TracingConfig
        from kvmesh.telemetry.tracing import configure_tracing

        configure_tracing(TracingConfig(otlp_endpoint=args.otlp_endpoint, service_name="kvmesh-router"))
    tokenizer = load_router_tokenizer(args.model)

    async def run() -> None:
        router = RouterServer(StaticRegistry(args.worker), tokenizer, config, args.model_id, args.host, args.port,
                              metrics_port=args.metrics_port)

        http = None

        async def start() -> None:
            nonlocal http
            await router.start(min_workers=args.min_workers or len(args.worker))
            if args.http_port is not None:
                http = start_http(router, tokenizer, args.model_id, args.host, args.http_port)
                print(f"KVMESH_ROUTER_HTTP url=http://{args.host}:{http.config.port}", flush=True)
            print(f"KVMESH_ROUTER_READY address={router.address}", flush=True)

        async def stop() -> None:
            if http is not None:
                http.should_exit = True
            await router.stop()

        await run_until_signalled(start, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
