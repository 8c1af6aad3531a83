"""Batched multi-LoRA: one step's rows run under different adapters (S-LoRA / Punica SGMV).

A step's rows are ordered by the model runner so that each adapter's rows are contiguous:
`LoRABatch.segments` lists (first row, rows, slot) runs; rows of base-model requests are in
no segment. Every linear layer an adapter targets carries a `LoRASlots` as its delta
(`Linear.set_delta`): after the base GEMM it adds, per segment,

    y[rows] += (x[rows] @ A_slot^T) @ B_slot^T

one small GEMM pair per adapter per layer, whatever the batch mix. The slots hold up to
`max_loras` adapters resident at once, ranks zero-padded to `max_rank`; the scale
(alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B when a slot is filled.

Fused projections (q/k/v, gate/up) hold one rank block per shard: A_slot is (shards * R, K)
and B_slot (N, shards * R) with shard l's block in rows / columns [l R, (l + 1) R) of A / B
and its output columns in B's rows; B is zero elsewhere (block diagonal), so the pair is
still two GEMMs, and a checkpoint that adapts the fused module whole (Phi-3) simply fills
block 0 across every output row.

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

_local = threading.local()


@dataclass
class LoRABatch:
    """The adapter segments of one step: (start row, number of rows, slot) per run of rows
    under one adapter, in row order."""

    segments: list[tuple[int, int, int]]
    _tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(starts, lens, slots) as int32 tensors on `device`, for the kernels; built once a step."""
        got = self._tensors.get(device)
        if got is None:
            cols = list(zip(*self.segments)) if self.segments else ([], [], [])
            got = tuple(torch.tensor(c, dtype=torch.int32, device=device) for c in cols)
            self._tensors[device] = got
        return got

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


def sgmv_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   segments: Sequence[tuple[int, int, int]], used: Sequence[bool] | None = None) -> None:
    """y[rows] += (x[rows] @ a[slot]^T) @ b[slot]^T in place, per segment: the PyTorch path
    and the kernels' oracle. x (T, K), y (T, N), a (S, P, K), b (S, N, P)."""
    for start, n, slot in segments:
        if used is not None and not used[slot]:
            continue
        ys = y.narrow(0, start, n)
        ys.addmm_(x.narrow(0, start, n) @ a[slot].t(), b[slot].t())


class LoRASlots:
    """One linear layer's adapter slots, and the delta it adds (see the module docstring).

    `shards` are (output start, output size) per shard of a fused layer ([(0, N)] otherwise).
    """

    def __init__(self, in_features: int, shards: Sequence[tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.in_features = in_features
        self.shards = list(shards)
        self.out_features = sum(n for _, n in self.shards)
        self.max_rank = max_rank
        width = len(self.shards) * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, self.out_features, width, dtype=dtype, device=device)
        # Slots whose adapter adapts this layer (others add nothing and are skipped). The
        # buffers are written only under inference mode (the steps read them under it).
        self.used = [False] * num_slots

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        if self.used[slot]:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.used[slot] = False

    @torch.inference_mode()
    def fill(self, slot: int, parts: Sequence[tuple[int | None, torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter into `slot`: (shard index or None for the whole layer, A (r, K),
        B (n, r) already scaled) per adapted shard."""
        self.clear(slot)
        r_max = self.max_rank
        for shard, a, b in parts:
            block = 0 if shard is None else shard
            start, size = (0, self.out_features) if shard is None else self.shards[shard]
            r = a.shape[0]
            self.a[slot, block * r_max : block * r_max + r].copy_(a)
            self.b[slot, start : start + size, block * r_max : block * r_max + r].copy_(b)
        self.used[slot] = bool(parts)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = getattr(_local, "batch", None)
        if batch is None:
            return y
        segs = [s for s in batch.segments if self.used[s[2]]]
        if segs:
            sgmv_reference(y if y.dim() == 2 else y.view(-1, self.out_features),
                           x.reshape(-1, self.in_features), self.a, self.b, segs)
        return y
