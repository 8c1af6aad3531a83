"""kvmesh as a Ray Serve application.

`build_app(ServingConfig)` returns an application of three deployments (or two when
unified): `router` (the public gRPC `kvmesh.v1.LLM` server plus the OpenAI-compatible
HTTP ingress) and `prefill` / `decode` (or `unified`) workers. Ray Serve places the
replicas by their resource requests, restarts failed ones, and scales them (a fixed
count or `autoscaling_config`).

Each worker replica runs the ordinary kvmesh gRPC worker (engine, paged KV cache,
continuous batching, KV transfer) on its own event loop thread, and registers its
address with a registry held by a Ray named actor. The router replica watches that
registry, so replicas that Ray adds or removes join or leave placement without a
restart; a removed worker first leaves the registry, then drains its requests.
Requests do not pass through Ray's request path: the router talks to workers over
gRPC, which streams tokens and KV blocks without Ray object-store copies.

`build(args)` is the `import_path` builder for a Serve config file / KubeRay
`serveConfigV2`: `import_path: kvmesh.serve.app:build`, `args: {config: {...}}`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any

import ray
from ray import serve

from kvmesh.build import build_worker
from kvmesh.router.server import RouterServer, load_router_tokenizer
from kvmesh.serve.config import ServingConfig
from kvmesh.serve.openai import GrpcBackend, create_app
from kvmesh.telemetry.metrics import exposition
from kvmesh.telemetry.tracing import configure_tracing
from kvmesh.worker.server import WorkerServer, WorkerServerConfig

logger = logging.getLogger(__name__)

REGISTRY_NAMESPACE = "kvmesh"


def registry_name(app_name: str) -> str:
    return f"kvmesh-registry-{app_name}"


# -- worker registry (a Ray named actor) ---------------------------------------------


@ray.remote(num_cpus=0)
class WorkerRegistryActor:
    """Worker address -> (role, last heartbeat). Entries expire after `ttl_s` without a
    heartbeat, so a replica that dies without unregistering leaves placement too."""

    def __init__(self, ttl_s: float = 10.0):
        self.ttl_s = ttl_s
        self._workers: dict[str, tuple[str, float]] = {}

    def register(self, address: str, role: str) -> None:
        self._workers[address] = (role, time.monotonic())

    def unregister(self, address: str) -> None:
        self._workers.pop(address, None)

    def workers(self) -> dict[str, str]:
        now = time.monotonic()
        self._workers = {a: (r, t) for a, (r, t) in self._workers.items() if now - t <= self.ttl_s}
        return {a: r for a, (r, _) in self._workers.items()}


def get_registry(app_name: str, ttl_s: float) -> ray.actor.ActorHandle:
    """The app's registry actor, created by whichever replica asks first."""
    return WorkerRegistryActor.options(
        name=registry_name(app_name), namespace=REGISTRY_NAMESPACE, lifetime="detached", get_if_exists=True,
    ).remote(ttl_s)


