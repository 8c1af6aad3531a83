"""An in-process cluster for the telemetry tests: a prefill and a decode WorkerServer
(AsyncLLMEngine on the tiny random Llama) and two RouterServers on them, one that
always disaggregates ("pd") and one that never does ("uni"), all on one event loop
in a background thread (so tests can also scrape HTTP endpoints from the main one)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvmesh.rpc import free_port
from kvmesh.serve.loop import LoopThread

BS = 4


@dataclass
class Cluster:
    loop: LoopThread
    prefill: object  # WorkerServer
    decode: object
    pd_router: object  # RouterServer, decider always
    uni_router: object  # RouterServer, decider never
    decode_metrics_port: int


@pytest.fixture(scope="session")
def cluster(tiny_llama):
    from kvmesh.build import build_worker
    from kvmesh.config import EngineConfig
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.registry import StaticRegistry
    from kvmesh.router.server import RouterServer
    from kvmesh.worker.server import WorkerServerConfig

    def worker(config: WorkerServerConfig):
        return build_worker(EngineConfig.from_kwargs(model=str(tiny_llama), block_size=BS, num_blocks=128,
                                                     max_model_len=256, num_threads=1), config)

    loop = LoopThread("telemetry-test-loop")
    metrics_port = free_port()
    started = []

    async def start():
        prefill = worker(WorkerServerConfig(role="prefill"))
        decode = worker(WorkerServerConfig(role="decode", metrics_port=metrics_port))
        for w in (prefill, decode):
            await w.start()
            started.append(w)
        addresses = [prefill.address, decode.address]
        routers = []
        for model_id, decider in (("pd", "always"), ("uni", "never")):
            r = RouterServer(StaticRegistry(addresses), prefill.aengine.tokenizer,
                             RouterConfig(decider=decider, stats_interval_s=0.1), model_id=model_id)
            await r.start(min_workers=2)
            started.append(r)
            routers.append(r)
        return Cluster(loop, prefill, decode, *routers, metrics_port)

    try:
        yield loop.run(start(), timeout_s=120)
    finally:
        async def stop():
            for s in reversed(started):
                await s.stop(grace=0.5)

        try:
            loop.run(stop(), timeout_s=60)
        finally:
            loop.stop()
