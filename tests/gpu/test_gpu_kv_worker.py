"""Device-to-device P/D KV transfer through the real WorkerServicers over loopback gRPC,
with CPU stand-ins for the device copies (fake_transports.py): the decode worker takes the
handle path when both workers offer it (CUDA IPC on one node, NCCL across nodes), falls
back to pulling bytes when the transport fails, and the prefill worker frees the blocks
and the staging slot in both cases. Output equals the unified path's either way."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from fake_transports import Hub, SharedMemory

from kvmesh._proto import llm_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.build import build_worker
from kvmesh.config import EngineConfig
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.worker.gpu_kv_transfer import CUDA_IPC, NCCL
from kvmesh.worker.server import WorkerServerConfig

pytestmark = pytest.mark.timeout(180)

BS = 4
PARAMS = llm_pb2.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _pair(tiny_llama, kind):
    """Prefill and decode workers sharing a fake transport; NCCL puts them on two nodes."""
    fake = SharedMemory() if kind == CUDA_IPC else Hub()
    transport = fake if kind == CUDA_IPC else fake.transport()
    cfg = EngineConfig.from_kwargs(model=str(tiny_llama), block_size=BS, num_blocks=64, max_model_len=128,
                                   num_threads=1)
    nodes = ("node-a", "node-a" if kind == CUDA_IPC else "node-b")
    workers = [build_worker(cfg, WorkerServerConfig(role=role), auth=InternalAuth(), gpu_transports=[transport],
                            gpu_node=node) for role, node in zip(("prefill", "decode"), nodes)]
    return fake, *workers


async def _tokens(call) -> list[int]:
    return [t async for msg in call for t in msg.token_ids]


async def _disaggregated(prefill, decode, prompt):
    """Prefill here, decode there (what the router does); returns (tokens, transfer id)."""
    async with grpc.aio.insecure_channel(prefill.address) as pch, grpc.aio.insecure_channel(decode.address) as dch:
        pre = await worker_pb2_grpc.WorkerStub(pch).Prefill(
            worker_pb2.PrefillRequest(prompt_token_ids=prompt, params=PARAMS), timeout=30)
        assert pre.transfer_id and pre.num_blocks > 0
        first = pre.first.token_ids[0]
        rest = await _tokens(worker_pb2_grpc.WorkerStub(dch).Decode(worker_pb2.DecodeRequest(
            prompt_token_ids=prompt, first_token_id=first, params=PARAMS, transfer_id=pre.transfer_id,
            source_address=pre.source_address, model_fingerprint=pre.model_fingerprint), timeout=30))
        return [first, *rest], pre.transfer_id


async def _unified(worker, prompt):
    async with grpc.aio.insecure_channel(worker.address) as ch:
        return await _tokens(worker_pb2_grpc.WorkerStub(ch).Generate(
            llm_pb2.GenerateRequest(prompt_token_ids=prompt, params=PARAMS), timeout=30))


async def _nothing_held(worker, transfer_id) -> bool:
    s = worker.servicer
    still_held = await worker.aengine.run_between_steps(lambda: s.engine.release_kv(transfer_id))
    return not still_held and s.transfers.get(transfer_id) is None and len(s.gpu_source.slots) == 0


@pytest.mark.parametrize("kind", [CUDA_IPC, NCCL])
def test_decode_pulls_device_to_device_and_falls_back_to_bytes(tiny_llama, kind):
    prompts = [torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (21, 30)]

    async def main():
        fake, prefill, decode = _pair(tiny_llama, kind)  # on the loop that serves them
        for w in (prefill, decode):
            await w.start()
        try:
            sent, got = prefill.servicer.counters, decode.servicer.counters
            # 1. both offer the transport: one handle, no bytes on the wire, ReleaseKV frees the blocks
            tokens, tid = await _disaggregated(prefill, decode, prompts[0])
            moved = (fake.fetched if kind == CUDA_IPC else fake.received, got.kv_received_bytes)
            assert tokens == await _unified(prefill, prompts[0])
            assert moved == (1, sent.kv_sent_bytes) and got.kv_pull_failures == 0
            assert await _nothing_held(prefill, tid)
            # 2. the transport fails on the decode side: the same transfer comes as bytes
            fake.fail = True
            tokens, tid = await _disaggregated(prefill, decode, prompts[1])
            assert tokens == await _unified(prefill, prompts[1])
            assert (fake.fetched if kind == CUDA_IPC else fake.received) == 1  # no second device copy
            assert got.kv_received_bytes > moved[1] and got.kv_pull_failures == 0  # bytes, not recompute
            assert await _nothing_held(prefill, tid)
        finally:
            for w in (decode, prefill):
                await w.stop(grace=0.5)
        return fake

    fake = asyncio.run(main())
    if kind == NCCL:
        assert fake.created == fake.destroyed == 4  # a communicator per side and pull, torn down


def test_cpu_workers_offer_no_device_transport(tiny_llama):
    async def main():
        cfg = EngineConfig.from_kwargs(model=str(tiny_llama), block_size=BS, num_blocks=16, num_threads=1)
        w = build_worker(cfg, WorkerServerConfig(), auth=InternalAuth())
        try:
            assert w.servicer.gpu_source is None and w.servicer.gpu_sink is None  # bytes over gRPC as before
            assert w.aengine.engine.executor.runner.dtype == torch.float32  # dtype "auto" on CPU
        finally:
            await w.stop(grace=0)

    asyncio.run(main())
