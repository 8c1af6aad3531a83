"""KV transfer device to device: CUDA IPC on one node, NCCL point-to-point across nodes
(through cupy), with gRPC `PullKV` as the handshake and the fallback (kv_transfer.py).

Protocol (fields 60-69 of worker.proto):

1. The decode worker's PullKVRequest offers `gpu_transports` it can receive by and its
   `gpu_node_id`.
2. The prefill worker picks a transport (`choose_transport`: CUDA IPC when both share a
   node, else NCCL when both have it, else none). With one, it gathers the held blocks
   into a slot of its staging buffer (one contiguous device buffer, exported once) in the
   wire layout (num_layers, 2, n, block_size, kv_heads, head_dim), computes
   `device_checksum` on the device, and answers with a single KVChunk: the layout and a
   GpuKVHandle (where, how many bytes, checksum), no data. Without one (no common
   transport, staging full) it streams bytes exactly as before.
3. The puller copies the region device to device (IPC: it opens the source's buffer once
   and caches the mapping), checks size, layout and checksum, stages the tensor for
   admission like a byte pull, and calls ReleaseKV, which frees the blocks and the slot.
   On any failure it pulls again without an offer (bytes); the source still holds the
   blocks until then or until the TTL.

The device copies go through a `GpuTransport`; `CupyIpcTransport` is the CUDA one, and a
test transport over CPU tensors exercises everything else here without a GPU. cupy is
imported only if present (`kvmesh[gpu]`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvmesh._proto import worker_pb2
from kvmesh.errors import KVTransferError
from kvmesh.worker.kv_transfer import PulledKV, make_layout

try:
    import cupy
except ImportError:  # CPU installs: no GPU transport, bytes over gRPC only
    cupy = None

CUDA_IPC = "cuda_ipc"
NCCL = "nccl"
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
    name: str

    def export(self, buffer: torch.Tensor) -> bytes:
        """A handle a peer process can open to reach `buffer` (uint8, whole allocation)."""
        ...

    def open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        """The peer's buffer as a uint8 tensor on this process's device (cached per handle)."""
        ...


class CupyIpcTransport:
    """CUDA IPC through cupy: cudaIpcGetMemHandle on a staging buffer that this transport
    allocated itself (IPC maps whole allocations), cudaIpcOpenMemHandle on the peer side."""

    name = CUDA_IPC

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


def gpu_transports_available(device: torch.device) -> list[str]:
    """What this process can offer or serve: CUDA IPC with cupy on a CUDA device (NCCL
    pairing is set up per peer by the serving layer and is not offered here yet)."""
    return [CUDA_IPC] if cupy is not None and device.type == "cuda" else []


@dataclass
class _Slot:
    offset: int
    num_bytes: int


class GpuKVSource:
    """Prefill side: stages held blocks for device-to-device pulls."""

    def __init__(self, runner, transport: GpuTransport, buffer: torch.Tensor, node: str | None = None):
        self.runner = runner
        self.transport = transport
        self.buffer = buffer  # uint8, on the runner's device
        self.node = node or node_id()
        self.slots = SlotAllocator(buffer.numel())
        self._handle = transport.export(buffer)
        self._staged: dict[str, _Slot] = {}

    def offer(self, request: worker_pb2.PullKVRequest, block_ids: list[int], num_tokens: int,
              fingerprint: str) -> worker_pb2.KVChunk | None:
        """The single KVChunk of a GPU pull, or None: stream bytes instead."""
        transport = choose_transport(list(request.gpu_transports), request.gpu_node_id,
                                     [self.transport.name], self.node)
        if transport is None or request.transfer_id in self._staged:
            return None
        nbytes = len(block_ids) * self.runner.spec.bytes_per_block
        offset = self.slots.allocate(request.transfer_id, nbytes)
        if offset is None:
            return None
        kv = self.runner.read_blocks(block_ids)  # (L, 2, n, bs, kvh, d), contiguous copy
        region = self.buffer[offset: offset + nbytes]
        region.copy_(kv.view(torch.uint8).flatten())
        checksum = device_checksum(region)  # synchronizes: the bytes are in place when we answer
        self._staged[request.transfer_id] = _Slot(offset, nbytes)
        gpu = worker_pb2.GpuKVHandle(transport=transport, ipc_handle=self._handle, buffer_bytes=self.buffer.numel(),
                                     offset=offset, num_bytes=nbytes, checksum=checksum, node_id=self.node)
        layout = make_layout(self.runner, len(block_ids), num_tokens, fingerprint)
        return worker_pb2.KVChunk(layout=layout, first_block=0, num_blocks=len(block_ids), gpu=gpu)

    def release(self, transfer_id: str) -> bool:
        """Free the staging slot (ReleaseKV, TTL expiry, or a completed byte pull)."""
        self._staged.pop(transfer_id, None)
        return self.slots.free(transfer_id)


class GpuKVSink:
    """Decode side: receives a GPU pull's chunk into a tensor on this device."""

    def __init__(self, runner, transport: GpuTransport, node: str | None = None):
        self.runner = runner
        self.transport = transport
        self.node = node or node_id()

    def offer_fields(self) -> dict:
        """Fields to set on PullKVRequest."""
        return {"gpu_transports": [self.transport.name], "gpu_node_id": self.node}

    def receive(self, chunk: worker_pb2.KVChunk, fingerprint: str) -> PulledKV:
        """Copy and verify; raises KVTransferError (the caller then pulls bytes instead)."""
        if not chunk.HasField("gpu") or not chunk.HasField("layout"):
            raise KVTransferError("GPU pull answered without a GpuKVHandle and layout")
        gpu, layout = chunk.gpu, chunk.layout
        spec = self.runner.spec
        if layout.model_fingerprint != fingerprint:
            raise KVTransferError("source worker serves a different model (fingerprint mismatch)")
        ours = (spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
        theirs = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim)
        if ours != theirs:
            raise KVTransferError(f"KV layout mismatch: ours {ours}, source {theirs}")
        if gpu.transport != self.transport.name:
            raise KVTransferError(f"source chose transport {gpu.transport!r}, we offered {self.transport.name!r}")
        if gpu.num_bytes != layout.num_blocks * spec.bytes_per_block or gpu.offset + gpu.num_bytes > gpu.buffer_bytes:
            raise KVTransferError(f"GPU KV region of {gpu.num_bytes} bytes at {gpu.offset} does not hold "
                                  f"{layout.num_blocks} blocks in a {gpu.buffer_bytes}-byte buffer")
        peer = self.transport.open(gpu.ipc_handle, gpu.buffer_bytes)
        local = peer[gpu.offset: gpu.offset + gpu.num_bytes].to(self.runner.device, copy=True)
        if device_checksum(local) != gpu.checksum:
            raise KVTransferError("GPU KV transfer failed its checksum")
        kv = local.view(spec.dtype).view(spec.num_layers, 2, layout.num_blocks, spec.block_size,
                                         spec.num_kv_heads, spec.head_dim)
        return PulledKV(kv, layout.num_tokens, gpu.num_bytes)
