"""CPU stand-ins for the device-to-device KV transports (worker/gpu_kv_transfer.py): the
real protocol runs over them; only the device copies are replaced. `fail` makes the
puller's side raise, as a CUDA or NCCL error would."""

from __future__ import annotations

import queue
import threading

import torch

from kvmesh.worker.gpu_kv_transfer import MappedTransport
from kvmesh.worker.nccl_transport import NcclTransport


class SharedMemory(MappedTransport):
    """CUDA IPC stand-in: 'handles' name CPU buffers of this process."""

    def __init__(self):
        self.buffers: dict[bytes, torch.Tensor] = {}
        self.opened = self.fetched = 0
        self.fail = False

    def allocate(self, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def export(self, buffer):
        handle = f"h{len(self.buffers)}".encode()
        self.buffers[handle] = buffer
        return handle

    def open(self, handle, nbytes):
        self.opened += 1
        if self.fail:
            raise RuntimeError("cudaIpcOpenMemHandle: invalid device context")
        return self.buffers[handle][:nbytes]

    def fetch(self, gpu, device):
        out = super().fetch(gpu, device)
        self.fetched += 1
        return out


class Hub:
    """NCCL stand-in: the communicator of a unique id is a queue rank 0 sends into and
    rank 1 receives from (in-process, across threads like the two workers' pushes)."""

    def __init__(self, corrupt=False):
        self.corrupt = corrupt
        self.fail = False
        self._queues: dict[bytes, queue.Queue] = {}
        self._lock = threading.Lock()
        self.created = self.destroyed = self.received = self.ids = 0

    def unique_id(self):
        with self._lock:
            self.ids += 1
            return f"uid-{self.ids}".encode().ljust(128, b"\0")

    def comm(self, uid, rank):
        with self._lock:
            self.created += 1
            return _Comm(self, self._queues.setdefault(uid, queue.Queue()))

    def transport(self):
        return NcclTransport(torch.device("cpu"), self.comm, self.unique_id)


class _Comm:
    def __init__(self, hub, q):
        self.hub, self.q = hub, q

    def send(self, tensor, peer):
        data = tensor.clone()
        if self.hub.corrupt:
            data[0] ^= 0xFF
        self.q.put(data)

    def recv(self, tensor, peer):
        if self.hub.fail:
            raise RuntimeError("NCCL error: unhandled system error")
        tensor.copy_(self.q.get(timeout=10))
        self.hub.received += 1

    def destroy(self):
        self.hub.destroyed += 1
