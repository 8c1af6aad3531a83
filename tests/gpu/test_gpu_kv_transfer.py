"""The GPU KV transfer protocol on CPU: transport choice, staging slots, checksums, layout
checks and the fallback decisions, with the device copies behind CPU test transports (a
shared-memory stand-in for CUDA IPC, an in-process communicator for NCCL); the CUDA IPC
one is exercised by benchmarks/gpu_check.py on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch
from fake_transports import Hub, SharedMemory

from kvmesh._proto import worker_pb2
from kvmesh.errors import KVTransferError
from kvmesh.worker.gpu_kv_transfer import (
    CUDA_IPC,
    NCCL,
    GpuKVSink,
    GpuKVSource,
    SlotAllocator,
    build_gpu_kv,
    choose_transport,
    default_transports,
    device_checksum,
)
from kvmesh.worker.model_runner import KVCacheSpec
from kvmesh.worker.nccl_transport import NcclTransport, bytes_to_uid, uid_to_bytes

FP = "f" * 32


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
    mem = SharedMemory()
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


def _nccl_pair(hub):
    src_runner = _Runner()
    source = GpuKVSource(src_runner, [hub.transport()], torch.zeros(1 << 16, dtype=torch.uint8), node="node-a")
    sink = GpuKVSink(_Runner(seed=1), [SharedMemory(), NcclTransport(torch.device("cpu"), hub.comm)], node="node-b")
    return src_runner, source, sink


def _push_and_receive(source, sink, chunk, tid="t1"):
    pusher = threading.Thread(target=source.push, args=(tid,))
    pusher.start()
    try:
        return sink.receive(chunk, FP)
    finally:
        pusher.join(10)


def test_nccl_across_nodes_exchanges_the_unique_id_in_the_answer():
    hub = Hub()
    src_runner, source, sink = _nccl_pair(hub)
    assert sink.offer_fields()["gpu_transports"] == [CUDA_IPC, NCCL]
    chunk = source.offer(_request(**sink.offer_fields()), [7, 1], 8, FP)  # other node: no IPC
    assert chunk.gpu.transport == NCCL and chunk.gpu.nccl_unique_id and not chunk.gpu.ipc_handle
    pulled = _push_and_receive(source, sink, chunk)
    assert torch.equal(pulled.kv, src_runner.kv[:, :, [7, 1]]) and pulled.num_tokens == 8
    assert hub.created == hub.destroyed == 2  # one two-rank communicator per pull, torn down
    second = source.offer(_request("t2", **sink.offer_fields()), [3], 4, FP)
    assert second.gpu.nccl_unique_id != chunk.gpu.nccl_unique_id
    assert source.release("t1") and source.release("t2") and len(source.slots) == 0


def test_nccl_failures_raise_kv_transfer_errors():
    _, source, sink = _nccl_pair(Hub(corrupt=True))
    chunk = source.offer(_request(**sink.offer_fields()), [2], 4, FP)
    with pytest.raises(KVTransferError, match="checksum"):
        _push_and_receive(source, sink, chunk)

    def broken(uid, rank):
        raise RuntimeError("NCCL error: unhandled system error")

    failing = GpuKVSink(_Runner(), [NcclTransport(torch.device("cpu"), broken)], node="node-b")
    with pytest.raises(KVTransferError, match="nccl transfer failed: NCCL error"):
        failing.receive(chunk, FP)
    no_id = worker_pb2.KVChunk()
    no_id.CopyFrom(chunk)
    no_id.gpu.nccl_unique_id = b""
    with pytest.raises(KVTransferError, match="without a unique id"):
        failing.receive(no_id, FP)


def test_unique_id_bytes_round_trip():
    every = bytes(range(256))
    assert uid_to_bytes(bytes_to_uid(every)) == every
    assert all(-128 <= c <= 127 for c in bytes_to_uid(every))


def test_cpu_workers_take_the_bytes_path():
    runner = _Runner()
    assert default_transports(runner.device) == []
    assert build_gpu_kv(runner, 1 << 20) == (None, None)
    source, sink = build_gpu_kv(runner, 1 << 12, [SharedMemory()], node="n")
    assert source.buffer.numel() == 1 << 12 and sink.offer_fields() == {"gpu_transports": [CUDA_IPC],
                                                                        "gpu_node_id": "n"}
