"""Regressions of issue 19 against real processes over loopback gRPC: the poison pair (two
workers must survive), the pin wedge (RESOURCE_EXHAUSTED at once, a normal request still
served), poison-request quarantine, and a worker killed under load in `serve --local`
(0 lost requests, the worker comes back on its address)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh_procs import collect, spawn_worker, start_serve_local, stop, wait_idle, wait_ready, worker_stats

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import StaticRegistry
from kvmesh.router.server import RouterServer, load_router_tokenizer
from kvmesh.rpc import free_port

pytestmark = pytest.mark.timeout(300)


async def _with_router(tiny_llama, addresses, body, **config):
    router = RouterServer(StaticRegistry(addresses), load_router_tokenizer(str(tiny_llama)), RouterConfig(**config))
    await router.start(min_workers=len(addresses))
    try:
        async with grpc.aio.insecure_channel(router.address) as ch:
            return await body(llm_pb2_grpc.LLMStub(ch))
    finally:
        await router.stop()


def test_poison_pair_top_k_over_vocab_batched_with_small_top_k(tiny_llama, tmp_path):
    procs = [spawn_worker(f"w{i}", tiny_llama, "unified", tmp_path) for i in range(2)]
    try:
        addresses = [wait_ready(p).address for p in procs]

        async def body(stub):
            def call(top_k, i):
                return collect(stub.Generate(llm_pb2.GenerateRequest(
                    prompt_token_ids=[5 + i, 6, 7, 8], params=llm_pb2.SamplingParams(
                        max_tokens=6, top_k=top_k, temperature=1.0, ignore_eos=True)), timeout=60))

            return await asyncio.gather(*(call(k, i) for i in range(8) for k in (1_000_000, 2)))

        results = asyncio.run(_with_router(tiny_llama, addresses, body))
        assert all(len(tokens) == 6 and last.finish_reason == "length" for tokens, _, last in results)
        assert all(p.alive() for p in procs)
        asyncio.run(wait_idle(addresses))
    finally:
        for p in procs:
            stop(p)


async def _engine_state(address: str) -> tuple:
    """What a pin that became a request would change: blocks taken or cached (its prompt's
    block hashes), requests waiting / running, the counters."""
    async with grpc.aio.insecure_channel(address) as ch:
        s = await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(max_block_hashes=1024), timeout=10)
    return (s.num_free_blocks, s.num_waiting, s.num_running, s.requests_total, s.prompt_tokens_total,
            sorted(s.cached_block_hashes))


def test_pin_over_quota_is_refused_at_once_and_requests_still_served(tiny_llama, tmp_path):
    # 63 usable blocks of 4 tokens: pins may hold 31 (max_pinned_fraction 0.5).
    proc = spawn_worker("w", tiny_llama, "unified", tmp_path, num_blocks=64, max_model_len=64)
    try:
        address = wait_ready(proc).address

        async def body(stub):
            for name, start in (("p1", 3), ("p2", 100)):  # 15 blocks each
                await stub.CachePrompt(llm_pb2.CachePromptRequest(prompt_token_ids=list(range(start, start + 60)),
                                                                  name=name), timeout=60)
            before = await _engine_state(address)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # (the RPC timeout is only a hang guard)
                await stub.CachePrompt(llm_pb2.CachePromptRequest(prompt_token_ids=list(range(200, 240)),
                                                                  name="p3"), timeout=60)
            after = await _engine_state(address)
            tokens, _, last = await collect(stub.Generate(llm_pb2.GenerateRequest(
                prompt_token_ids=list(range(250, 290)), params=llm_pb2.SamplingParams(
                    max_tokens=20, temperature=0, ignore_eos=True)), timeout=60))
            return err.value, before, after, tokens

        err, before, after, tokens = asyncio.run(_with_router(tiny_llama, [address], body))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pinned_fraction" in err.details()
        # Refused at once: the pin never became a request (nothing queued or run, no block of
        # its prompt taken or cached), so it cannot have waited for blocks or steps.
        assert after == before and before[1:3] == (0, 0)
        assert len(tokens) == 20
        stats = asyncio.run(worker_stats(address))  # the worker still answers: no wedged loop
        assert stats.num_running == 0 and proc.alive()
    finally:
        stop(proc)


class _CrashingWorker(worker_pb2_grpc.WorkerServicer):
    """A worker whose every Generate fails with INTERNAL (what a poisoned step returns)."""

    def __init__(self, address: str):
        self.address, self.calls = address, 0

    async def Stats(self, request, context):
        return worker_pb2.StatsResponse(role="unified", address=self.address, model_fingerprint="fp", block_size=4,
                                        max_model_len=256, num_usable_blocks=64, num_free_blocks=64)

    async def Generate(self, request, context):
        self.calls += 1
        await context.abort(grpc.StatusCode.INTERNAL, "internal error while running the request: boom")
        yield  # pragma: no cover - makes this a streaming handler


def test_request_that_fails_two_workers_is_quarantined(tiny_llama):
    async def main():
        servers, workers = [], []
        for _ in range(3):
            port = free_port()
            server = grpc.aio.server()
            worker = _CrashingWorker(f"127.0.0.1:{port}")
            worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
            server.add_insecure_port(worker.address)
            await server.start()
            servers.append(server)
            workers.append(worker)

        async def body(stub):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(llm_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], params=llm_pb2.SamplingParams(max_tokens=4)), timeout=30))
            return err.value

        try:
            err = await _with_router(tiny_llama, [w.address for w in workers], body, max_attempts=3)
        finally:
            for s in servers:
                await s.stop(0)
        return err, [w.calls for w in workers]

    err, calls = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INTERNAL and "quarantined" in err.details()
    assert sum(calls) == 2  # not the third worker: max_attempts allowed it, the quarantine stopped it


def _listening_pid(parent: int, port: int) -> int:
    for child in psutil.Process(parent).children(recursive=True):
        if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
            return child.pid
    raise AssertionError(f"no child of {parent} listens on {port}")


@pytest.mark.timeout(400)
def test_worker_killed_under_load_in_serve_local_loses_nothing_and_comes_back(tiny_llama, tmp_path):
    log = tmp_path / "serve.log"
    proc, port, workers = start_serve_local(tiny_llama, log, "--num-blocks", "256", "--prefill-replicas", "0",
                                            "--decode-replicas", "2", timeout=200)
    try:
        assert len(workers) == 2, log.read_text()
        victim_name, victim = workers[0]
        victim_pid = _listening_pid(proc.pid, int(victim.rsplit(":", 1)[1]))

        async def one(stub, i, started):
            params = llm_pb2.SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
            call = stub.Generate(llm_pb2.GenerateRequest(prompt_token_ids=[5 + i, 6, 7, 8, 9], params=params),
                                 timeout=120)
            tokens = []
            async for msg in call:
                tokens += msg.token_ids
                started.set()
            return tokens, dict(await call.trailing_metadata())["kvmesh-decode"]

        async def main():
            started = asyncio.Event()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = llm_pb2_grpc.LLMStub(ch)
                tasks = [asyncio.ensure_future(one(stub, i, started)) for i in range(12)]
                await started.wait()  # streams are running on both workers
                os.kill(victim_pid, signal.SIGKILL)
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        lost = [r for r in results if isinstance(r, BaseException)]
        assert not lost, lost
        assert all(len(tokens) == 100 for tokens, _ in results)
        resumed = [decode for _, decode in results if len(decode.split(",")) == 2]
        assert resumed and all(d.startswith(victim) for d in resumed)  # cut on the victim, finished elsewhere

        deadline = time.monotonic() + 120  # the supervisor restarts it on the same address
        while f"{victim_name} is back at {victim}" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

        async def serving(address):
            async with grpc.aio.insecure_channel(address) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return resp.status == health_pb2.HealthCheckResponse.SERVING

        assert asyncio.run(serving(victim))
        assert log.read_text().count("restarting it on the same address") == 1  # the healthy one was left alone
        assert _listening_pid(proc.pid, int(victim.rsplit(":", 1)[1])) != victim_pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

