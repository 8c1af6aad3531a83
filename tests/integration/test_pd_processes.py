"""Router, prefill worker and decode worker as three OS processes on loopback.

The module's processes are shared by its tests (startup costs seconds); the test that
kills the decode worker runs last.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from helpers import hf_greedy
from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh_procs import collect, kill, spawn_router, spawn_worker, stop, wait_idle, wait_ready, worker_stats

pytestmark = pytest.mark.timeout(180)

BS = 4
TTL = 2.0
# tiny_llama: 3 layers x (K, V) x 4 tokens x 2 kv heads x 16 head dim x float32
BYTES_PER_BLOCK = 3 * 2 * BS * 2 * 16 * 4
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-logs")
    procs = []
    try:
        procs += [spawn_worker("prefill", tiny_llama, "prefill", logs, transfer_ttl=TTL),
                  spawn_worker("decode", tiny_llama, "decode", logs)]
        prefill, decode = (wait_ready(p) for p in procs)
        router = spawn_router("router", tiny_llama, [prefill.address, decode.address], logs,
                              extra=["--pd-threshold-tokens", "16"])
        procs.append(router)
        wait_ready(router)
        yield {"prefill": prefill, "decode": decode, "router": router}
    finally:
        for p in reversed(procs):
            stop(p)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gen(ids, **params) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(prompt_token_ids=ids, params=llm_pb2.SamplingParams(**params))


async def _route(address: str, req, timeout=30):
    async with grpc.aio.insecure_channel(address) as ch:
        call = llm_pb2_grpc.LLMStub(ch).Generate(req, timeout=timeout)
        tokens, text, last = await collect(call)
        return tokens, text, last, dict(await call.trailing_metadata())


async def _unified(address: str, req):
    async with grpc.aio.insecure_channel(address) as ch:
        return await collect(worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=30))


def test_pd_output_equals_unified_and_transformers_and_kv_moves(cluster, tiny_llama):
    from transformers import AutoModelForCausalLM

    r, p, d = cluster["router"].address, cluster["prefill"].address, cluster["decode"].address
    long_prompt, short_prompt = _prompt(37, 1), _prompt(9, 2)

    async def main():
        before_p, before_d = await worker_stats(p), await worker_stats(d)
        pd = await _route(r, _gen(long_prompt, max_tokens=12, **GREEDY))
        after_p, after_d = await worker_stats(p), await worker_stats(d)
        direct = await _route(r, _gen(short_prompt, max_tokens=12, **GREEDY))
        uni_long = await _unified(p, _gen(long_prompt, max_tokens=12, **GREEDY))
        uni_short = await _unified(d, _gen(short_prompt, max_tokens=12, **GREEDY))
        await wait_idle([p, d])
        return pd, direct, uni_long, uni_short, (before_p, after_p, before_d, after_d)

    pd, direct, uni_long, uni_short, (bp, ap, bd, ad) = asyncio.run(main())
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    for (tokens, text, last, meta), (u_tokens, u_text, _), prompt in (
        (pd, uni_long, long_prompt), (direct, uni_short, short_prompt)
    ):
        assert tokens == u_tokens == hf_greedy(hf, prompt, 12)
        assert text == u_text
        assert last.finish_reason == "length" and last.usage.completion_tokens == 12
        assert last.usage.prompt_tokens == len(prompt)
    assert pd[3]["kvmesh-route"] == "pd"
    assert (pd[3]["kvmesh-prefill"], pd[3]["kvmesh-decode"]) == (p, d)
    assert direct[3]["kvmesh-route"] == "direct" and direct[3]["kvmesh-decode"] == d
    # The prompt's KV (37 tokens = 10 blocks, the last one partial) really moved.
    blocks = -(-len(long_prompt) // BS)
    assert ap.kv_sent_blocks - bp.kv_sent_blocks == blocks
    assert ap.kv_sent_bytes - bp.kv_sent_bytes == blocks * BYTES_PER_BLOCK
    assert ad.kv_received_blocks - bd.kv_received_blocks == blocks
    assert ad.kv_received_bytes - bd.kv_received_bytes == blocks * BYTES_PER_BLOCK
    assert ad.kv_loaded_tokens - bd.kv_loaded_tokens == len(long_prompt)
    assert ad.kv_pull_failures == 0
    # The decode worker computed only the first token: the prompt came as KV.
    assert ad.cached_prompt_tokens_total - bd.cached_prompt_tokens_total == len(long_prompt)


@pytest.mark.parametrize("req, field", [
    (_gen([5, 6, 7], max_tokens=4, top_p=2.0), "top_p"),
    (_gen([5, 6, 7], max_tokens=0), "max_tokens"),
    (_gen([5, 6, 7], max_tokens=4, logprobs=99), "logprobs"),
    (_gen([5, 6, 999], max_tokens=4), "prompt_token_ids"),
    (_gen(list(range(3, 303)), max_tokens=4), "prompt"),  # longer than max_model_len 256
    (llm_pb2.GenerateRequest(), "prompt"),
    (llm_pb2.GenerateRequest(prompt="hi", prompt_token_ids=[5]), "prompt"),
])
def test_bad_input_is_invalid_argument_naming_the_field(cluster, req, field):
    async def main():
        for address in (cluster["router"].address, cluster["decode"].address):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if address == cluster["router"].address:
                    await _route(address, req)
                else:
                    await _unified(address, req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert err.value.details().startswith(f"{field}:"), err.value.details()

    asyncio.run(main())


def test_an_unknown_model_is_not_found_listing_the_served_names(cluster):
    """The router checks `model` (workers do not): an unknown name is NOT_FOUND, as
    OpenAI's 404 model_not_found, and the message lists what is served."""
    async def main():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _route(cluster["router"].address, llm_pb2.GenerateRequest(prompt="hi", model="gpt-9"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value
        assert "'gpt-9'" in err.value.details() and "ListModels shows" in err.value.details()

    asyncio.run(main())


def test_client_cancel_and_deadline_free_blocks_on_both_workers(cluster):
    r, p, d = cluster["router"].address, cluster["prefill"].address, cluster["decode"].address

    async def main():
        async with grpc.aio.insecure_channel(r) as ch:
            stub = llm_pb2_grpc.LLMStub(ch)
            call = stub.Generate(_gen(_prompt(40, 3), max_tokens=200, **GREEDY))
            n = 0
            async for _ in call:
                n += 1
                if n == 3:
                    break
            call.cancel()
            assert n == 3
            await wait_idle([p, d])
            # A deadline shorter than the generation: DEADLINE_EXCEEDED, then idle again.
            # The deadline is a third of this machine's time for the whole generation.
            t0 = time.monotonic()
            await collect(stub.Generate(_gen(_prompt(40, 4), max_tokens=200, **GREEDY)))
            deadline = (time.monotonic() - t0) / 3
            await wait_idle([p, d])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(_gen(_prompt(40, 4), max_tokens=200, **GREEDY), timeout=deadline))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_idle([p, d])

    asyncio.run(main())


def test_unpulled_transfer_is_released_after_ttl(cluster):
    p = cluster["prefill"].address

    async def main():
        async with grpc.aio.insecure_channel(p) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            before = await stub.Stats(worker_pb2.StatsRequest())
            resp = await stub.Prefill(worker_pb2.PrefillRequest(
                prompt_token_ids=_prompt(21, 5), params=llm_pb2.SamplingParams(max_tokens=8, **GREEDY)))
            assert resp.transfer_id and resp.num_blocks == 6 and len(resp.first.token_ids) == 1
            held = await stub.Stats(worker_pb2.StatsRequest())
            assert held.num_held_transfers == 1
            assert held.num_free_blocks == held.num_usable_blocks - 6
            stats = await wait_idle([p], timeout=TTL + 5)
            assert stats[0].transfers_expired == before.transfers_expired + 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.PullKV(worker_pb2.PullKVRequest(transfer_id=resp.transfer_id,
                                                                    model_fingerprint=resp.model_fingerprint)):
                    pass
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


def test_pull_with_wrong_fingerprint_is_refused(cluster):
    p = cluster["prefill"].address

    async def main():
        async with grpc.aio.insecure_channel(p) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            resp = await stub.Prefill(worker_pb2.PrefillRequest(
                prompt_token_ids=_prompt(9, 6), params=llm_pb2.SamplingParams(max_tokens=8, **GREEDY)))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.PullKV(worker_pb2.PullKVRequest(transfer_id=resp.transfer_id,
                                                                    model_fingerprint="another-model")):
                    pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(transfer_id=resp.transfer_id))).released
            await wait_idle([p])

    asyncio.run(main())


