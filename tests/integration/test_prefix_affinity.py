"""Prefix affinity: two unified worker processes, an in-process router, 4 tenants that
each reuse a long system prompt. A tenant's later requests go where its prefix is
cached, and there they compute only the new tail."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import InProcessRegistry
from kvmesh.router.server import RouterServer, load_router_tokenizer
from kvmesh_procs import collect, wait_idle

pytestmark = pytest.mark.timeout(180)

SYSTEM_TOKENS = 48  # 12 blocks of 4
TENANTS = 4
ROUNDS = 3


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tenants_stick_to_the_worker_holding_their_prefix(workers, tiny_llama):
    systems = [_ids(SYSTEM_TOKENS, 100 + t) for t in range(TENANTS)]

    async def main():
        registry = InProcessRegistry()
        for a in workers:
            registry.register(a)
        # Stats polls only at startup: routing here rests on the router's own memory
        # of where it sent each prefix (the workers' reported hashes are unit-tested).
        config = RouterConfig(stats_interval_s=60)
        router = RouterServer(registry, load_router_tokenizer(str(tiny_llama)), config)
        await router.start(min_workers=2)
        routes: dict[int, list[str]] = {t: [] for t in range(TENANTS)}
        cached: dict[int, list[int]] = {t: [] for t in range(TENANTS)}
        try:
            async with grpc.aio.insecure_channel(router.address) as ch:
                stub = llm_pb2_grpc.LLMStub(ch)
                for rnd in range(ROUNDS):
                    for t in range(TENANTS):
                        ids = systems[t] + _ids(6, 1000 * rnd + t)  # same system prompt, new question
                        call = stub.Generate(llm_pb2.GenerateRequest(
                            prompt_token_ids=ids, params=llm_pb2.SamplingParams(max_tokens=2, temperature=0)))
                        _, _, last = await collect(call)
                        routes[t].append(dict(await call.trailing_metadata())["kvmesh-decode"])
                        cached[t].append(last.usage.cached_prompt_tokens)
            decisions = list(router.api.decisions)
        finally:
            await router.stop()
        await wait_idle(workers)
        return routes, cached, decisions

    routes, cached, decisions = asyncio.run(main())
    for t in range(TENANTS):
        assert len(set(routes[t])) == 1, f"tenant {t} moved between workers: {routes[t]}"
        assert cached[t][0] == 0  # first request: nothing cached anywhere
        # Later requests reuse the whole system prompt (12 full blocks) on that worker.
        assert all(c >= SYSTEM_TOKENS for c in cached[t][1:]), cached[t]
    assert {routes[t][0] for t in range(TENANTS)} == set(workers)  # tenants spread over both
    later = [d for d in decisions[TENANTS:]]
    assert all(d.path == "direct" for d in decisions)
    assert all(d.prefix_blocks[d.decode[0]] >= SYSTEM_TOKENS // 4 for d in later)
