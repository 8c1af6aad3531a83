"""The Ray Serve deployments of kvmesh and `build_app`, which binds them into one app.

`build_app(ServingConfig)` returns an application of three deployments (or two when
unified): `router` (the public gRPC `kvmesh.v1.LLM` server plus the OpenAI-compatible
HTTP ingress) and `prefill` / `decode` (or `unified`) workers. Each worker replica runs
the ordinary kvmesh gRPC worker (engine, paged KV cache, continuous batching, KV
transfer) on its own `LoopThread` and registers its address in the app's worker
registry (keys in Ray's GCS key-value store, serve/registry.py); a removed worker first
leaves the registry, then drains its requests, then stops. The router replica polls the
registry. Requests do not pass through Ray's request path: the router talks to workers
over gRPC, which streams tokens and KV blocks without Ray object-store copies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray
from ray import serve

from kvmesh.build import build_worker
from kvmesh.config import EngineConfig, LoRAModule
from kvmesh.router.server import RouterServer, load_router_tokenizer
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.rpc.tls import TLSFiles
from kvmesh.serve.autoscale import LatencyWindow, replica_metrics
from kvmesh.serve.config import ServingConfig
from kvmesh.serve.loop import LoopThread
from kvmesh.serve.openai import Backend, GrpcBackend, InProcessBackend, create_app, start_http
from kvmesh.serve.rank_actors import RayRankLauncher
from kvmesh.serve.registry import GcsRegistry, GcsWorkerRegistration
from kvmesh.telemetry.metrics import exposition
from kvmesh.telemetry.tracing import configure_tracing
from kvmesh.worker.server import WorkerServer, WorkerServerConfig

logger = logging.getLogger(__name__)

_ROUTER_WAIT_WORKERS_S = 600  # every role must register a worker within this


def _advertised_host(bind_host: str) -> str:
    if bind_host in ("0.0.0.0", "::", ""):
        return ray.util.get_node_ip_address()
    return bind_host


# -- workers -----------------------------------------------------------------------------


def _with_threads(engine: EngineConfig) -> EngineConfig:
    """Ray sets OMP_NUM_THREADS=1 in every replica (num_cpus is a placement count, not a
    thread count), which would run the model on one core. A worker replica uses every core
    its process may run on unless the config says otherwise (set engine.num_threads, or a
    role's engine_overrides, when several worker replicas share a node)."""
    if engine.num_threads is not None:
        return engine
    return engine.with_overrides(num_threads=len(os.sched_getaffinity(0)))


async def _start_worker(engine_config: EngineConfig, cfg: ServingConfig, role: str,
                        latency: LatencyWindow) -> WorkerServer:
    # rank_launch actors: ranks 1.. of a parallel engine are Ray actors in this replica's
    # placement group (kvmesh.serve.rank_actors); else the engine's child processes.
    actors = cfg.roles()[role].rank_launch == "actors" and engine_config.parallel.world_size > 1
    server = build_worker(engine_config, WorkerServerConfig(
        role=role, host=cfg.host, port=0, model_id=cfg.model_id, transfer_ttl_s=cfg.transfer_ttl_s),
        auth=InternalAuth.load(cfg.security.internal_token_file), on_outputs=latency.observe,
        rank_launcher=RayRankLauncher() if actors else None)
    await server.start()
    return server


class WorkerDeployment:
    """One prefill / decode / unified worker replica."""

    def __init__(self, config: dict[str, Any], role: str):
        self.config = cfg = ServingConfig.model_validate(config)
        self.role = role
        configure_tracing(cfg.tracing)
        self._loop = LoopThread(f"kvmesh-{role}")
        # TTFT / TPOT of finished requests, for the kvmesh autoscaling policy (record_autoscaling_stats).
        self._latency = LatencyWindow(window_s=cfg.slo.window_s)
        # The model loads in a thread of this process; the replica is not ready until it has.
        self.server = self._loop.run(_start_worker(_with_threads(cfg.engine_for(role)), cfg, role, self._latency))
        self.address = f"{_advertised_host(cfg.host)}:{self.server.port}"
        self._registration = GcsWorkerRegistration(cfg.name, self.address, role, cfg.registry_ttl_s)
        self._registration.register()
        logger.info("kvmesh %s worker serving at %s", role, self.address)

    async def check_health(self) -> None:
        """Ray Serve's health check: the loop runs and the engine is healthy (step loop
        alive, no step over the watchdog); failing it makes Ray Serve replace the replica."""
        if not self._loop.alive():
            raise RuntimeError("worker event loop stopped")
        ok, why = self.server.aengine.health()
        if not ok:
            raise RuntimeError(why)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics: queue depth, KV usage, TTFT / TPOT p90
        (read by kvmesh.serve.autoscale.KvmeshAutoscalingPolicy)."""
        return replica_metrics(await self._loop.run_async(self._stats()), self._latency)

    async def info(self) -> dict[str, Any]:
        """Address, role and KV block counts (tests and the admin endpoint)."""
        st = await self._loop.run_async(self._stats())
        return {"address": self.address, "role": self.role, **{k: st[k] for k in
                ("num_running", "num_waiting", "num_free_blocks", "num_usable_blocks") if k in st}}

    async def _stats(self) -> dict[str, Any]:
        return await self.server.aengine.run_between_steps(self.server.aengine.engine.stats)

    def __del__(self) -> None:
        # Scale-down / redeploy: leave placement first, then drain, then stop.
        try:
            self._registration.unregister()
        except Exception as exc:
            logger.warning("worker %s could not leave the registry (its entry expires): %r", self.address, exc)
        try:
            self._loop.run(self._drain_and_stop(), timeout_s=self.config.transfer_ttl_s + 30)
        except Exception as exc:
            logger.warning("worker %s did not drain cleanly: %r", self.address, exc)
        self._loop.stop()

    async def _drain_and_stop(self) -> None:
        eng = self.server.aengine
        deadline = time.monotonic() + self.config.transfer_ttl_s + 20
        while time.monotonic() < deadline:
            busy = eng.engine.has_unfinished() or len(self.server.servicer.transfers) > 0
            if not busy:
                break
            await asyncio.sleep(0.1)
        await self.server.stop(grace=2.0)


# -- the router and its HTTP ingress --------------------------------------------------------

# Module state of a router replica: the HTTP app (built at import, as Ray Serve's
# ingress needs) reads its backend from here.
_STATE: dict[str, Any] = {}


def _current_backend() -> Backend | None:
    return _STATE.get("backend")


_api = create_app(_current_backend, exposition)


@_api.get("/kvmesh/workers")
async def _workers_view():
    """The router's live view of its workers (role, address, load, free KV blocks)."""
    router = _STATE.get("router")
    if router is None:
        return {"workers": []}
    out = []
    for w in router.pool.handles():
        st = w.stats
        out.append({"address": w.address, "role": w.role, "healthy": w.healthy(), "in_flight": w.in_flight,
                    "num_running": st.num_running if st else None,
                    "num_free_blocks": st.num_free_blocks if st else None})
    return {"workers": out, "retiring": sorted(router.pool.retiring)}


def _wait_for_roles(registry: GcsRegistry, needed: set[str], timeout_s: float) -> None:
    """Block until every role in `needed` has a registered worker (replicas of all
    deployments start together, so the router may come up first)."""
    deadline = time.monotonic() + timeout_s
    while not needed <= set(registry.roles().values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers of roles {sorted(needed)} did not register within {timeout_s:.0f} s")
        time.sleep(0.2)


async def _start_router(registry: GcsRegistry, tokenizer, cfg: ServingConfig, min_workers: int) -> RouterServer:
    sec = cfg.security
    tls = TLSFiles(cert_file=sec.tls_cert_file, key_file=sec.tls_key_file,
                   client_ca_file=sec.tls_client_ca_file) if sec.tls else None
    adapters = [(m.name, m.path) for m in cfg.engine.lora.modules] if cfg.engine.lora is not None else []
    router = RouterServer(registry, tokenizer, cfg.router.config, cfg.model_id, cfg.host, cfg.grpc_port, tls=tls,
                          auth=InternalAuth.load(sec.internal_token_file), loopback=cfg.http_ingress == "ray_proxy",
                          adapters=adapters)
    await router.start(wait_workers_s=300, min_workers=min_workers)
    return router


@serve.ingress(_api)
class RouterDeployment:
    """The public gRPC router plus the OpenAI HTTP API: served by this replica on
    `http_port` (http_ingress 'router', the default: the path of `serve --local`, no
    proxy process in between) or reached through Ray Serve's proxy ('ray_proxy', which
    this class's ingress declaration is for)."""

    def __init__(self, config: dict[str, Any], workers: dict[str, Any]):
        self.config = cfg = ServingConfig.model_validate(config)
        configure_tracing(cfg.tracing)
        tokenizer = load_router_tokenizer(cfg.engine.model.model)
        self._registry = GcsRegistry(cfg.name, cfg.registry_ttl_s)
        self._loop = LoopThread("kvmesh-router")
        needed = set(cfg.roles())
        _wait_for_roles(self._registry, needed, _ROUTER_WAIT_WORKERS_S)
        self.router = self._loop.run(_start_router(self._registry, tokenizer, cfg, len(needed)))
        self.grpc_address = f"{_advertised_host(cfg.host)}:{self.router.port}"
        _STATE["router"] = self.router
        _api.state.kvmesh_chat = cfg.chat  # the app is built at import, before the config arrives
        self._http = None
        if cfg.http_ingress == "router":
            # HTTP on the router's loop, calling its API in-process (no loopback gRPC).
            _STATE["backend"] = InProcessBackend(self.router.api, lambda: self.router.serving, tokenizer,
                                                 cfg.model_id)
            sec = cfg.security
            self._http = self._loop.run(start_http(_api, cfg.host, cfg.http_port, ssl_certfile=sec.tls_cert_file,
                                                   ssl_keyfile=sec.tls_key_file, ssl_ca_certs=sec.tls_client_ca_file,
                                                   reuse_port=True))
        else:  # Ray Serve's proxy calls the ingress on Ray's own loop: reach the router over loopback gRPC
            _STATE["backend"] = GrpcBackend(self.router.loopback_address, tokenizer, cfg.model_id)
        logger.info("kvmesh router: gRPC at %s, HTTP %s", self.grpc_address,
                    f"on port {cfg.http_port}" if self._http else "through Ray Serve's proxy")

    async def check_health(self) -> None:
        if not self._loop.alive():
            raise RuntimeError("router event loop stopped")
        # A failed adapter sync is retried here (Ray calls reconfigure again only on a new user_config).
        if getattr(self, "_adapters_pending", False) and not self._adapters_lock().locked():
            self._adapters_task = asyncio.ensure_future(self._sync_adapters())

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve's in-place update: `user_config` = {adapters: [{name, path}, ...]}, which the
        operator renders from LLMService spec.adapters (and changes without touching any other
        deployment). The router's adapter registry becomes exactly that list: it loads new adapters on
        the workers and unloads dropped ones; no replica, router or worker, restarts. Ray calls this
        after __init__ and on every change. A sync that fails (a worker unreachable, an adapter it
        cannot read) is logged and retried from check_health, never a crash of the replica."""
        raw = (user_config or {}).get("adapters") or []
        if not isinstance(raw, list):
            raise ValueError(f"user_config.adapters must be a list of {{name, path}}, got {type(raw).__name__}")
        mods = [LoRAModule.model_validate(a) for a in raw]
        if len({m.name for m in mods}) != len(mods):
            raise ValueError("user_config.adapters: adapter names must be unique")
        self._adapters = [(m.name, m.path) for m in mods]
        self._adapters_pending = True
        await self._sync_adapters()

    def _adapters_lock(self) -> asyncio.Lock:
        lock = getattr(self, "_adapters_sync_lock", None)
        if lock is None:
            lock = self._adapters_sync_lock = asyncio.Lock()
        return lock

    async def _sync_adapters(self) -> None:
        """One sync at a time, of the latest list (a newer reconfigure waits, then syncs its own)."""
        async with self._adapters_lock():
            if not self._adapters_pending:
                return
            adapters = list(self._adapters)
            try:
                await self._loop.run_async(self.router.api.sync_adapters(adapters))
            except Exception as exc:  # noqa: BLE001  (logged, reported by /v1/models, retried)
                logger.error("router could not sync its LoRA adapters %s (retried from the health check): %r",
                             [n for n, _ in adapters], exc)
                return
            if adapters == self._adapters:
                self._adapters_pending = False
            logger.info("router serves LoRA adapters %s", [n for n, _ in adapters])

    def __del__(self) -> None:
        try:
            self._registry.close()
            if getattr(self, "_http", None) is not None:
                self._loop.run(self._http.stop(), timeout_s=15)
            self._loop.run(self.router.stop(grace=5.0), timeout_s=15)
        except Exception as exc:
            logger.warning("router did not stop cleanly: %r", exc)
        self._loop.stop()


# -- the application ----------------------------------------------------------------------


def build_app(cfg: ServingConfig) -> serve.Application:
    """The Ray Serve application for `cfg` (see the module docstring)."""
    data = cfg.runtime_dict()
    workers = {}
    for role, wl in cfg.roles().items():
        dep = serve.deployment(WorkerDeployment).options(
            name=role, **cfg.placement(role),
            health_check_period_s=5, health_check_timeout_s=30,
            graceful_shutdown_timeout_s=cfg.transfer_ttl_s + 40, graceful_shutdown_wait_loop_s=1,
            max_ongoing_requests=64, **wl.scaling_options(role, cfg.slo),
        )
        workers[role] = dep.bind(data, role)
    router = serve.deployment(RouterDeployment).options(
        name="router",
        ray_actor_options=cfg.router.resources.ray_actor_options(),
        health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=20,
        max_ongoing_requests=1024, **cfg.router.scaling_options(),
    )
    return router.bind(data, workers)
