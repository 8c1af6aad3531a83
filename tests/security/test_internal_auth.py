"""Worker ports refuse outsiders: with the internal token on, every worker RPC but the
health check needs it, while the router (and PullKV between workers) still work.

A prefill and a decode worker (tiny random Llama) and a P/D router, all with the token,
on one background event loop; an outsider dials the workers directly."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.build import build_worker
from kvmesh.config import EngineConfig
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import StaticRegistry
from kvmesh.router.server import RouterServer
from kvmesh.rpc.internal_auth import METADATA_KEY, InternalAuth
from kvmesh.serve.loop import LoopThread
from kvmesh.worker.server import WorkerServerConfig

TOKEN = "internal-test-token-0123456789"
BS = 4


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    loop = LoopThread("security-test-loop")
    auth = InternalAuth(token=TOKEN)
    started = []

    def worker(role: str):
        cfg = EngineConfig.from_kwargs(model=str(tiny_llama), block_size=BS, num_blocks=64, max_model_len=128,
                                       num_threads=1)
        return build_worker(cfg, WorkerServerConfig(role=role), auth=auth)

    async def start():
        for role in ("prefill", "decode"):
            w = worker(role)
            await w.start()
            started.append(w)
        router = RouterServer(StaticRegistry([w.address for w in started]), started[0].aengine.tokenizer,
                              RouterConfig(decider="always", stats_interval_s=0.1), auth=auth)
        await router.start(min_workers=2)
        started.append(router)
        return started

    try:
        yield loop, loop.run(start(), timeout_s=120)
    finally:
        async def stop():
            for s in reversed(started):
                await s.stop(grace=0.5)

        loop.run(stop())
        loop.stop()


async def _generate(address: str, ids: list[int]) -> list[llm_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as ch:
        req = llm_pb2.GenerateRequest(prompt_token_ids=ids, params=llm_pb2.SamplingParams(max_tokens=4, temperature=0))
        return [m async for m in llm_pb2_grpc.LLMStub(ch).Generate(req, timeout=60)]


def _outsider_calls(stub: worker_pb2_grpc.WorkerStub, metadata):
    """One call of every worker RPC, as an outsider would make it."""
    params = llm_pb2.SamplingParams(max_tokens=2, temperature=0)
    ids = list(range(5, 25))
    return {
        "Generate": lambda: _drain(stub.Generate(llm_pb2.GenerateRequest(prompt_token_ids=ids, params=params),
                                                 metadata=metadata, timeout=30)),
        "Prefill": lambda: stub.Prefill(worker_pb2.PrefillRequest(prompt_token_ids=ids, params=params),
                                        metadata=metadata, timeout=30),
        "Decode": lambda: _drain(stub.Decode(worker_pb2.DecodeRequest(prompt_token_ids=ids, first_token_id=7,
                                                                      params=params), metadata=metadata, timeout=30)),
        "PullKV": lambda: _drain(stub.PullKV(worker_pb2.PullKVRequest(transfer_id="t"), metadata=metadata,
                                             timeout=30)),
        "ReleaseKV": lambda: stub.ReleaseKV(worker_pb2.ReleaseKVRequest(transfer_id="t"), metadata=metadata,
                                            timeout=30),
        "CachePrompt": lambda: stub.CachePrompt(llm_pb2.CachePromptRequest(prompt_token_ids=ids), metadata=metadata,
                                                timeout=30),
        "UncachePrompt": lambda: stub.UncachePrompt(llm_pb2.UncachePromptRequest(cache_id="x"), metadata=metadata,
                                                    timeout=30),
        "Stats": lambda: stub.Stats(worker_pb2.StatsRequest(max_block_hashes=100), metadata=metadata, timeout=30),
    }


async def _drain(call):
    return [m async for m in call]


@pytest.mark.parametrize("metadata", [None, ((METADATA_KEY, "wrong-token"),), (("authorization", f"Bearer {TOKEN}"),)],
                         ids=["no-token", "wrong-token", "token-as-bearer"])
def test_every_worker_rpc_refuses_a_caller_without_the_token(cluster, metadata):
    loop, (prefill, decode, router) = cluster

    async def probe() -> dict[str, grpc.StatusCode]:
        codes = {}
        async with grpc.aio.insecure_channel(decode.address) as ch:
            for name, call in _outsider_calls(worker_pb2_grpc.WorkerStub(ch), metadata).items():
                try:
                    await call()
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
                    assert "internal token" in exc.details()
        return codes

    codes = loop.run(probe())
    assert codes == {name: grpc.StatusCode.UNAUTHENTICATED for name in codes} and len(codes) == 8
    assert decode.aengine.engine.num_free_blocks == decode.aengine.engine.num_usable_blocks


def test_health_checks_stay_open(cluster):
    loop, (prefill, decode, router) = cluster

    async def check():
        async with grpc.aio.insecure_channel(prefill.address) as ch:
            return await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)

    assert loop.run(check()).status == health_pb2.HealthCheckResponse.SERVING


def test_router_and_pullkv_carry_the_token(cluster):
    """Router -> prefill -> decode (PullKV worker -> worker) works with the token everywhere."""
    loop, (prefill, decode, router) = cluster
    before = decode.servicer.counters.kv_received_blocks
    msgs = loop.run(_generate(router.address, list(range(10, 50))))
    assert sum(len(m.token_ids) for m in msgs) == 4 and msgs[-1].finish_reason == "length"
    assert decode.servicer.counters.kv_received_blocks > before  # the KV crossed by PullKV
    assert decode.servicer.counters.kv_pull_failures == 0
    assert router.api.decisions[-1].path == "pd"


def test_the_token_holder_can_call_a_worker(cluster):
    loop, (prefill, decode, router) = cluster

    async def stats():
        async with InternalAuth(token=TOKEN).channel(decode.address) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)

    assert loop.run(stats()).role == "decode"


def test_token_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KVMESH_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("KVMESH_INTERNAL_TOKEN_FILE", raising=False)
    assert not InternalAuth.load().enabled
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert InternalAuth.load(str(f)).token == "from-file"
    monkeypatch.setenv("KVMESH_INTERNAL_TOKEN_FILE", str(f))
    assert InternalAuth.load().token == "from-file"
    monkeypatch.setenv("KVMESH_INTERNAL_TOKEN", "from-env")
    assert InternalAuth.load(str(f)).token == "from-env"
    (tmp_path / "empty").write_text("")
    monkeypatch.delenv("KVMESH_INTERNAL_TOKEN")
    with pytest.raises(ValueError, match="empty"):
        InternalAuth.load(str(tmp_path / "empty"))
