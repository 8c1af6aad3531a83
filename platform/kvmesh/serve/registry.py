"""The worker registry of a Ray Serve app: keys in Ray's GCS internal key-value store.

Each worker replica writes `kvmesh/registry/<app>/<host:port>` -> `{"role": ..., "t": ...}`
(KV namespace `kvmesh`) and rewrites it as a heartbeat (`GcsWorkerRegistration`). The
router replica reads the app's keys through `GcsRegistry`, which implements
`kvmesh.router.registry.WorkerRegistry` by keeping a copy fresh from a polling thread, so
the router's event loop never blocks on the GCS. An entry whose heartbeat is older than
`ttl_s` leaves the view and is deleted from the store, so a replica that dies without
unregistering leaves placement too. Replicas that Ray adds or removes thus join or leave
placement without a restart.

Why not a registry actor (what kvmesh had): an actor is a whole Ray worker process, and
Ray's core worker runs a hard-coded 10-ms signal-check timer on the main thread of every
worker process. On a 2-core node the registry actor cost ~160 wake-ups/s and ~1% of a
core, and each wake-up preempts one of the model's OpenMP compute threads (which stalls
the rest of its team at the next barrier). The GCS runs anyway and already serves every
Ray process; the registry adds a few small RPCs a second to it and no process.

Timestamps are wall-clock (`time.time()`): writers and readers are different processes,
usually on different nodes, so the TTL assumes the nodes' clocks agree to well within it.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from ray.experimental.internal_kv import internal_kv_get_gcs_client

logger = logging.getLogger(__name__)

REGISTRY_NAMESPACE = "kvmesh"
_NAMESPACE = REGISTRY_NAMESPACE.encode()
# Every GCS call has a deadline: a registry call must not hang a heartbeat, a replica's
# shutdown or the router's view on a GCS that does not answer (the GCS client's
# internal_kv_* calls, unlike ray.experimental.internal_kv's wrappers, take one).
_GCS_TIMEOUT_S = 5.0


def registry_prefix(app_name: str) -> bytes:
    """The app's keys; app names have no '/', so no app's prefix is inside another's."""
    return f"kvmesh/registry/{app_name}/".encode()


def clear_registry(app_name: str) -> None:
    """Delete every entry of the app (`kvmesh.serve.app.shutdown`)."""
    internal_kv_get_gcs_client().internal_kv_del(registry_prefix(app_name), True, _NAMESPACE,
                                                 timeout=_GCS_TIMEOUT_S)


class GcsWorkerRegistration:
    """A worker replica's entry in its app's registry: `register()` writes it and starts a
    thread that rewrites it every `max(0.5, ttl_s / 4)` s; `unregister()` stops the
    thread and deletes it."""

    def __init__(self, app_name: str, address: str, role: str, ttl_s: float):
        self.address = address
        self.role = role
        self._key = registry_prefix(app_name) + address.encode()
        self._period_s = max(0.5, ttl_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="kvmesh-heartbeat")

    def _put(self) -> None:
        value = json.dumps({"role": self.role, "t": time.time()}).encode()
        internal_kv_get_gcs_client().internal_kv_put(self._key, value, True, _NAMESPACE, timeout=_GCS_TIMEOUT_S)

    def register(self) -> None:
        """Write the entry (raises if the GCS does not take it) and start the heartbeat."""
        self._put()
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self._put()
            except Exception as exc:
                logger.warning("heartbeat of worker %s to the registry failed: %r", self.address, exc)

    def unregister(self) -> None:
        """Leave the registry. The heartbeat stops first, so no late write brings the entry back."""
        self._stop.set()
        if self._thread.is_alive():  # not when `register()` failed
            self._thread.join()
        internal_kv_get_gcs_client().internal_kv_del(self._key, False, _NAMESPACE, timeout=_GCS_TIMEOUT_S)


class GcsRegistry:
    """`kvmesh.router.registry.WorkerRegistry` over the app's registry keys: a thread reads
    them every `poll_s` (one listing and one multi-get), so `addresses()` and `roles()`
    never block the router's loop. If the GCS does not answer, the last view stays."""

    def __init__(self, app_name: str, ttl_s: float, poll_s: float = 1.0):
        self._prefix = registry_prefix(app_name)
        self._ttl_s = ttl_s
        self._workers: dict[str, str] = {}  # address -> role; replaced whole, never mutated
        self._stop = threading.Event()
        self._fresh = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(poll_s,), daemon=True, name="kvmesh-registry")
        self._thread.start()

    def _poll(self, poll_s: float) -> None:
        reachable = True
        while True:
            try:
                self._refresh()
                if not reachable:
                    logger.info("worker registry reachable again")
                reachable = True
            except Exception as exc:
                if reachable:
                    logger.warning("worker registry unreachable (%r); keeping the last view", exc)
                reachable = False
            if self._stop.wait(poll_s):
                return

    def _refresh(self) -> None:
        gcs = internal_kv_get_gcs_client()
        keys = gcs.internal_kv_keys(self._prefix, _NAMESPACE, timeout=_GCS_TIMEOUT_S)
        entries = gcs.internal_kv_multi_get(keys, _NAMESPACE, timeout=_GCS_TIMEOUT_S) if keys else {}
        now = time.time()
        workers: dict[str, str] = {}
        expired: list[bytes] = []
        for key, value in entries.items():
            entry = json.loads(value)
            if now - entry["t"] <= self._ttl_s:
                workers[key[len(self._prefix):].decode()] = entry["role"]
            else:
                expired.append(key)
        self._workers = workers
        self._fresh.set()
        # A heartbeat landing between the read and this delete is lost with the key; the
        # worker's next one (ttl_s / 4 later) writes it again.
        for key in expired:
            logger.info("worker %s missed its heartbeats for %.0f s; removing it from the registry",
                        key[len(self._prefix):].decode(), self._ttl_s)
            gcs.internal_kv_del(key, False, _NAMESPACE, timeout=_GCS_TIMEOUT_S)

    def addresses(self) -> list[str]:
        return list(self._workers)

    def roles(self) -> dict[str, str]:
        return dict(self._workers)

    def wait_first_view(self, timeout_s: float) -> None:
        self._fresh.wait(timeout_s)

    def close(self) -> None:
        """Stop the polling thread (returns once it has stopped)."""
        self._stop.set()
        self._thread.join()
