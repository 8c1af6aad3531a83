"""CachePrompt / UncachePrompt through the router: the prompt is computed and pinned on
every worker, requests that start with it compute only their tail wherever they land,
and UncachePrompt returns every worker to its full free-block count."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2_grpc
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import InProcessRegistry
from kvmesh.router.server import RouterServer, load_router_tokenizer
from kvmesh_procs import collect, wait_idle, worker_stats

pytestmark = pytest.mark.timeout(180)


def test_cache_prompt_pins_on_every_worker_and_uncache_releases(workers, tiny_llama):
    system = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(5)).tolist()

    async def main():
        registry = InProcessRegistry()
        for a in workers:
            registry.register(a)
        router = RouterServer(registry, load_router_tokenizer(str(tiny_llama)), RouterConfig())
        await router.start(min_workers=2)
        try:
            async with grpc.aio.insecure_channel(router.address) as ch:
                stub = llm_pb2_grpc.LLMStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CachePrompt(llm_pb2.CachePromptRequest())
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.details()
                reply = await stub.CachePrompt(llm_pb2.CachePromptRequest(prompt_token_ids=system, name="sys"))
                assert reply.cache_id == "sys" and reply.num_tokens == 40
                pinned_free = [(await worker_stats(a)).num_free_blocks for a in workers]
                cached = []
                for a in workers:  # ask each worker directly: both hold the pinned prefix
                    async with grpc.aio.insecure_channel(a) as wch:
                        call = worker_pb2_grpc.WorkerStub(wch).Generate(llm_pb2.GenerateRequest(
                            prompt_token_ids=system + [7, 8, 9],
                            params=llm_pb2.SamplingParams(max_tokens=2, temperature=0)))
                        _, _, last = await collect(call)
                        cached.append(last.usage.cached_prompt_tokens)
                await stub.UncachePrompt(llm_pb2.UncachePromptRequest(cache_id="sys"))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.UncachePrompt(llm_pb2.UncachePromptRequest(cache_id="sys"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await router.stop()
        return pinned_free, cached

    pinned_free, cached = asyncio.run(main())
    assert cached == [40, 40]  # 10 full blocks of 4 pinned on each worker
    for a, free in zip(workers, pinned_free):
        stats = asyncio.run(worker_stats(a))
        assert free == stats.num_usable_blocks - 10
    asyncio.run(wait_idle(workers))  # unpinned: back to the full free count
