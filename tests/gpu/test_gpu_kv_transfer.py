"""The GPU KV transfer protocol on CPU: transport choice, staging slots, checksums, layout
checks and the fallback decisions, with the device copies behind a CPU test transport
(the CUDA IPC one is exercised by benchmarks/gpu_check.py on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvmesh._proto import worker_pb2
from kvmesh.errors import KVTransferError
from kvmesh.worker.gpu_kv_transfer import (
    CUDA_IPC,
    NCCL,
    GpuKVSink,
    GpuKVSource,
    SlotAllocator,
    choose_transport,
    device_checksum,
)
from kvmesh.worker.model_runner import KVCacheSpec

FP = "f" * 32


class _SharedMemory:
    """CUDA IPC stand-in: 'handles' name CPU buffers of this process."""

    name = CUDA_IPC

    def __init__(self):
        self.buffers: dict[bytes, torch.Tensor] = {}
        self.opened = 0

    def export(self, buffer):
        handle = f"h{len(self.buffers)}".encode()
        self.buffers[handle] = buffer
        return handle

    def open(self, handle, nbytes):
        self.opened += 1
        return self.buffers[handle][:nbytes]


class _Runner:
    """The runner surface the transfer uses: spec, device, read_blocks over a real cache."""

    def __init__(self, seed=0, layers=2, block_size=4, kvh=2, d=8):
        self.spec = KVCacheSpec(layers, block_size, kvh, d, torch.float32)
        self.device = torch.device("cpu")
        g = torch.Generator().manual_seed(seed)
        self.kv = torch.randn(layers, 2, 32, block_size, kvh, d, generator=g)

    def read_blocks(self, ids):
        return self.kv[:, :, ids].contiguous()


def _pair(capacity=1 << 16):
    mem = _SharedMemory()
    src_runner = _Runner()
    source = GpuKVSource(src_runner, mem, torch.zeros(capacity, dtype=torch.uint8), node="node-a")
    sink = GpuKVSink(_Runner(seed=1), mem, node="node-a")
    return mem, src_runner, source, sink


def _request(tid="t1", **offer):
    return worker_pb2.PullKVRequest(transfer_id=tid, model_fingerprint=FP, **offer)


def test_transport_choice():
    assert choose_transport([CUDA_IPC, NCCL], "a", [CUDA_IPC, NCCL], "a") == CUDA_IPC
    assert choose_transport([CUDA_IPC, NCCL], "b", [CUDA_IPC, NCCL], "a") == NCCL  # other node: no IPC
    assert choose_transport([CUDA_IPC], "b", [CUDA_IPC], "a") is None  # bytes over gRPC
    assert choose_transport([], "a", [CUDA_IPC], "a") is None  # a CPU puller offers nothing
    assert choose_transport([CUDA_IPC], "", [CUDA_IPC], "") is None  # unknown node: never IPC


def test_slots_first_fit_and_full():
    slots = SlotAllocator(1024)
    assert slots.allocate("a", 300) == 0 and slots.allocate("b", 200) == 512
    assert slots.allocate("c", 600) is None  # full: the source streams bytes instead
    assert slots.free("a") and not slots.free("a")
    assert slots.allocate("c", 400) == 0 and len(slots) == 2


def test_checksum_detects_corruption_and_reordering():
    x = torch.randn(64)
    c = device_checksum(x)
    assert device_checksum(x.clone()) == c
    y = x.clone()
    y[3] += 1e-3
    assert device_checksum(y) != c
    assert device_checksum(torch.cat([x[32:], x[:32]])) != c
    assert device_checksum(torch.arange(7, dtype=torch.uint8)) != device_checksum(torch.arange(6, dtype=torch.uint8))


def test_round_trip_then_release():
    mem, src_runner, source, sink = _pair()
    chunk = source.offer(_request(**sink.offer_fields()), [5, 2, 9], 10, FP)
    assert chunk is not None and not chunk.data and chunk.gpu.transport == CUDA_IPC
    pulled = sink.receive(chunk, FP)
    assert pulled.num_tokens == 10 and pulled.num_blocks == 3
    assert torch.equal(pulled.kv, src_runner.kv[:, :, [5, 2, 9]])
    # a second transfer gets its own slot
    chunk2 = source.offer(_request("t2", **sink.offer_fields()), [1], 4, FP)
    assert chunk2.gpu.offset != chunk.gpu.offset
    assert source.release("t1") and not source.release("t1")
    assert len(source.slots) == 1


def test_fallbacks():
    mem, _, source, sink = _pair(capacity=1024)
    assert source.offer(_request(), [1], 4, FP) is None  # no offer: bytes
    assert source.offer(_request(gpu_transports=[CUDA_IPC], gpu_node_id="node-b"), [1], 4, FP) is None
    too_many = list(range(8))  # 8 blocks x 512 bytes > 1024-byte staging buffer
    assert source.offer(_request(**sink.offer_fields()), too_many, 32, FP) is None
    chunk = source.offer(_request(**sink.offer_fields()), [3], 4, FP)
    with pytest.raises(KVTransferError, match="different model"):
        sink.receive(chunk, "0" * 32)
    # corrupted bytes in the staging buffer: the sink refuses, the caller pulls bytes
    mem.buffers[chunk.gpu.ipc_handle][chunk.gpu.offset + 5] ^= 0xFF
    with pytest.raises(KVTransferError, match="checksum"):
        sink.receive(chunk, FP)
    bad = worker_pb2.KVChunk()
    bad.CopyFrom(chunk)
    bad.gpu.num_bytes += 4
    with pytest.raises(KVTransferError, match="does not hold"):
        sink.receive(bad, FP)
    other = GpuKVSink(_Runner(d=16), mem, node="node-a")
    with pytest.raises(KVTransferError, match="layout mismatch"):
        other.receive(chunk, FP)
