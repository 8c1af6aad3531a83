"""The sampling surface through a real worker gRPC server over loopback: n = 2 streams both
choices (each with its index, its own finish and usage), seeded choices equal single
requests with seed + index, prompt logprobs and logit_bias travel in the proto, and the
P/D RPCs refuse n > 1 and prompt_logprobs with INVALID_ARGUMENT naming the field."""

import asyncio

import grpc
import pytest

from kvmesh._proto import llm_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.build import build_worker
from kvmesh.config import EngineConfig
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.rpc import params_from_proto, params_to_proto
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.worker.server import WorkerServerConfig

PROMPT = [5, 9, 14, 3, 77, 120, 8, 33, 41, 2, 19]


async def _generate(stub, params: llm_pb2.SamplingParams, rid: str = "g") -> dict[int, list]:
    msgs: dict[int, list] = {}
    async for msg in stub.Generate(llm_pb2.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, params=params)):
        assert msg.request_id == rid
        msgs.setdefault(msg.index, []).append(msg)
    return msgs


def test_worker_streams_every_choice_over_grpc(tiny_llama):
    async def main():
        w = build_worker(EngineConfig.from_kwargs(model=str(tiny_llama), block_size=4, num_blocks=64,
                                                  max_model_len=64, num_threads=1), WorkerServerConfig(),
                         auth=InternalAuth())
        await w.start()
        try:
            async with grpc.aio.insecure_channel(w.address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                p = params_to_proto(SamplingParams(n=2, max_tokens=6, seed=11, ignore_eos=True, logprobs=1,
                                                   prompt_logprobs=3, logit_bias={7: -5.0}))
                assert params_from_proto(p).n == 2 and params_from_proto(p).logit_bias == {7: -5.0}
                msgs = await _generate(stub, p)
                assert sorted(msgs) == [0, 1]
                for index, stream in msgs.items():
                    tokens = [t for m in stream for t in m.token_ids]
                    assert len(tokens) == 6 and sum(len(m.logprobs) for m in stream) == 6
                    assert [m.finish_reason for m in stream][-1] == "length"
                    assert all(not m.finish_reason for m in stream[:-1])
                    assert stream[-1].usage.completion_tokens == 6 and stream[-1].usage.prompt_tokens == len(PROMPT)
                    assert len(stream[0].prompt_logprobs) == len(PROMPT) - 1
                    assert [e.token_id for e in stream[0].prompt_logprobs] == PROMPT[1:]
                    assert all(len(e.top) == 3 for e in stream[0].prompt_logprobs)
                    assert all(not m.prompt_logprobs for m in stream[1:])
                    # choice i samples as a single request seeded seed + i would
                    single = params_to_proto(SamplingParams(max_tokens=6, seed=11 + index, ignore_eos=True,
                                                            logit_bias={7: -5.0}))
                    alone = (await _generate(stub, single, rid=f"s{index}"))[0]
                    assert tokens == [t for m in alone for t in m.token_ids]
                for rpc, req in (("Prefill", worker_pb2.PrefillRequest), ("Decode", worker_pb2.DecodeRequest)):
                    for bad, field in ((SamplingParams(n=2), "n"), (SamplingParams(prompt_logprobs=1),
                                                                    "prompt_logprobs")):
                        call = getattr(stub, rpc)(req(request_id="pd", prompt_token_ids=PROMPT,
                                                      params=params_to_proto(bad)))
                        with pytest.raises(grpc.aio.AioRpcError) as e:
                            if rpc == "Prefill":
                                await call
                            else:
                                async for _ in call:
                                    pass
                        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                        assert field in e.value.details()
                bad_bias = params_to_proto(SamplingParams(logit_bias={10**6: 1.0}))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _generate(stub, bad_bias)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in e.value.details()
            await w.aengine.wait_idle()
            engine = w.aengine.engine
            assert engine.num_free_blocks == engine.num_usable_blocks
        finally:
            await w.stop(grace=0.5)

    asyncio.run(main())
