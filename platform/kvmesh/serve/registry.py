"""The worker registry of a Ray Serve app: a detached Ray named actor per app.

Worker replicas register their gRPC address and role, and heartbeat it; an entry
expires after `ttl_s` without a heartbeat, so a replica that dies without unregistering
leaves placement too. The router replica reads the registry through
`RayActorRegistry`, which implements `kvmesh.router.registry.WorkerRegistry` by
keeping a copy fresh from a polling thread, so the router's event loop never blocks
on a Ray call. Replicas that Ray adds or removes thus join or leave placement without
a restart.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

logger = logging.getLogger(__name__)

REGISTRY_NAMESPACE = "kvmesh"


def registry_name(app_name: str) -> str:
    return f"kvmesh-registry-{app_name}"


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
