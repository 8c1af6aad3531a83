"""The tensor-parallel all-reduce over shared memory, for the ranks of one machine
(csrc/shm_allreduce.cpp has the protocol).

gloo over loopback costs ~0.9 ms per all-reduce, whatever its size up to tens of KiB: at
TP=2 a SmolLM2-sized decode step spends more time in its 17 all-reduces than in its GEMMs.
Ranks that share a machine can instead sum through one shared segment: each copies its
part in, raises a counter, waits for its peers' and adds the parts in rank order (the same
bits on every rank). vLLM's CPU backend does the same for its TP ranks.

`create_segment` (rank 0) makes the segment as a file in /dev/shm; the other ranks map it
with `open_segment`; worker/groups.py `attach_shm` agrees over gloo that every rank mapped it
(else the group keeps gloo) and unlinks the file, so nothing is left behind when the ranks
exit. The vocab-parallel logits' all-gather goes through it too (layers/embedding.py); the
other collectives (KV block gathers, broadcasts, pipeline sends) stay on gloo.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
# Bytes of one rank's slot per phase: larger tensors go in chunks of it (a 1k-token fp32
# prefill of hidden 576 is 2.3 MiB: 3 chunks). Two phases per rank: a TP=2 segment is 4 MiB,
# TP=8 16 MiB (Docker's default /dev/shm is 64 MiB).
SLOT_BYTES = 1 << 20
_LINE = 64
DTYPES = (torch.float32, torch.bfloat16)


def segment_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
    """Size of a segment for `world` ranks: header, a control line per rank, 2 x world slots."""
    return _LINE + _LINE * world + 2 * world * slot_bytes


@dataclass(frozen=True)
class ShmAllReduce:
    """One rank's handle on its group's segment: `segment` the mapped uint8 tensor, `rank` its
    index in the group, `timeout_s` how long a wait on a peer may last (gloo's collective
    timeout)."""

    segment: torch.Tensor
    rank: int
    timeout_s: float

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPES and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place."""
        return torch.ops.kvmesh.shm_all_reduce_(x, self.segment, self.rank, self.timeout_s)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world, *x.shape): every rank's `x` in rank order (any dtype, CPU)."""
        return torch.ops.kvmesh.shm_all_gather(x, self.segment, self.rank, self.timeout_s)


def _map(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def create_segment(world: int, slot_bytes: int = SLOT_BYTES) -> tuple[str, torch.Tensor] | None:
    """Rank 0: a new zeroed segment file in /dev/shm, initialized; (its path, its mapping), or
    None where this machine has no /dev/shm or no room in it."""
    if not os.path.isdir(SHM_DIR):
        return None
    nbytes = segment_bytes(world, slot_bytes)
    try:
        fd, path = tempfile.mkstemp(prefix="kvmesh-tp-", dir=SHM_DIR)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # tmpfs full: fail here, not with SIGBUS mid-collective
        seg = _map(path, nbytes)
    except (OSError, RuntimeError):
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    torch.ops.kvmesh.shm_all_reduce_init(seg, world, slot_bytes)
    torch.ops.kvmesh.shm_all_reduce_attach(seg, 0, world)
    return path, seg


def peers_visible(seg: torch.Tensor | None) -> bool:
    """Whether every rank has attached to `seg` and this process sees each one's pid (None: False)."""
    return seg is not None and bool(torch.ops.kvmesh.shm_all_reduce_peers_visible(seg))


def open_segment(path: str, rank: int, world: int) -> torch.Tensor | None:
    """The other ranks: map rank 0's segment at `path` and register this process in it (its
    pid, for its peers' liveness checks); None where it cannot be mapped or is not a segment
    for `world` ranks (another machine's path, say)."""
    try:
        nbytes = os.path.getsize(path)
        seg = _map(path, nbytes) if nbytes >= segment_bytes(world, _LINE) else None
    except (OSError, RuntimeError):
        return None
    return seg if seg is not None and torch.ops.kvmesh.shm_all_reduce_attach(seg, rank, world) else None
