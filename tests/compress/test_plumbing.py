"""The `compression` option through the engine and gRPC (router in process, a real
worker process): off = byte-identical, on = compressed prompt and usage, bad = INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2_grpc
from kvmesh.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import InProcessRegistry
from kvmesh.router.server import RouterServer, load_router_tokenizer
from kvmesh_procs import collect

pytestmark = pytest.mark.timeout(240)

PASSAGES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests at every step.",
    "Prefix caching reuses blocks whose tokens were computed before.",
]
PROMPT = ("Use the passages.\n<context>" + "\n\n".join(PASSAGES) + "</context>\n"
          "Question: how does prefix caching reuse blocks?")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PASSAGE_3X = {"method": "passage", "target_ratio": 3}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), progress=False, block_size=4, num_blocks=200, max_model_len=256)


def test_engine_without_option_is_byte_identical(llm):
    before = llm.generate(PROMPT, GREEDY)[0]
    off = llm.generate(PROMPT, GREEDY, compression=None)[0]
    assert off.prompt == PROMPT and off.prompt_token_ids == llm.engine.encode(PROMPT) == before.prompt_token_ids
    assert off.outputs[0].token_ids == before.outputs[0].token_ids
    assert "original_prompt_tokens" not in off.metrics


def test_engine_compresses_with_the_option(llm):
    out = llm.generate(PROMPT, GREEDY, compression=PASSAGE_3X)[0]
    assert out.prompt.startswith("Use the passages.\n") and out.prompt.endswith("\nQuestion: how does prefix "
                                                                               "caching reuse blocks?")
    assert PASSAGES[3] in out.prompt and "<context>" not in out.prompt
    assert out.prompt_token_ids == llm.engine.encode(out.prompt)
    assert out.metrics["original_prompt_tokens"] == len(llm.engine.encode(PROMPT)) > len(out.prompt_token_ids)
    with pytest.raises(InvalidRequestError, match="compression.target_ratio"):
        llm.generate(PROMPT, GREEDY, compression={"target_ratio": 0})
    with pytest.raises(InvalidRequestError, match="^compression: needs a text prompt"):
        llm.generate([[1, 5, 6]], GREEDY, compression=PASSAGE_3X)
    assert not llm.engine.has_unfinished()


def _request(**kw) -> llm_pb2.GenerateRequest:
    kw.setdefault("prompt", PROMPT)
    return llm_pb2.GenerateRequest(params=llm_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), **kw)


BAD = [
    (dict(compression=llm_pb2.Compression(target_ratio=0.5)), "compression.target_ratio"),
    (dict(compression=llm_pb2.Compression(method="lingua")), "compression.method"),
    (dict(compression=llm_pb2.Compression(granularity="word")), "compression.granularity"),
    (dict(prompt="", prompt_token_ids=[1, 5, 6], compression=llm_pb2.Compression()), "compression: needs a text"),
    (dict(prompt="no context tags here", compression=llm_pb2.Compression()), "compression: the prompt marks no"),
]


def test_grpc_router_and_worker(worker_address, tiny_llama):
    async def main():
        registry = InProcessRegistry()
        registry.register(worker_address)
        router = RouterServer(registry, load_router_tokenizer(str(tiny_llama)), RouterConfig(stats_interval_s=60))
        await router.start(min_workers=1)
        results = {}
        try:
            async with grpc.aio.insecure_channel(router.address) as rch, \
                    grpc.aio.insecure_channel(worker_address) as wch:
                stubs = {"router": llm_pb2_grpc.LLMStub(rch), "worker": worker_pb2_grpc.WorkerStub(wch)}
                for name, stub in stubs.items():
                    errors = []
                    for kw, _ in BAD:
                        with pytest.raises(grpc.aio.AioRpcError) as exc:
                            await collect(stub.Generate(_request(**kw)))
                        errors.append((exc.value.code(), exc.value.details()))
                    off = await collect(stub.Generate(_request()))
                    on = await collect(stub.Generate(_request(compression=llm_pb2.Compression(
                        method="passage", target_ratio=3))))
                    results[name] = errors, off, on
        finally:
            await router.stop()
        return results

    results = asyncio.run(main())
    tok = load_router_tokenizer(str(tiny_llama))
    full = len(tok.encode(PROMPT, add_special_tokens=True))
    for name, (errors, off, on) in results.items():
        for (code, details), (_, words) in zip(errors, BAD):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, details)
            assert details.startswith(words), (name, details)
        (off_ids, _, off_last), (on_ids, _, on_last) = off, on
        assert off_last.usage.prompt_tokens == full and off_last.usage.original_prompt_tokens == 0
        assert on_last.usage.original_prompt_tokens == full > on_last.usage.prompt_tokens, name
    # Without the option the router's reply is the worker's, token for token.
    assert results["router"][1][0] == results["worker"][1][0]
    assert results["router"][2][0] == results["worker"][2][0]
