"""KV transfer device to device: CUDA IPC on one node, NCCL point-to-point across nodes
(through cupy), with gRPC `PullKV` as the handshake and the fallback (kv_transfer.py).

Protocol (fields 60-69 of worker.proto):

1. The decode worker's PullKVRequest offers `gpu_transports` it can receive by and its
   `gpu_node_id` (`GpuKVSink.offer_fields`).
2. The prefill worker picks a transport (`choose_transport`: CUDA IPC when both share a
   node, else NCCL when both have it, else none). With one, it gathers the held blocks
   into a slot of its staging buffer (one contiguous device buffer, exported once) in the
   wire layout (num_layers, 2, n, *block_shape; kv_transfer.py), computes
   `device_checksum` on the device, and answers with a single KVChunk: the layout and a
   GpuKVHandle (where, how many bytes, checksum; the IPC handle or the NCCL unique id), no
   data; then it pushes the region (NCCL; IPC: nothing, the puller reads in place). The
   blocks stay held. Without a transport (no common one, staging full) it streams bytes
   exactly as before.
3. The puller copies the region to its device (`GpuTransport.fetch`), checks size, layout
   and checksum, stages the tensor for admission like a byte pull, and calls ReleaseKV,
   which frees the blocks and the slot. On any failure it pulls again without an offer
   (bytes); the source still holds the blocks until then or until the TTL.

The device copies go through a `GpuTransport`: `CupyIpcTransport` (CUDA IPC) here and
`NcclTransport` (nccl_transport.py); test transports over CPU tensors exercise everything
else without a GPU. cupy is imported only if present (`kvmesh[gpu]`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import torch

from kvmesh._proto import worker_pb2, worker_pb2_grpc
from kvmesh.errors import KVTransferError
from kvmesh.worker.kv_transfer import KVAssembler, PulledKV, check_layout, make_layout, pull_kv
from kvmesh.worker.nccl_transport import NCCL, NcclTransport, nccl_available

try:
    import cupy
except ImportError:  # CPU installs: no GPU transport, bytes over gRPC only
    cupy = None

logger = logging.getLogger(__name__)

CUDA_IPC = "cuda_ipc"
_ALIGN = 256  # staging slots start on 256-byte boundaries (coalesced copies)
_PRIME = 2_147_483_629  # position weights of the checksum cycle modulo this


def node_id() -> str:
    """Identifies this machine (and boot): two processes may use CUDA IPC iff equal."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}:{boot.read_text().strip() if boot.exists() else ''}"


def choose_transport(offered: list[str], peer_node: str, ours: list[str], our_node: str) -> str | None:
    """The transport for a pull, or None for bytes over gRPC."""
    common = set(offered) & set(ours)
    if CUDA_IPC in common and peer_node and peer_node == our_node:
        return CUDA_IPC
    if NCCL in common:
        return NCCL
    return None


def device_checksum(data: torch.Tensor) -> int:
    """Position-weighted sum of the 32-bit words of `data` (computed where it lives, one
    host sync): detects corrupted, truncated and reordered bytes, not adversaries."""
    flat = data.contiguous().view(torch.uint8).flatten()
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64) % _PRIME
    return int((words * weights).sum())


class SlotAllocator:
    """First-fit byte ranges of a staging buffer, keyed by transfer id (pure bookkeeping)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._used: dict[str, tuple[int, int]] = {}

    def allocate(self, key: str, nbytes: int) -> int | None:
        """Offset of a free range of nbytes, or None when the buffer is too full."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        start = 0
        for off, length in sorted(self._used.values()):
            if off - start >= size:
                break
            start = max(start, off + length)
        if start + size > self.capacity:
            return None
        self._used[key] = (start, size)
        return start

    def free(self, key: str) -> bool:
        return self._used.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._used)


class GpuTransport(Protocol):
    """How a staged region travels from the source's device to the puller's."""

    name: str

    def allocate(self, nbytes: int) -> torch.Tensor:
        """The source's staging buffer (uint8, one allocation on this process's device)."""
        ...

    def export(self, buffer: torch.Tensor) -> bytes:
        """Once per staging buffer: what a peer needs to reach it (IPC handle; b"" if nothing)."""
        ...

    def rendezvous(self) -> bytes:
        """Per pull, source side: where the pair meets (NCCL unique id; b"" if nothing)."""
        ...

    def send(self, rendezvous: bytes, region: torch.Tensor) -> None:
        """Source side, after the answer went out: push the region (blocking; NCCL).
        Transports whose puller reads in place do nothing."""
        ...

    def fetch(self, gpu: worker_pb2.GpuKVHandle, device: torch.device) -> torch.Tensor:
        """Puller side: a copy of the handle's region on `device` (uint8, blocking)."""
        ...


class MappedTransport:
    """A transport whose puller maps the source's staging buffer and copies out of it
    (CUDA IPC): nothing to meet on, nothing to push."""

    name = CUDA_IPC

    def rendezvous(self) -> bytes:
        return b""

    def send(self, rendezvous: bytes, region: torch.Tensor) -> None:
        return None

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def fetch(self, gpu: worker_pb2.GpuKVHandle, device: torch.device) -> torch.Tensor:
        peer = self.open(gpu.ipc_handle, gpu.buffer_bytes)
        return peer[gpu.offset: gpu.offset + gpu.num_bytes].to(device, copy=True)


