"""Batched multi-LoRA: one step's rows run under different adapters (S-LoRA / Punica SGMV).

A step's rows are ordered by the model runner so that each adapter's rows are contiguous:
`LoRABatch.segments` lists (first row, rows, slot) runs; rows of base-model requests are in
no segment. Every linear layer an adapter targets carries a `LoRASlots` as its delta
(`Linear.set_delta`): after the base GEMM it adds, per segment (and shard of a fused q/k/v
or gate/up projection),

    y[rows, shard] += (x[rows] @ A[shard, slot]^T) @ B[slot, :, shard]

a shrink and an expand GEMM per adapter per layer, whatever the batch mix: the SGMV kernels
of layers/lora_kernels.py (csrc/lora.cpp on CPU, triton_lora.py on CUDA; per-segment addmm
otherwise). The slots hold up to `max_loras` adapters resident at once, ranks zero-padded
to `max_rank`; the scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B when
a slot is filled.

Which batch a forward runs under is per thread (`lora_batch`): the step thread sets it
around the model call. Outside one (base-only steps, draft models, CUDA graph capture) a
delta is the identity, so base-only steps keep their fast paths (the decode stack checks
`active()` and steps aside while a batch is set).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvmesh.layers import triton_lora

_local = threading.local()


@dataclass
class LoRABatch:
    """The adapter segments of one step: (start row, number of rows, slot) per run of rows
    under one adapter, in row order."""

    segments: list[tuple[int, int, int]]
    _subsets: dict[tuple[bool, ...], tuple] = field(default_factory=dict)
    _tensors: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def for_slots(self, used: Sequence[bool]) -> tuple[tuple[int, int, int], ...]:
        """The segments whose slot a layer has weights in (memoized per step: layers adapted
        by the same adapters share one list)."""
        key = tuple(used)
        got = self._subsets.get(key)
        if got is None:
            got = self._subsets[key] = tuple(s for s in self.segments if used[s[2]])
        return got

    def tensors(self, segs: tuple[tuple[int, int, int], ...], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(starts, lens, slots) of `segs` as int32 tensors on `device`, for the kernels."""
        key = (segs, device)
        got = self._tensors.get(key)
        if got is None:
            got = tuple(torch.tensor(c, dtype=torch.int32, device=device) for c in zip(*segs))
            self._tensors[key] = got
        return got

    def window(self, lo: int, hi: int) -> "LoRABatch":
        """The segments of rows [lo, hi) (a pipeline micro-batch), renumbered from 0."""
        return LoRABatch([(max(s, lo) - lo, min(s + n, hi) - max(s, lo), slot)
                          for s, n, slot in self.segments if s < hi and s + n > lo])

    @classmethod
    def from_rows(cls, row_slots: Sequence[tuple[int, int]]) -> "LoRABatch":
        """From (rows, slot or -1) per sequence in row order: merges neighbours of one slot."""
        segments: list[tuple[int, int, int]] = []
        start = 0
        for rows, slot in row_slots:
            if rows and slot >= 0:
                if segments and segments[-1][2] == slot and segments[-1][0] + segments[-1][1] == start:
                    s, n, _ = segments[-1]
                    segments[-1] = (s, n + rows, slot)
                else:
                    segments.append((start, rows, slot))
            start += rows
        return cls(segments)


def current() -> LoRABatch | None:
    return getattr(_local, "batch", None)


def active() -> bool:
    """True while a forward on this thread runs rows under adapters."""
    return getattr(_local, "batch", None) is not None


@contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """Run the forwards inside under `batch` (None or no segments: the base model only)."""
    prev = getattr(_local, "batch", None)
    _local.batch = batch if batch is not None and batch.segments else None
    try:
        yield
    finally:
        _local.batch = prev


def sgmv_addmm(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               segments: Sequence[tuple[int, int, int]], offsets: Sequence[int]) -> None:
    """The PyTorch path (no native kernel, no Triton): per segment and shard, y += (x A^T) B^T
    as one matmul and one in-place addmm in the model's dtype (layouts: lora_kernels)."""
    for start, n, slot in segments:
        xs, ys = x.narrow(0, start, n), y.narrow(0, start, n)
        for shard, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            ys[:, lo:hi].addmm_(xs @ a[shard, slot].t(), b[slot, :, lo:hi])


class LoRASlots:
    """One linear layer's adapter slots, and the delta it adds (see the module docstring).

    `shards` are (output start, output size) per shard of a fused layer ([(0, N)] otherwise),
    contiguous from 0. Layouts as layers/lora_kernels.py: a (shards, slots, R, K), b (slots, R, N)
    (B transposed, scale folded in). `backend`: "cpu" (csrc/lora.cpp), "triton" or "torch".
    """

    def __init__(self, in_features: int, shards: Sequence[tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, backend: str = "torch"):
        self.in_features = in_features
        self.shards = list(shards)
        self.offsets = [0] + [start + size for start, size in self.shards]
        self.out_features = self.offsets[-1]
        self.max_rank = max_rank
        self.backend = backend
        self.a = torch.zeros(len(self.shards), num_slots, max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, max_rank, self.out_features, dtype=dtype, device=device)
        # Slots whose adapter adapts this layer (others add nothing and are skipped). The
        # buffers are written only under inference mode (the steps read them under it).
        self.used = [False] * num_slots

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        if self.used[slot]:
            self.a[:, slot].zero_()
            self.b[slot].zero_()
            self.used[slot] = False

    @torch.inference_mode()
    def fill(self, slot: int, parts: Sequence[tuple[int | None, torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter into `slot`: (shard index, or None for the whole layer, A (r, K),
        B (n, r) already scaled) per adapted shard. A whole-layer pair of a fused layer
        (Phi-3's qkv_proj) takes A in every shard and each shard's rows of B."""
        self.clear(slot)
        for shard, a, b in parts:
            r = a.shape[0]
            for part in range(len(self.shards)) if shard is None else (shard,):
                lo, hi = self.offsets[part], self.offsets[part + 1]
                rows = b[lo:hi] if shard is None else b
                self.a[part, slot, :r].copy_(a)
                self.b[slot, :r, lo:hi].copy_(rows.t())
        self.used[slot] = bool(parts)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = getattr(_local, "batch", None)
        if batch is None:
            return y
        segs = batch.for_slots(self.used)
        if not segs:
            return y
        x2 = x.reshape(-1, self.in_features)
        if y.dim() != 2 or y.stride(-1) != 1:
            y = y.reshape(-1, self.out_features).contiguous()
        if self.backend == "cpu":
            starts, lens, slots = batch.tensors(segs, x.device)
            torch.ops.kvmesh.lora_sgmv(y, x2, self.a, self.b, starts, lens, slots, self.offsets)
        elif self.backend == "triton":
            starts, lens, slots = batch.tensors(segs, x.device)
            triton_lora.sgmv(y, x2, self.a, self.b, starts, lens, slots, self.offsets)
        else:
            sgmv_addmm(y, x2, self.a, self.b, segs, self.offsets)
        return y
