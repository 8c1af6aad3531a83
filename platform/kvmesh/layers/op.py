"""The base of every layer with more than one implementation, and what picks it.

In the spirit of vLLM's `CustomOp`: a layer defines `forward_torch` (the PyTorch reference,
any device) and, where kvmesh has them, `forward_cpu` (the native C++ kernels) and
`forward_triton` (CUDA). Which one runs is decided once, from an `OpContext` (device, dtype,
the typed `KernelConfig` switches, the tensor-parallel group), when the layer is built, and
again when it is moved or cast (`.to()`, `to_empty`): never per call. Model files compose
layers and never name a backend.

Fast paths that gather many layers' tensors once (layers/decode_stack.py) must notice when
a layer is rebound, replaced or reloaded: every such change calls `fast_paths_changed()`,
which bumps a process-wide generation the gatherers compare against.
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from kvmesh.config import KernelConfig
from kvmesh.errors import ConfigError
from kvmesh.layers import native
from kvmesh.layers.shm_allreduce import ShmAllReduce
from kvmesh.layers.triton_runtime import can_run as triton_can_run
from kvmesh.layers.triton_runtime import unavailable_reason as triton_unavailable

_generation = itertools.count(1)
GENERATION = 0  # see fast_paths_changed


def fast_paths_changed() -> None:
    """Say that a layer was rebound, replaced or reloaded: gathered fast-path arguments
    (decode_stack) are stale. Cheap; called by layers and loaders, never per step."""
    global GENERATION
    GENERATION = next(_generation)


class CommMeter:
    """This process's tally of parallel communication, by kind: calls, bytes (the tensor
    reduced or sent; for an all-gather the gathered whole) and seconds spent blocked in them. Kinds: "all_reduce" (row-parallel output / down
    projections, vocab-parallel embedding, MoE experts), "all_gather" (vocab-parallel logits),
    "pp_send" (hidden states to the next stage; bytes only, the send is asynchronous) and
    "pp_wait" (blocked on a receive or on a send's completion: transfer plus the other
    stages' compute, i.e. the pipeline bubble). Off by default (one attribute read per call);
    benchmarks/parallel_comm.py switches it on. CUDA calls synchronize around the timed
    region while it is on, so the seconds are the collective's, not its launch's."""

    def __init__(self) -> None:
        self.enabled = False
        self.totals: dict[str, list[float]] = {}

    def reset(self) -> None:
        self.totals = {}

    def add(self, kind: str, nbytes: int, seconds: float = 0.0) -> None:
        t = self.totals.setdefault(kind, [0, 0, 0.0])
        t[0] += 1
        t[1] += nbytes
        t[2] += seconds

    @contextmanager
    def timed(self, kind: str, tensor: torch.Tensor | None, nbytes: int | None = None):
        """Count the block as one `kind` call moving `tensor`'s bytes (or `nbytes`)."""
        if not self.enabled:
            yield
            return
        cuda = tensor is not None and tensor.is_cuda
        if cuda:
            torch.cuda.synchronize(tensor.device)
        t0 = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(tensor.device)
        self.add(kind, nbytes if nbytes is not None else tensor.nbytes, time.perf_counter() - t0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: {"calls": c, "bytes": b, "seconds": s} for k, (c, b, s) in self.totals.items()}


COMM = CommMeter()


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a layer's weights are sharded over: world size 1 (no
    sharding, no communication) unless the engine runs several ranks."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    # The name the group is registered under for native callers (the decode stack's
    # all-reduces: worker/groups.py); "" where it is not (size 1, or torch cannot register it).
    name: str = ""
    # What that name resolves to (torch's registry holds it weakly): kept alive with the group.
    native: Any = field(default=None, repr=False, compare=False)
    # The ranks' shared-memory segment (layers/shm_allreduce.py) where they share a machine:
    # sums of float32 / bfloat16 CPU tensors go through it instead of gloo.
    shm: ShmAllReduce | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} outside world size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (a no-op at world size 1): over shared memory
        where the group has it and `x` suits it, else gloo / NCCL."""
        if self.size > 1:
            if COMM.enabled:
                with COMM.timed("all_reduce", x):
                    self._sum(x)
            else:
                self._sum(x)
        return x

    def _sum(self, x: torch.Tensor) -> None:
        if self.shm is not None and self.shm.supports(x):
            self.shm(x)
        else:
            torch.distributed.all_reduce(x, group=self.group)


@dataclass(frozen=True)
class PipelineStage:
    """Which layers of the model this rank builds: stage `rank` of `size` pipeline stages
    holds a contiguous run of decoder layers (`layer_range`); stage 0 also holds the token
    embedding, the final norm and the LM head (it samples, worker/pipeline.py). One stage
    (the default): every layer."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline stage {self.rank} outside pipeline size {self.size}")

    @property
    def first(self) -> bool:
        return self.rank == 0

    def layer_range(self, num_layers: int) -> range:
        """This stage's decoder layers: num_layers // size each, the remainder one apiece on
        the last stages (stage 0 also runs the embedding, LM head and sampling)."""
        if num_layers < self.size:
            raise ValueError(f"{num_layers} layers cannot be split over {self.size} pipeline stages")
        base, extra = divmod(num_layers, self.size)
        start = self.rank * base + max(0, self.rank - (self.size - extra))
        return range(start, start + base + (1 if self.rank >= self.size - extra else 0))