class CupyIpcTransport(MappedTransport):
    """CUDA IPC through cupy: cudaIpcGetMemHandle on a staging buffer that this transport
    allocated itself (IPC maps whole allocations), cudaIpcOpenMemHandle on the peer side."""

    def __init__(self, device: torch.device):
        if cupy is None:
            raise RuntimeError("CUDA IPC needs cupy (pip install 'kvmesh[gpu]')")
        self.device = device
        self._opened: dict[bytes, torch.Tensor] = {}

    def allocate(self, nbytes: int) -> torch.Tensor:
        with cupy.cuda.Device(self.device.index or 0):
            mem = cupy.cuda.Memory(nbytes)  # its own cudaMalloc: the IPC handle covers exactly it
            arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        t = torch.as_tensor(arr, device=self.device)
        t._kvmesh_owner = arr  # keep the cupy allocation alive with the tensor
        return t

    def export(self, buffer: torch.Tensor) -> bytes:
        return bytes(cupy.cuda.runtime.ipcGetMemHandle(buffer.data_ptr()))

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        t = self._opened.get(handle)
        if t is None:
            with cupy.cuda.Device(self.device.index or 0):
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
                mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None)
                arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
            t = torch.as_tensor(arr, device=self.device)
            t._kvmesh_owner = arr
            self._opened[handle] = t
        return t


def default_transports(device: torch.device) -> list[GpuTransport]:
    """What this process can offer and serve: CUDA IPC (and NCCL when cupy has it) on a
    CUDA device with cupy; nothing elsewhere (bytes over gRPC)."""
    if cupy is None or device.type != "cuda":
        return []
    return [CupyIpcTransport(device)] + ([NcclTransport(device)] if nccl_available() else [])


@dataclass
class _Slot:
    offset: int
    num_bytes: int
    transport: str
    rendezvous: bytes


class GpuKVSource:
    """Prefill side: stages held blocks for device-to-device pulls. `offer` and `release`
    run between engine steps (they read the runner's blocks); `push` on a worker thread."""

    def __init__(self, runner, transports: GpuTransport | list[GpuTransport], buffer: torch.Tensor,
                 node: str | None = None):
        self.runner = runner
        ts = transports if isinstance(transports, list | tuple) else [transports]
        self.transports = {t.name: t for t in ts}
        self.buffer = buffer  # uint8, on the runner's device
        self.node = node or node_id()
        self.slots = SlotAllocator(buffer.numel())
        self._handles = {t.name: t.export(buffer) for t in ts}
        self._staged: dict[str, _Slot] = {}

    def offer(self, request: worker_pb2.PullKVRequest, block_ids: list[int], num_tokens: int,
              fingerprint: str) -> worker_pb2.KVChunk | None:
        """The single KVChunk of a GPU pull, or None: stream bytes instead."""
        name = choose_transport(list(request.gpu_transports), request.gpu_node_id, list(self.transports), self.node)
        if name is None or request.transfer_id in self._staged:
            return None
        nbytes = len(block_ids) * self.runner.spec.bytes_per_block
        offset = self.slots.allocate(request.transfer_id, nbytes)
        if offset is None:
            return None
        kv = self.runner.read_blocks(block_ids)  # (L, 2, n, *block_shape), contiguous copy
        region = self.buffer[offset: offset + nbytes]
        region.copy_(kv.view(torch.uint8).flatten())
        checksum = device_checksum(region)  # synchronizes: the bytes are in place when we answer
        rendezvous = self.transports[name].rendezvous()
        self._staged[request.transfer_id] = _Slot(offset, nbytes, name, rendezvous)
        gpu = worker_pb2.GpuKVHandle(transport=name, ipc_handle=self._handles[name], buffer_bytes=self.buffer.numel(),
                                     offset=offset, num_bytes=nbytes, checksum=checksum, node_id=self.node,
                                     nccl_unique_id=rendezvous)
        layout = make_layout(self.runner, len(block_ids), num_tokens, fingerprint)
        return worker_pb2.KVChunk(layout=layout, first_block=0, num_blocks=len(block_ids), gpu=gpu)

    def push(self, transfer_id: str) -> None:
        """After the answer went out: send the staged region if the transport pushes (blocking)."""
        slot = self._staged.get(transfer_id)
        if slot is not None:
            region = self.buffer[slot.offset: slot.offset + slot.num_bytes]
            self.transports[slot.transport].send(slot.rendezvous, region)

    def release(self, transfer_id: str) -> bool:
        """Free the staging slot (ReleaseKV, TTL expiry, or a completed byte pull)."""
        self._staged.pop(transfer_id, None)
        return self.slots.free(transfer_id)


