"""The Ray worker registry in the GCS key-value store: workers register, heartbeat and
unregister, GcsRegistry's view follows them, and entries without a heartbeat expire and
leave the store (real local Ray)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import ray
from ray.experimental.internal_kv import _internal_kv_exists, _internal_kv_list, _internal_kv_put

from kvmesh.serve import registry
from kvmesh.serve.registry import (
    REGISTRY_NAMESPACE,
    GcsRegistry,
    GcsWorkerRegistration,
    clear_registry,
    registry_prefix,
)

POLL_S = 0.05


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=96 << 20)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def app(local_ray) -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    clear_registry(name)


def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _key(app: str, address: str) -> bytes:
    return registry_prefix(app) + address.encode()


def test_register_and_unregister_reach_the_view(app):
    view = GcsRegistry(app, ttl_s=60, poll_s=POLL_S)
    try:
        view.wait_first_view(10)
        assert view.addresses() == [] and view.roles() == {}
        decode = GcsWorkerRegistration(app, "10.0.0.1:7000", "decode", ttl_s=60)
        prefill = GcsWorkerRegistration(app, "10.0.0.2:7000", "prefill", ttl_s=60)
        decode.register()
        prefill.register()
        assert _until(lambda: len(view.addresses()) == 2)
        assert view.roles() == {"10.0.0.1:7000": "decode", "10.0.0.2:7000": "prefill"}

        decode.unregister()
        assert not _internal_kv_exists(_key(app, "10.0.0.1:7000"), namespace=REGISTRY_NAMESPACE)
        assert _until(lambda: view.addresses() == ["10.0.0.2:7000"])
        prefill.unregister()
        assert _until(lambda: view.addresses() == [])
    finally:
        view.close()


def test_heartbeat_keeps_an_entry_past_the_ttl(app):
    ttl_s = 2.0  # heartbeat every 0.5 s
    worker = GcsWorkerRegistration(app, "10.0.0.3:7000", "unified", ttl_s=ttl_s)
    worker.register()
    view = GcsRegistry(app, ttl_s=ttl_s, poll_s=POLL_S)
    try:
        view.wait_first_view(10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < ttl_s + 1.0:  # the first write is older than the TTL by then
            assert view.roles() == {"10.0.0.3:7000": "unified"}
            time.sleep(0.1)
    finally:
        view.close()
        worker.unregister()


class _RegistryClock:
    """Stands in for kvmesh.serve.registry's `time` module (whose only use is `time.time()`,
    the heartbeat timestamps and the view's "now"), so a test sets the registry's clock
    instead of waiting on the wall clock. Counts reads: each view refresh reads it once."""

    def __init__(self, now: float):
        self.now = now
        self.reads = 0
        self._cond = threading.Condition()

    def time(self) -> float:
        with self._cond:
            self.reads += 1
            self._cond.notify_all()
            return self.now

    def wait_refreshes(self, n: int, timeout_s: float = 30.0) -> None:
        """Until `n` more reads: the refresh of the last one started after this call, so
        every refresh before it (one that saw the clock as it is now) has finished."""
        with self._cond:
            target = self.reads + n
            assert self._cond.wait_for(lambda: self.reads >= target, timeout_s), "the view stopped refreshing"


def test_an_entry_without_heartbeat_expires_and_leaves_the_store(app, monkeypatch):
    # A replica that died without unregistering: its last heartbeat stays in the store.
    clock = _RegistryClock(1_000_000.0)
    monkeypatch.setattr(registry, "time", clock)
    key = _key(app, "10.0.0.4:7000")
    _internal_kv_put(key, json.dumps({"role": "decode", "t": clock.now}), namespace=REGISTRY_NAMESPACE)
    view = GcsRegistry(app, ttl_s=1.0, poll_s=POLL_S)
    try:
        view.wait_first_view(10)
        assert view.addresses() == ["10.0.0.4:7000"]
        clock.now += 1.0  # exactly the TTL after the last heartbeat: still in
        clock.wait_refreshes(2)
        assert view.addresses() == ["10.0.0.4:7000"]
        assert _internal_kv_exists(key, namespace=REGISTRY_NAMESPACE)
        clock.now += 0.01  # past the TTL: out of the view, then out of the store
        assert _until(lambda: view.addresses() == [], 30)  # (hang guards)
        assert _until(lambda: not _internal_kv_exists(key, namespace=REGISTRY_NAMESPACE), 30)
    finally:
        view.close()


def test_a_heartbeat_renews_the_entry(app, monkeypatch):
    """The mechanism that keeps a live worker in: each heartbeat rewrites the entry with the
    current time, so the TTL counts from the last one (the registry's clock, not the wall's)."""
    clock = _RegistryClock(2_000_000.0)
    monkeypatch.setattr(registry, "time", clock)
    worker = GcsWorkerRegistration(app, "10.0.0.8:7000", "decode", ttl_s=60)
    worker._put()  # one heartbeat, written at the registry clock's time (no heartbeat thread)
    view = GcsRegistry(app, ttl_s=1.0, poll_s=POLL_S)
    try:
        view.wait_first_view(10)
        assert view.addresses() == ["10.0.0.8:7000"]
        clock.now += 0.9
        worker._put()  # the next heartbeat, 0.9 s later
        clock.now += 0.9  # 1.8 s after the first heartbeat, 0.9 s after the last: still in
        clock.wait_refreshes(2)
        assert view.addresses() == ["10.0.0.8:7000"]
        clock.now += 0.2  # 1.1 s after the last heartbeat: expired
        assert _until(lambda: view.addresses() == [], 30)
    finally:
        view.close()
        worker.unregister()


def test_apps_are_separate(app):
    other = f"{app}-2"  # `app` is a prefix of its name, not of its keys
    mine = GcsWorkerRegistration(app, "10.0.0.5:7000", "decode", ttl_s=60)
    theirs = GcsWorkerRegistration(other, "10.0.0.6:7000", "prefill", ttl_s=60)
    mine.register()
    theirs.register()
    views = GcsRegistry(app, ttl_s=60, poll_s=POLL_S), GcsRegistry(other, ttl_s=60, poll_s=POLL_S)
    try:
        for view in views:
            view.wait_first_view(10)
        assert views[0].roles() == {"10.0.0.5:7000": "decode"}
        assert views[1].roles() == {"10.0.0.6:7000": "prefill"}

        clear_registry(app)  # `kvmesh.serve.app.shutdown` of the first app
        assert _internal_kv_list(registry_prefix(app), namespace=REGISTRY_NAMESPACE) == []
        assert _internal_kv_list(registry_prefix(other), namespace=REGISTRY_NAMESPACE) == [_key(other, "10.0.0.6:7000")]
    finally:
        for view in views:
            view.close()
        mine.unregister()
        theirs.unregister()


def test_close_stops_the_thread(app):
    view = GcsRegistry(app, ttl_s=60, poll_s=POLL_S)
    view.wait_first_view(10)
    view.close()
    assert not view._thread.is_alive()
    worker = GcsWorkerRegistration(app, "10.0.0.7:7000", "decode", ttl_s=60)
    worker.register()
    try:
        time.sleep(5 * POLL_S)
        assert view.addresses() == []
    finally:
        worker.unregister()
