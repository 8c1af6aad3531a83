"""The KV-event path for real: a gRPC worker publishes stored / evicted block hashes in
Stats, the router's WorkerPool keeps the exact index, and it matches the worker's cache
after hits, evictions and a second router that joins late."""

import asyncio

from kvmesh.build import build_worker
from kvmesh.config import EngineConfig
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.router.plugins import PrecisePrefixScorer, RouteRequest
from kvmesh.router.registry import StaticRegistry, WorkerPool
from kvmesh.worker.server import WorkerServerConfig

BS = 4


def test_router_index_matches_the_workers_cache_over_grpc(tiny_llama):
    async def main():
        # 24 blocks of 4 tokens: the prompts below cannot all stay cached.
        w = build_worker(EngineConfig.from_kwargs(model=str(tiny_llama), block_size=BS, num_blocks=24,
                                                  max_model_len=64, num_threads=1), WorkerServerConfig())
        await w.start()
        pools = []
        try:
            cached = lambda: set(w.aengine.engine.kv_manager.pool.cached_block_hashes(10**6))  # noqa: E731

            async def generate(rid: str, prompt: list[int]) -> None:
                async for _ in w.aengine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                                                  request_id=rid):
                    pass

            def new_pool():
                p = WorkerPool(StaticRegistry([w.address]), 0, 0, 5.0, 1.0, kv_events=True)
                pools.append(p)
                return p

            pool = new_pool()
            await pool.refresh()
            handle = pool.workers[w.address]
            assert handle.kv_index.hashes == cached() == set()
            prompt = [5 + i for i in range(20)]
            await generate("a", prompt)
            await pool.refresh()
            assert len(handle.kv_index) >= 5 and handle.kv_index.hashes == cached()
            first = set(handle.kv_index.hashes)
            for i in range(6):  # enough new prompts to evict the first one's blocks
                await generate(f"b{i}", [100 + 17 * i + j for j in range(20)])
            await pool.refresh()
            assert handle.kv_index.hashes == cached()
            assert not first <= handle.kv_index.hashes  # evictions were applied
            late = new_pool()  # a second router: starts from a snapshot
            await late.refresh()
            assert late.workers[w.address].kv_index.hashes == cached()
            resp = handle.stats
            assert resp.kv_events_epoch and not resp.kv_events_reset
            route = RouteRequest("r", [0] * 8, list(handle.kv_index.hashes)[:1], BS)
            assert PrecisePrefixScorer().score(route, [handle]) == [1.0]
        finally:
            for p in pools:
                await p.close()
            await w.stop(grace=0.5)

    asyncio.run(main())
