"""The Ray worker registry: the watch (long poll) answers on a membership change or an
expiry, not on heartbeats, and RayActorRegistry's view follows it (real local Ray)."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from kvmesh.serve.registry import RayActorRegistry, WorkerRegistryActor


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=96 << 20)
    yield
    if started:
        ray.shutdown()


def _actor(ttl_s: float):
    return WorkerRegistryActor.options(name=f"test-registry-{uuid.uuid4().hex[:8]}").remote(ttl_s)


def _timed(ref) -> tuple[float, object]:
    t0 = time.monotonic()
    out = ray.get(ref, timeout=30)
    return time.monotonic() - t0, out


def test_watch_answers_on_change_not_on_heartbeat(local_ray):
    reg = _actor(ttl_s=60)
    took, (v1, workers) = _timed(reg.watch.remote(0, 10))
    assert workers == {} and took < 5  # an unknown version answers at once

    pending = reg.watch.remote(v1, 20)
    time.sleep(0.3)
    ray.get(reg.register.remote("10.0.0.1:7000", "decode"))
    took, (v2, workers) = _timed(pending)
    assert v2 > v1 and workers == {"10.0.0.1:7000": "decode"} and took < 5

    ray.get(reg.register.remote("10.0.0.1:7000", "decode"))  # a heartbeat: no change
    took, (v3, workers) = _timed(reg.watch.remote(v2, 0.5))
    assert v3 == v2 and workers == {"10.0.0.1:7000": "decode"} and took >= 0.4

    ray.get(reg.register.remote("10.0.0.1:7000", "prefill"))  # a new role is a change
    _, (v4, workers) = _timed(reg.watch.remote(v3, 10))
    assert v4 > v3 and workers == {"10.0.0.1:7000": "prefill"}

    pending = reg.watch.remote(v4, 20)
    ray.get(reg.unregister.remote("10.0.0.1:7000"))
    _, (v5, workers) = _timed(pending)
    assert v5 > v4 and workers == {}


def test_watch_reports_expiry_and_the_view_follows(local_ray):
    reg = _actor(ttl_s=1.0)
    ray.get(reg.register.remote("10.0.0.2:7000", "unified"))
    view = RayActorRegistry(reg, watch_timeout_s=30)
    try:
        view.wait_first_view(10)
        assert view.roles() == {"10.0.0.2:7000": "unified"}
        ray.get(reg.register.remote("10.0.0.3:7000", "unified"))
        deadline = time.monotonic() + 5
        while len(view.addresses()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(view.addresses()) == ["10.0.0.2:7000", "10.0.0.3:7000"]
        # No heartbeats: both expire after the TTL, and the watch (30 s timeout) says so.
        t0 = time.monotonic()
        while view.addresses() and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert view.addresses() == [] and time.monotonic() - t0 < 5
    finally:
        view.close()