@dataclass(frozen=True)
class OpContext:
    """Everything a layer's backend choice depends on (and, for the models, which pipeline
    stage's layers to build)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    kernels: KernelConfig = field(default_factory=KernelConfig)
    tp: TPGroup = field(default_factory=TPGroup)
    pp: PipelineStage = field(default_factory=PipelineStage)

    @property
    def native(self) -> bool:
        """Whether kvmesh's native CPU kernels serve this context (CPU, switched on, built)."""
        return (self.device.type == "cpu" and self.kernels.cpu_kernels
                and native.load(self.kernels.native_isa))

    def elementwise_backend(self) -> str:
        """"cpu", "triton" or "torch" for the element-wise ops (KernelConfig.layer_ops)."""
        choice = self.kernels.layer_ops
        if choice == "torch":
            return "torch"
        if choice == "triton":
            if not triton_can_run(self.device):
                raise ConfigError(f"kernels.layer_ops: triton cannot run on {self.device}: "
                                  f"{triton_unavailable(self.device)}")
            return "triton"
        if self.device.type == "cuda" and triton_can_run(self.device):
            return "triton"
        return "cpu" if self.native else "torch"

    def moved(self, device: torch.device, dtype: torch.dtype) -> "OpContext":
        return replace(self, device=device, dtype=dtype)


class CustomOp(nn.Module):
    """A layer whose implementation is bound at construction (see the module doc).

    Subclasses define `forward_torch` and optionally `forward_cpu` / `forward_triton`, and
    may override `select` (which backend, from the context) and `bind` (extra methods to bind,
    thresholds to precompute). `forward` calls the bound method: one attribute read."""

    def __init__(self, ctx: OpContext | None = None):
        super().__init__()
        self.ctx = ctx or OpContext()
        self.backend = ""
        self._impl = self.forward_torch

    def select(self, ctx: OpContext) -> str:
        """The backend for `ctx`: the element-wise choice, where this op implements it."""
        backend = ctx.elementwise_backend()
        return backend if hasattr(self, f"forward_{backend}") else "torch"

    def bind(self) -> None:
        """(Re)choose the backend from `self.ctx`. Subclasses call it at the end of __init__."""
        self.backend = self.select(self.ctx)
        self._impl = getattr(self, f"forward_{self.backend}")
        fast_paths_changed()

    def forward(self, *args, **kwargs):
        return self._impl(*args, **kwargs)

    def forward_torch(self, *args, **kwargs):
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        # Where did `fn` send tensors of this op's device and dtype? (`.to`, `to_empty`,
        # `.half()`, ...): rebind if it changed either.
        probe = fn(torch.empty(0, dtype=self.ctx.dtype, device=self.ctx.device))
        if (probe.device, probe.dtype) != (self.ctx.device, self.ctx.dtype):
            self.ctx = self.ctx.moved(probe.device, probe.dtype)
            self.bind()
        return out

    def extra_repr(self) -> str:
        return f"backend={self.backend}"
