"""RouterDeployment.reconfigure: Ray Serve's user_config (the operator's spec.adapters) becomes the
router's LoRA adapters through `RouterAPI.sync_adapters`, with nothing restarted.

The replica is built without __init__ (which needs Ray, workers and a model): only the router's
loop and a recording stand-in for its API, as tests/hardening's FakeBackend stands in for the router.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from kvmesh.serve.deployments import RouterDeployment
from kvmesh.serve.loop import LoopThread

# Ray's ingress wrapper has an async __del__, which only Ray's replica awaits.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")


class RecordingApi:
    """sync_adapters as the router API offers it; records each call and the loop it ran on."""

    def __init__(self, fail: int = 0):
        self.calls: list[list[tuple[str, str]]] = []
        self.threads: list[str] = []
        self.fail = fail

    async def sync_adapters(self, adapters: list[tuple[str, str]]) -> None:
        self.threads.append(threading.current_thread().name)
        self.calls.append(list(adapters))
        if self.fail:
            self.fail -= 1
            raise ConnectionError("worker 10.0.0.1:7000 unreachable")


@pytest.fixture
def replica():
    loop = LoopThread("kvmesh-router")
    r = RouterDeployment.__new__(RouterDeployment)
    r._loop, r.router = loop, SimpleNamespace(api=RecordingApi())
    yield r
    loop.stop()


def test_reconfigure_syncs_the_adapters_on_the_router_loop(replica):
    async def go():
        await replica.reconfigure({"adapters": [{"name": "sql", "path": "/models/adapters/sql"},
                                                {"name": "chat", "path": "/models/adapters/chat"}]})
        await replica.reconfigure({"adapters": [{"name": "sql", "path": "/models/adapters/sql"}]})
        await replica.reconfigure({"adapters": []})

    asyncio.run(go())
    api = replica.router.api
    assert api.calls == [[("sql", "/models/adapters/sql"), ("chat", "/models/adapters/chat")],
                         [("sql", "/models/adapters/sql")], []]
    assert set(api.threads) == {"kvmesh-router"}  # the router's own loop, not Ray's


def test_a_failed_sync_is_retried_from_the_health_check(replica):
    replica.router.api.fail = 1

    async def go():
        await replica.reconfigure({"adapters": [{"name": "sql", "path": "/a"}]})  # logs, does not raise
        assert replica._adapters_pending
        await replica.check_health()
        await replica._adapters_task
        assert not replica._adapters_pending
        await replica.check_health()  # nothing pending: no new sync

    asyncio.run(go())
    assert replica.router.api.calls == [[("sql", "/a")], [("sql", "/a")]]


def test_a_malformed_user_config_is_refused():
    r = RouterDeployment.__new__(RouterDeployment)
    for bad in ({"adapters": {"sql": "/a"}}, {"adapters": [{"name": "a b", "path": "/a"}]},
                {"adapters": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]}):
        with pytest.raises(ValueError):
            asyncio.run(r.reconfigure(bad))
