"""The router server: the public gRPC LLM service, health, reflection and the workers' Stats
poller. Run one with `kvmesh router --worker HOST:PORT ...`."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvmesh._proto import llm_pb2_grpc
from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path
from kvmesh.router.api import RouterAPI
from kvmesh.router.config import RouterConfig
from kvmesh.router.ratelimit import RateLimiter
from kvmesh.router.registry import WorkerPool, WorkerRegistry
from kvmesh.router.service import SERVICE_NAME, LLMServicer
from kvmesh.rpc import CHANNEL_OPTIONS, add_health_and_reflection, set_serving
from kvmesh.rpc.auth import ApiKeyInterceptor, ApiKeys
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.rpc.tls import TLSFiles, add_port
from kvmesh.telemetry.metrics import start_metrics_server
from kvmesh.telemetry.workers import CLUSTER, pool_source

logger = logging.getLogger(__name__)


class RouterServer:
    """A started router: the LLM service, health, reflection and the Stats poller.

    While started, its workers' Stats are in kvmesh's metrics registry (so
    `kvmesh.telemetry.metrics.exposition()` in this process covers the cluster); with
    `metrics_port` it also serves them on http://host:metrics_port/metrics.

    Security: `tls` serves the public port over TLS; API keys come from the environment
    (rpc/auth.py); calls to workers carry `auth` (default: the internal token / mTLS of the
    environment, rpc/internal_auth.py).

    `adapters`: the LoRA adapters served from start-up, (name, path) pairs (the engine
    config's `lora.modules`); more are loaded at run time (LoadLoRAAdapter)."""

    def __init__(self, registry: WorkerRegistry, tokenizer, config: RouterConfig | None = None,
                 model_id: str = "kvmesh", host: str = "127.0.0.1", port: int = 0, metrics_port: int = 0,
                 tls: TLSFiles | None = None, auth: InternalAuth | None = None, loopback: bool = False,
                 adapters: list[tuple[str, str]] | tuple = ()):
        self.config = config = config or RouterConfig()
        self.host, self.metrics_port = host, metrics_port
        self.metrics_server = None
        self.pool = WorkerPool(registry, config.affinity_capacity, config.max_block_hashes,
                               config.stats_timeout_s, config.unhealthy_cooldown_s,
                               kv_events=config.kv_events,
                               auth=auth if auth is not None else InternalAuth.load())
        keys = ApiKeys.from_env()
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS,
                                      interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else None)
        self.tls = tls
        self.port = add_port(self.server, f"{host}:{port}", tls)
        if self.port == 0:
            raise OSError(f"could not listen on {host}:{port}; pick another --port")
        self.address = f"{host}:{self.port}"
        # The way in for an HTTP layer on another event loop (Ray Serve's proxy ingress; the
        # router's own HTTP server calls the servicer in-process): without TLS, the public
        # port; with TLS, only if `loopback` asks for it, a second, plaintext port on
        # loopback only (API keys still apply).
        local_host = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        self.loopback_address: str | None = f"{local_host}:{self.port}"
        if tls is not None:
            self.loopback_address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}" if loopback else None
        # The typed API both front ends call: this gRPC service and the in-process HTTP layer.
        self.api = RouterAPI(self.pool, config, tokenizer, model_id, keys, RateLimiter(config.rate_limit), adapters)
        self.servicer = LLMServicer(self.api)
        llm_pb2_grpc.add_LLMServicer_to_server(self.servicer, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.serving = False  # what gRPC health says (the in-process HTTP backend reads it)
        self._poller: asyncio.Task | None = None
        self._health_watch: asyncio.Task | None = None

    async def start(self, wait_workers_s: float = 60.0, min_workers: int = 1) -> None:
        await self.pool.wait_ready(wait_workers_s, min_workers)
        self._poller = asyncio.create_task(self.pool.poll_forever(self.config.stats_interval_s))
        CLUSTER.add(self, pool_source(self.pool))
        self.metrics_server = start_metrics_server(self.metrics_port, self.host)
        await self.server.start()
        await set_serving(self.health, [SERVICE_NAME], True)
        self.serving = True
        self._health_watch = asyncio.create_task(self._watch_workers())

    async def _watch_workers(self) -> None:
        """gRPC health (and so the HTTP /health) is NOT_SERVING while no worker is healthy."""
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            ok = any(w.healthy() for w in self.pool.handles())
            if ok != self.serving:
                logger.log(logging.INFO if ok else logging.ERROR, "router %s: %s", "serving again" if ok else
                           "NOT_SERVING", "a worker is healthy" if ok else "no healthy worker")
                await set_serving(self.health, [SERVICE_NAME], ok)
                self.serving = ok

    async def stop(self, grace: float = 2.0) -> None:
        if self._health_watch is not None:
            self._health_watch.cancel()
        self.serving = False
        await set_serving(self.health, [SERVICE_NAME], False)
        if self._poller is not None:
            self._poller.cancel()
        CLUSTER.remove(self)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        await self.server.stop(grace)
        await self.api.loras.close()
        await self.pool.close()
        await self.api.limiter.close()


def load_router_tokenizer(model: str | None):
    """The tokenizer of the served checkpoint (the embedded model when None)."""
    return load_tokenizer(resolve_model_path(model, progress=False))