class RayActorRegistry:
    """`kvmesh.router.registry.WorkerRegistry` over the registry actor: a thread keeps a
    copy of the address list fresh, so `addresses()` never blocks the router's loop."""

    def __init__(self, actor: ray.actor.ActorHandle, interval_s: float = 0.5):
        self._actor = actor
        self._workers: dict[str, str] = {}
        self._stop = threading.Event()
        self._fresh = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), daemon=True, name="kvmesh-registry")
        self._thread.start()

    def _poll(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                self._workers = ray.get(self._actor.workers.remote(), timeout=10)
                self._fresh.set()
            except Exception as exc:  # keep the last view; the actor may be restarting
                logger.warning("worker registry unreachable (%r); keeping the last view", exc)
            self._stop.wait(interval_s)

    def addresses(self) -> list[str]:
        return list(self._workers)

    def roles(self) -> dict[str, str]:
        return dict(self._workers)

    def wait_first_view(self, timeout_s: float) -> None:
        self._fresh.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()


# -- an event loop on its own thread ---------------------------------------------------


class LoopThread:
    """A private asyncio loop: the gRPC servers and the engine live here, away from the
    Ray replica's own loop (which serves Ray calls and HTTP)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def run_async(self, coro: Coroutine) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def alive(self) -> bool:
        return self._thread.is_alive() and self.loop.is_running()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _advertised_host(bind_host: str) -> str:
    if bind_host in ("0.0.0.0", "::", ""):
        return ray.util.get_node_ip_address()
    return bind_host


# -- deployments ---------------------------------------------------------------------------


class WorkerDeployment:
    """One prefill / decode / unified worker replica."""

    def __init__(self, config: dict[str, Any], role: str):
        self.config = cfg = ServingConfig.model_validate(config)
        self.role = role
        _configure_tracing(cfg)
        self._loop = LoopThread(f"kvmesh-{role}")
        engine_config = cfg.engine_for(role)

        async def start() -> WorkerServer:
            server = build_worker(engine_config, WorkerServerConfig(
                role=role, host=cfg.host, port=0, model_id=cfg.model_id, transfer_ttl_s=cfg.transfer_ttl_s))
            await server.start()
            return server

        # The model loads in a thread of this process; the replica is not ready until it has.
        self.server = self._loop.run(start())
        self.address = f"{_advertised_host(cfg.host)}:{self.server.port}"
        self._registry = get_registry(cfg.name, cfg.registry_ttl_s)
        ray.get(self._registry.register.remote(self.address, role))
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="kvmesh-heartbeat")
        self._heartbeat.start()
        logger.info("kvmesh %s worker serving at %s", role, self.address)

    def _beat(self) -> None:
        period = max(0.5, self.config.registry_ttl_s / 4)
        while not self._stop.wait(period):
            try:
                self._registry.register.remote(self.address, self.role)
            except Exception as exc:
                logger.warning("heartbeat to the worker registry failed: %r", exc)

    async def check_health(self) -> None:
        """Ray Serve's health check: the loop runs and the engine's step loop is alive."""
        if not self._loop.alive():
            raise RuntimeError("worker event loop stopped")
        dead = self.server.aengine._dead
        if dead is not None:
            raise RuntimeError(f"engine step loop died: {dead!r}")

    async def info(self) -> dict[str, Any]:
        """Address, role and KV block counts (tests and the admin endpoint)."""
        async def stats():
            return await self.server.aengine.run_between_steps(self.server.aengine.engine.stats)
        st = await self._loop.run_async(stats())
        return {"address": self.address, "role": self.role, **{k: st[k] for k in
                ("num_running", "num_waiting", "num_free_blocks", "num_usable_blocks") if k in st}}

    def __del__(self) -> None:
        # Scale-down / redeploy: leave placement first, then drain, then stop.
        self._stop.set()
        try:
            ray.get(self._registry.unregister.remote(self.address), timeout=5)
        except Exception:
            pass
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


# Module state of a router replica: the HTTP app (built at import, as Ray Serve's
# ingress needs) reads its backend from here.
_STATE: dict[str, Any] = {}


def _current_backend() -> GrpcBackend | None:
    return _STATE.get("backend")


def _configure_tracing(cfg: ServingConfig) -> None:
    configure_tracing(cfg.tracing)


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


@serve.ingress(_api)
class RouterDeployment:
    """The public gRPC router plus the OpenAI HTTP ingress (through Ray Serve's proxy)."""

    def __init__(self, config: dict[str, Any], workers: dict[str, Any]):
        self.config = cfg = ServingConfig.model_validate(config)
        _configure_tracing(cfg)
        tokenizer = load_router_tokenizer(cfg.engine.model.model)
        self._registry = RayActorRegistry(get_registry(cfg.name, cfg.registry_ttl_s))
        self._loop = LoopThread("kvmesh-router")
        needed = set(cfg.roles())
        # Wait until every role has a worker: replicas of all deployments start together.
        deadline = time.monotonic() + 600
        while not needed <= set(self._registry.roles().values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers of roles {sorted(needed)} did not register within 600 s")
            time.sleep(0.2)

        async def start() -> RouterServer:
            router = RouterServer(self._registry, tokenizer, cfg.router.config, cfg.model_id, cfg.host, cfg.grpc_port)
            await router.start(wait_workers_s=300, min_workers=len(needed))
            return router

        self.router = self._loop.run(start())
        self.grpc_address = f"{_advertised_host(cfg.host)}:{self.router.port}"
        local = f"127.0.0.1:{self.router.port}" if cfg.host in ("0.0.0.0", "127.0.0.1", "localhost") else \
            self.router.address
        _STATE["router"] = self.router
        _STATE["backend"] = GrpcBackend(local, tokenizer, cfg.model_id)
        logger.info("kvmesh router: gRPC at %s", self.grpc_address)

    async def check_health(self) -> None:
        if not self._loop.alive():
            raise RuntimeError("router event loop stopped")

    def __del__(self) -> None:
        try:
            self._registry.close()
            self._loop.run(self.router.stop(grace=5.0), timeout_s=15)
        except Exception:
            pass
        self._loop.stop()


def build_app(cfg: ServingConfig) -> serve.Application:
    """The Ray Serve application for `cfg` (see the module docstring)."""
    data = cfg.runtime_dict()
    workers = {}
    for role, wl in cfg.roles().items():
        dep = serve.deployment(WorkerDeployment).options(
            name=role,
            ray_actor_options=wl.resources.ray_actor_options(),
            health_check_period_s=5, health_check_timeout_s=30,
            graceful_shutdown_timeout_s=cfg.transfer_ttl_s + 40, graceful_shutdown_wait_loop_s=1,
            max_ongoing_requests=64, **wl.scaling_options(),
        )
        workers[role] = dep.bind(data, role)
    router = serve.deployment(RouterDeployment).options(
        name="router",
        ray_actor_options=cfg.router.resources.ray_actor_options(),
        health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=20,
        max_ongoing_requests=1024, **cfg.router.scaling_options(),
    )
    return router.bind(data, workers)


def build(args: dict[str, Any]) -> serve.Application:
    """Serve config / KubeRay builder: `args: {config: <ServingConfig as a mapping>}`."""
    if "config" not in args:
        raise ValueError("kvmesh.serve.app:build needs args.config (a ServingConfig mapping)")
    return build_app(ServingConfig.model_validate(args["config"]))


# -- running it -------------------------------------------------------------------------


def start_ray(address: str | None, cfg: ServingConfig) -> bool:
    """Join `address`, or start a local Ray instance sized for `cfg`. True if started here."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace=REGISTRY_NAMESPACE, log_to_driver=False)
        return False
    import os

    wanted = cfg.router.resources.num_cpus * max(1, cfg.router.replicas)
    for wl in cfg.roles().values():
        n = wl.autoscaling.max_replicas if wl.autoscaling else wl.replicas
        wanted += wl.resources.num_cpus * n
    # Logical CPUs: at least what the replicas ask for (they share the real cores).
    num_cpus = max(os.cpu_count() or 1, int(wanted + 0.999) + 1)
    ray.init(num_cpus=num_cpus, include_dashboard=False, namespace=REGISTRY_NAMESPACE, log_to_driver=False,
             object_store_memory=256 << 20)
    return True


def deploy(cfg: ServingConfig, timeout_s: float = 900.0) -> None:
    """Deploy or update the app on the connected Ray instance; returns once it runs.

    Declarative, like `serve deploy` and KubeRay: `import_path` + `args` (the config
    without placement) + per-deployment placement overrides. Ray Serve keeps replicas
    whose code and args did not change, so a new replica count scales in place."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    serve.start(http_options={"host": cfg.host, "port": cfg.http_port})
    schema = ServeDeploySchema.model_validate({"applications": [cfg.ray_serve_application()]})
    _get_global_client().deploy_apps(schema)
    time.sleep(1.0)  # let the controller pick up the new target before reading status
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(cfg.name)
        status = str(getattr(app, "status", "")) if app is not None else ""
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED") or status.endswith("UNHEALTHY"):
            raise RuntimeError(f"Ray Serve could not deploy {cfg.name!r} ({status}): {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{cfg.name!r} not running after {timeout_s:.0f}s (status {status or 'unknown'})")
        time.sleep(0.5)


def shutdown(cfg: ServingConfig, stop_ray: bool) -> None:
    try:
        serve.delete(cfg.name)
    except Exception:
        pass
    try:
        ray.kill(ray.get_actor(registry_name(cfg.name), namespace=REGISTRY_NAMESPACE))
    except Exception:
        pass
    if stop_ray:
        serve.shutdown()
        ray.shutdown()
