"""kvmesh as a Ray Serve application: the entry point and its lifecycle.

`build(args)` is the `import_path` builder for a Serve config file / KubeRay
`serveConfigV2`: `import_path: kvmesh.serve.app:build`, `args: {config: {...}}`; it
validates the ServingConfig and hands it to `build_app` (serve/deployments.py: router
and worker deployments, placed, restarted and scaled by Ray Serve). `start_ray` joins a
Ray cluster or starts a local instance sized for the config, `deploy` applies the app
declaratively (as `serve deploy` and KubeRay do) and waits until it runs, and
`shutdown` deletes the app and its worker registry entries. The worker registry (keys in
Ray's GCS key-value store) lives in serve/registry.py, the replicas' private event loops
in serve/loop.py.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from kvmesh.serve.config import ServingConfig
from kvmesh.serve.deployments import build_app
from kvmesh.serve.registry import REGISTRY_NAMESPACE, clear_registry

logger = logging.getLogger(__name__)

__all__ = ["build", "build_app", "deploy", "shutdown", "start_ray"]


def build(args: dict[str, Any]) -> serve.Application:
    """Serve config / KubeRay builder: `args: {config: <ServingConfig as a mapping>}`."""
    if "config" not in args:
        raise ValueError("kvmesh.serve.app:build needs args.config (a ServingConfig mapping)")
    return build_app(ServingConfig.model_validate(args["config"]))


# Timers of the Ray daemons that `start_ray` slows on the instance it starts (see there).
LOCAL_RAY_ENV = {
    # The Serve controller's reconcile loop, 0.1 s by default (~2.5% of a core on a small
    # machine). Every 0.5 s still reacts to health and autoscaling well within their periods.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # The log monitor globs the session's log folder for new files every 0.1 s while it
    # holds fewer than this many (then every LOG_NAME_UPDATE_INTERVAL_S). With 0 it looks
    # for new files every 2 s; lines of files it knows are still read every 0.1 s.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
}


def start_ray(address: str | None, cfg: ServingConfig) -> bool:
    """Join `address`, or start a local Ray instance sized for `cfg`. True if started here."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace=REGISTRY_NAMESPACE, log_to_driver=False)
        return False
    wanted = cfg.router.resources.num_cpus * max(1, cfg.router.replicas)
    for wl in cfg.roles().values():
        n = wl.autoscaling.max_replicas if wl.autoscaling else wl.replicas
        wanted += wl.resources.num_cpus * n
    # Logical CPUs: at least what the replicas ask for (they share the real cores).
    num_cpus = max(os.cpu_count() or 1, int(wanted + 0.999) + 1)
    # Processes of the local instance inherit this environment (a cluster sets it in its
    # pods). Each entry slows a daemon's timer that wakes on the model's cores: a daemon
    # that preempts one thread of the model's OpenMP team stalls the whole team at the next
    # barrier, so a percent of a core taken costs up to two on a 2-core node.
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(num_cpus=num_cpus, include_dashboard=False, namespace=REGISTRY_NAMESPACE, log_to_driver=False,
             object_store_memory=256 << 20)
    return True


def http_options(cfg: ServingConfig) -> dict[str, Any]:
    """Ray Serve's HTTP proxy options (http_ingress 'ray_proxy'): HTTPS with the config's
    certificate when it has one."""
    opts: dict[str, Any] = {"host": cfg.host, "port": cfg.http_port}
    sec = cfg.security
    if sec.tls:
        opts.update(ssl_certfile=sec.tls_cert_file, ssl_keyfile=sec.tls_key_file)
        if sec.tls_client_ca_file:
            opts["ssl_ca_certs"] = sec.tls_client_ca_file
    return opts


def deploy(cfg: ServingConfig, timeout_s: float = 900.0) -> None:
    """Deploy or update the app on the connected Ray instance; returns once it runs.

    Declarative, like `serve deploy` and KubeRay: `import_path` + `args` (the config
    without placement) + per-deployment placement overrides. Ray Serve keeps replicas
    whose code and args did not change, so a new replica count scales in place."""
    serve.start(proxy_location=cfg.proxy_location, http_options=http_options(cfg))
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
    """Delete the app and its registry entries; also stop Serve and Ray if `stop_ray`."""
    try:
        serve.delete(cfg.name)
    except Exception as exc:
        logger.warning("could not delete the Ray Serve app %r: %r", cfg.name, exc)
    try:
        clear_registry(cfg.name)
    except Exception as exc:
        logger.warning("could not remove the worker registry of %r: %r", cfg.name, exc)
    if stop_ray:
        serve.shutdown()
        ray.shutdown()
