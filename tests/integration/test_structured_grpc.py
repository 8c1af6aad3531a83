"""Structured outputs through the router over real worker processes (tiny model): the P/D route
(prefill samples the first token under the grammar, the decode worker goes on from it) gives
the unified worker's output; a spec the grammar engine refuses is INVALID_ARGUMENT naming the
field, at the router's worker; blocks come back on both workers."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest
import torch
from kvmesh_procs import collect, spawn_router, spawn_worker, stop, wait_idle, wait_ready

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2_grpc

pytestmark = pytest.mark.timeout(240)

SCHEMA = {"type": "object", "properties": {"kind": {"type": "string", "enum": ["fox", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "n"]}
SPECS = [
    llm_pb2.StructuredOutputs(json_schema=json.dumps(SCHEMA), disable_any_whitespace=True),
    llm_pb2.StructuredOutputs(regex="[a-c]{2,4}-[0-9]{1,2}"),
    llm_pb2.StructuredOutputs(choice=llm_pb2.StructuredChoice(choices=["quick brown", "lazy dog"])),
]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("so-logs")
    procs = []
    try:
        procs += [spawn_worker("prefill", tiny_llama, "prefill", logs), spawn_worker("decode", tiny_llama, "decode", logs)]
        prefill, decode = (wait_ready(p) for p in procs)
        router = spawn_router("router", tiny_llama, [prefill.address, decode.address], logs,
                              extra=["--pd-threshold-tokens", "16"])
        procs.append(router)
        wait_ready(router)
        yield router.address, prefill.address, decode.address
    finally:
        for p in reversed(procs):
            stop(p)


def _gen(ids, spec, **params) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(prompt_token_ids=ids, params=llm_pb2.SamplingParams(
        max_tokens=60, temperature=0, structured_outputs=spec, **params))


def test_pd_route_equals_unified_worker(cluster):
    r, p, d = cluster
    async def main():
        out = []
        for i, spec in enumerate(SPECS):  # a fresh prompt each: no worker has it cached (P/D route)
            prompt = torch.randint(3, 384, (37,), generator=torch.Generator().manual_seed(i)).tolist()
            async with grpc.aio.insecure_channel(r) as ch:
                call = llm_pb2_grpc.LLMStub(ch).Generate(_gen(prompt, spec), timeout=60)
                routed = await collect(call)
                route = dict(await call.trailing_metadata())["kvmesh-route"]
            async with grpc.aio.insecure_channel(p) as ch:
                unified = await collect(worker_pb2_grpc.WorkerStub(ch).Generate(_gen(prompt, spec), timeout=60))
            out.append((routed, route, unified))
        await wait_idle([p, d])
        return out

    results = asyncio.run(main())
    for (tokens, text, last), route, (u_tokens, u_text, _) in results:
        assert route == "pd"
        assert tokens == u_tokens and text == u_text and last.finish_reason == "stop"
    texts = [r[0][1] for r in results]
    assert json.loads(texts[0])["kind"] in ("fox", "dog")
    assert re.fullmatch("[a-c]{2,4}-[0-9]{1,2}", texts[1])
    assert texts[2] in ("quick brown", "lazy dog")


@pytest.mark.parametrize("spec, field", [
    (llm_pb2.StructuredOutputs(json_schema='{"type": "nope"}'), "structured_outputs.json"),
    (llm_pb2.StructuredOutputs(json_schema="{not json"), "structured_outputs.json"),
    (llm_pb2.StructuredOutputs(regex="(a"), "structured_outputs.regex"),
    (llm_pb2.StructuredOutputs(), "structured_outputs"),
])
def test_bad_spec_is_invalid_argument(cluster, spec, field):
    r, p, d = cluster

    async def main():
        async with grpc.aio.insecure_channel(r) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(llm_pb2_grpc.LLMStub(ch).Generate(_gen([5, 6, 7], spec), timeout=30))
        await wait_idle([p, d])
        return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}: ")
