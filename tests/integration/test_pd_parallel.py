"""P/D between groups of different shapes: a tensor-parallel prefill worker (TP=2) hands its
KV to a pipeline-parallel decode worker (PP=2) through the router, as real processes on
loopback. KV leaves a group with every head and layer (the TP=1 wire layout), so the bytes
moved are TP=1's and the decode worker's text equals transformers'."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from helpers import hf_greedy
from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh_procs import collect, spawn_router, spawn_worker, stop, wait_idle, wait_ready, worker_stats

pytestmark = pytest.mark.timeout(240)

BS = 4
# tiny_llama: 3 layers x (K, V) x 4 tokens x 2 kv heads x 16 head dim x float32, whatever the sharding
BYTES_PER_BLOCK = 3 * 2 * BS * 2 * 16 * 4


def test_tp2_prefill_to_pp2_decode_equals_transformers(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    procs = []
    try:
        procs += [spawn_worker("prefill", tiny_llama, "prefill", tmp_path, extra=["--tensor-parallel-size", "2"]),
                  spawn_worker("decode", tiny_llama, "decode", tmp_path, extra=["--pipeline-parallel-size", "2"])]
        prefill, decode = (wait_ready(p) for p in procs)
        router = spawn_router("router", tiny_llama, [prefill.address, decode.address], tmp_path,
                              extra=["--pd-threshold-tokens", "16"])
        procs.append(router)
        wait_ready(router)
        prompt = torch.randint(3, 384, (37,), generator=torch.Generator().manual_seed(1)).tolist()

        async def main():
            before_p, before_d = await worker_stats(prefill.address), await worker_stats(decode.address)
            async with grpc.aio.insecure_channel(router.address) as ch:
                call = llm_pb2_grpc.LLMStub(ch).Generate(llm_pb2.GenerateRequest(
                    prompt_token_ids=prompt, params=llm_pb2.SamplingParams(max_tokens=12, temperature=0,
                                                                          ignore_eos=True)), timeout=60)
                tokens, _, _ = await collect(call)
                meta = dict(await call.trailing_metadata())
            await wait_idle([prefill.address, decode.address])
            after_p, after_d = await worker_stats(prefill.address), await worker_stats(decode.address)
            return tokens, meta, before_p, after_p, before_d, after_d

        tokens, meta, bp, ap, bd, ad = asyncio.run(main())
        hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
        assert tokens == hf_greedy(hf, prompt, 12)
        assert meta["kvmesh-route"] == "pd"
        blocks = -(-len(prompt) // BS)
        assert ap.kv_sent_bytes - bp.kv_sent_bytes == blocks * BYTES_PER_BLOCK
        assert ad.kv_received_bytes - bd.kv_received_bytes == blocks * BYTES_PER_BLOCK
        assert ad.kv_loaded_tokens - bd.kv_loaded_tokens == len(prompt)
        assert ad.cached_prompt_tokens_total - bd.cached_prompt_tokens_total == len(prompt)
    finally:
        for p in reversed(procs):
            stop(p)
