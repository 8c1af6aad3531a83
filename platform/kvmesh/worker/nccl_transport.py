"""Cross-node KV transfer: NCCL point-to-point through `cupy.cuda.nccl`, a `GpuTransport`
(gpu_kv_transfer.py) for pulls between workers on different nodes.

Per pull: the source makes a unique id (ncclGetUniqueId) and answers PullKV with it
(GpuKVHandle.nccl_unique_id); then both processes create a two-rank communicator on it
(source rank 0, puller rank 1: ncclCommInitRank returns once both joined), the source
sends the staged region, the puller receives it into a fresh buffer on its device, and
both destroy the communicator.

One communicator per pull keeps concurrent pulls between the same pair from pairing each
other's sends and receives (NCCL matches point-to-point calls by order on a communicator);
the price is the communicator set-up on every pull (tens of ms). A cached communicator
per worker pair with pulls ordered on it is the step after this one.

The communicator is made by a factory `(unique_id, rank) -> Communicator`: cupy's on a GPU,
an in-process one in the CPU tests. cupy is imported only if present (`kvmesh[gpu]`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvmesh._proto import worker_pb2

try:
    import cupy
    from cupy.cuda import nccl
except ImportError:  # CPU installs: no NCCL transport
    cupy = nccl = None

NCCL = "nccl"
SOURCE_RANK, PULLER_RANK = 0, 1


class Communicator(Protocol):
    """A two-rank NCCL communicator (uint8 tensors on this process's device)."""

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Send all of `tensor` to rank `peer`; returns when the bytes left (synchronous)."""
        ...

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Fill `tensor` from rank `peer`; returns when the bytes arrived (synchronous)."""
        ...

    def destroy(self) -> None: ...


CommFactory = Callable[[bytes, int], Communicator]


def uid_to_bytes(uid) -> bytes:
    """cupy's unique id (a tuple of 128 signed chars) -> the proto's bytes."""
    return bytes(int(c) & 0xFF for c in uid)


def bytes_to_uid(data: bytes) -> tuple[int, ...]:
    return tuple(b - 256 if b > 127 else b for b in data)


class CupyNcclComm:
    """A cupy NcclCommunicator of two ranks on `device`, run on torch's current stream."""

    def __init__(self, unique_id: bytes, rank: int, device: torch.device):
        self.device = device
        with cupy.cuda.Device(device.index or 0):
            self.comm = nccl.NcclCommunicator(2, bytes_to_uid(unique_id), rank)

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        stream = self._stream()
        self.comm.send(tensor.data_ptr(), tensor.numel(), nccl.NCCL_UINT8, peer, stream.cuda_stream)
        stream.synchronize()

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        stream = self._stream()
        self.comm.recv(tensor.data_ptr(), tensor.numel(), nccl.NCCL_UINT8, peer, stream.cuda_stream)
        stream.synchronize()

    def destroy(self) -> None:
        self.comm.destroy()


def nccl_available() -> bool:
    return nccl is not None


class NcclTransport:
    """Source: `rendezvous` makes the pull's unique id, `send` pushes the region once the
    answer is out. Puller: `fetch` joins the same communicator and receives it."""

    name = NCCL

    def __init__(self, device: torch.device, new_comm: CommFactory | None = None,
                 new_unique_id: Callable[[], bytes] | None = None):
        if new_comm is None and nccl is None:
            raise RuntimeError("the NCCL transport needs cupy with NCCL (pip install 'kvmesh[gpu]')")
        self.device = device
        self.new_comm = new_comm or (lambda uid, rank: CupyNcclComm(uid, rank, device))
        self.new_unique_id = new_unique_id or (lambda: uid_to_bytes(nccl.get_unique_id()))

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def export(self, buffer: torch.Tensor) -> bytes:
        return b""  # nothing to map: the bytes travel by send / recv

    def rendezvous(self) -> bytes:
        return self.new_unique_id()

    def send(self, rendezvous: bytes, region: torch.Tensor) -> None:
        comm = self.new_comm(rendezvous, SOURCE_RANK)
        try:
            comm.send(region, PULLER_RANK)
        finally:
            comm.destroy()

    def fetch(self, gpu: worker_pb2.GpuKVHandle, device: torch.device) -> torch.Tensor:
        if not gpu.nccl_unique_id:
            raise ValueError("NCCL pull answered without a unique id")
        out = torch.empty(gpu.num_bytes, dtype=torch.uint8, device=device)
        comm = self.new_comm(gpu.nccl_unique_id, PULLER_RANK)
        try:
            comm.recv(out, SOURCE_RANK)
        finally:
            comm.destroy()
        return out