class GpuKVSink:
    """Decode side: receives a GPU pull's chunk into a tensor on this device."""

    def __init__(self, runner, transports: GpuTransport | list[GpuTransport], node: str | None = None):
        self.runner = runner
        ts = transports if isinstance(transports, list | tuple) else [transports]
        self.transports = {t.name: t for t in ts}
        self.node = node or node_id()

    def offer_fields(self) -> dict:
        """Fields to set on PullKVRequest."""
        return {"gpu_transports": list(self.transports), "gpu_node_id": self.node}

    def receive(self, chunk: worker_pb2.KVChunk, fingerprint: str) -> PulledKV:
        """Copy and verify (blocking); raises KVTransferError (the caller then pulls bytes)."""
        if not chunk.HasField("gpu") or not chunk.HasField("layout"):
            raise KVTransferError("GPU pull answered without a GpuKVHandle and layout")
        gpu, layout = chunk.gpu, chunk.layout
        spec = self.runner.spec
        check_layout(spec, layout, fingerprint)
        transport = self.transports.get(gpu.transport)
        if transport is None:
            raise KVTransferError(f"source chose transport {gpu.transport!r}, we offered {list(self.transports)}")
        if gpu.num_bytes != layout.num_blocks * spec.bytes_per_block or gpu.offset + gpu.num_bytes > gpu.buffer_bytes:
            raise KVTransferError(f"GPU KV region of {gpu.num_bytes} bytes at {gpu.offset} does not hold "
                                  f"{layout.num_blocks} blocks in a {gpu.buffer_bytes}-byte buffer")
        try:
            local = transport.fetch(gpu, self.runner.device)
        except Exception as exc:  # CUDA / NCCL errors of any kind: the caller pulls bytes
            raise KVTransferError(f"{gpu.transport} transfer failed: {exc}") from exc
        if device_checksum(local) != gpu.checksum:
            raise KVTransferError("GPU KV transfer failed its checksum")
        kv = local.view(spec.wire_dtype).view(spec.num_layers, 2, layout.num_blocks, *spec.block_shape)
        return PulledKV(kv, layout.num_tokens, gpu.num_bytes)


def build_gpu_kv(runner, staging_bytes: int, transports: list[GpuTransport] | None = None,
                 node: str | None = None) -> tuple[GpuKVSource | None, GpuKVSink | None]:
    """A worker's source and sink, or (None, None) when no transport is available (CPU
    workers: every pull is bytes over gRPC). The staging buffer comes from the first
    transport (CUDA IPC's, when present: IPC maps whole allocations)."""
    transports = default_transports(runner.device) if transports is None else transports
    if not transports or staging_bytes <= 0:
        return None, None
    buffer = transports[0].allocate(staging_bytes)
    return GpuKVSource(runner, transports, buffer, node), GpuKVSink(runner, transports, node)


async def pull_kv_device(channel: grpc.aio.Channel, runner, sink: GpuKVSink, transfer_id: str,
                         fingerprint: str, timeout: float | None) -> PulledKV:
    """A pull that offers `sink`'s transports. Device to device when the source takes the
    offer (then ReleaseKV frees its blocks), else the source's byte stream.

    Raises KVTransferError when the device path failed (the source still holds the
    blocks: pull bytes next) and grpc.aio.AioRpcError when the source is unreachable or
    the transfer is gone.
    """
    stub = worker_pb2_grpc.WorkerStub(channel)
    request = worker_pb2.PullKVRequest(transfer_id=transfer_id, model_fingerprint=fingerprint, **sink.offer_fields())
    call = stub.PullKV(request, timeout=timeout)
    asm, pulled = KVAssembler(runner, fingerprint), None
    try:
        async for chunk in call:
            if pulled is not None or (chunk.HasField("gpu") and asm.layout is not None):
                raise KVTransferError("a GPU pull's answer must be its only chunk")
            if not chunk.HasField("gpu"):
                asm.add(chunk)
                continue
            try:  # the source pushes (NCCL) while we receive: both sides block until done
                pulled = await asyncio.wait_for(asyncio.to_thread(sink.receive, chunk, fingerprint), timeout)
            except TimeoutError as exc:
                raise KVTransferError(f"{chunk.gpu.transport} transfer timed out after {timeout}s") from exc
    finally:
        call.cancel()  # no-op once the stream completed; stops the source on our errors
    if pulled is None:
        return asm.result()  # the source streamed bytes and released the blocks itself
    try:
        await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(transfer_id=transfer_id), timeout=timeout)
    except grpc.aio.AioRpcError as exc:  # the KV is here; the source's TTL frees its copy
        logger.warning("ReleaseKV of %s failed (%s); the source frees it at its TTL", transfer_id, exc.details())
    return pulled


async def pull_kv_or_bytes(channel: grpc.aio.Channel, runner, sink: GpuKVSink, transfer_id: str,
                           fingerprint: str, timeout: float) -> PulledKV:
    """`pull_kv_device`, and when its device path fails, the same transfer again as bytes
    (`pull_kv`) within what is left of `timeout`. Raises what `pull_kv` raises."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        return await pull_kv_device(channel, runner, sink, transfer_id, fingerprint, timeout)
    except KVTransferError as exc:
        logger.warning("device-to-device pull of %s failed (%s); pulling bytes", transfer_id, exc)
    return await pull_kv(channel, runner, transfer_id, fingerprint, max(deadline - loop.time(), 0.001))