def test_health_and_reflection_on_every_server(cluster):
    expected = {"router": "kvmesh.v1.LLM", "prefill": "kvmesh.v1.Worker", "decode": "kvmesh.v1.Worker"}

    async def main():
        for name, service in expected.items():
            async with grpc.aio.insecure_channel(cluster[name].address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                for svc in ("", service):
                    resp = await health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                    assert resp.status == health_pb2.HealthCheckResponse.SERVING
                refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = set()
                async for resp in call:
                    names |= {s.name for s in resp.list_services_response.service}
                assert {service, "grpc.health.v1.Health"} <= names

    asyncio.run(main())


def test_decode_worker_killed_mid_stream_completes_elsewhere(cluster):
    """Runs last: it kills the decode worker. The router resumes the stream on the
    only live worker (prompt + tokens so far), so greedy output is unchanged."""
    r, p = cluster["router"].address, cluster["prefill"].address
    prompt = _prompt(30, 7)

    async def main():
        expected, _, _ = await _unified(p, _gen(prompt, max_tokens=120, **GREEDY))
        async with grpc.aio.insecure_channel(r) as ch:
            call = llm_pb2_grpc.LLMStub(ch).Generate(_gen(prompt, max_tokens=120, **GREEDY), timeout=60)
            tokens, last = [], None
            async for msg in call:
                tokens += list(msg.token_ids)
                last = msg
                if len(tokens) == 5:
                    kill(cluster["decode"])
            meta = dict(await call.trailing_metadata())
        await wait_idle([p])
        return expected, tokens, last, meta

    expected, tokens, last, meta = asyncio.run(main())
    assert tokens == expected and last.finish_reason == "length"
    assert meta["kvmesh-decode"].split(",") == [cluster["decode"].address, p]
