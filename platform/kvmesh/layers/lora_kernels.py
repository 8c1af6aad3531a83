"""The batched multi-LoRA delta (SGMV: segmented gather matrix-vector), in place:

    for segment i, rows t in [seg_starts[i], seg_starts[i] + seg_lens[i]), s = seg_slots[i]
    (s < 0: the base model, skipped), and shard l (columns off[l] .. off[l + 1] of y):
        h[t, l]                  = x[t] @ a[l, s]^T                          (R,)    shrink
        y[t, off[l]:off[l + 1]] += h[t, l] @ b[s, :, off[l]:off[l + 1]]      (N_l,)  expand

Layouts (one dtype, float32 or bfloat16, for all four):

    x (T, K), y (T, N)   activations and the base output (y's columns contiguous)
    a (L, S, R, K)       LoRA A per shard and slot (L = 1 plain linear, 3 fused q/k/v, 2 gate/up)
    b (S, R, N)          LoRA B *transposed* (rank-major), the shards side by side along N:
                         b[s, :, off[l]:off[l + 1]] = B_l[s]^T, with B_l[s] the (N_l, R) PEFT lora_B
    shard_offsets        L + 1 column offsets, 0 .. N (None: one shard, [0, N])

B rank-major makes the expand stream contiguous rows of N (the CPU kernel: R broadcast-FMAs per
output vector; Triton: a plain (BLOCK_R, BLOCK_N) tile), where (N, R) needs an R-long dot
product per output. The LoRA scale (alpha / r) is folded into b; ranks below R are
zero-padded (zero rows of a, zero rows of b). Segments do not overlap; rows outside every
segment are untouched. Segment tensors are int32 or int64 on x's device.

Numerics: fp32 products and sums, h kept in fp32, y rounded once after its delta is added.

Backends: `lora_sgmv_torch` (the reference, any device), `lora_sgmv_native` (csrc/lora.cpp),
`lora_sgmv_triton` (triton_lora.py, CUDA); `lora_sgmv` picks one per call from the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.layers import native, triton_lora
from kvmesh.layers.triton_runtime import can_run as triton_can_run
from kvmesh.layers.triton_runtime import unavailable_reason as triton_unavailable

DTYPES = (torch.float32, torch.bfloat16)


def shard_offsets_for(a: torch.Tensor, y: torch.Tensor, shard_offsets: Sequence[int] | None) -> list[int]:
    """The checked L + 1 column offsets of y's shards (None: one shard of all N columns)."""
    num_shards, n = a.shape[0], y.shape[1]
    offsets = [0, n] if shard_offsets is None else [int(o) for o in shard_offsets]
    if (len(offsets) != num_shards + 1 or offsets[0] != 0 or offsets[-1] != n
            or any(lo > hi for lo, hi in zip(offsets, offsets[1:]))):
        raise ValueError(f"lora_sgmv: shard_offsets {offsets} must be {num_shards + 1} non-decreasing column "
                         f"offsets from 0 to N={n} (one shard per row of a)")
    return offsets


def check_args(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
               seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """Shapes, dtypes and devices (not the segments' values: that needs a host read)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_sgmv: x (T, K) and y (T, N), got {tuple(x.shape)} and {tuple(y.shape)}")
    if a.dim() != 4 or a.shape[3] != x.shape[1]:
        raise ValueError(f"lora_sgmv: a must be (L, S, R, K={x.shape[1]}), got {tuple(a.shape)}")
    if b.dim() != 3 or tuple(b.shape) != (a.shape[1], a.shape[2], y.shape[1]):
        raise ValueError(f"lora_sgmv: b must be (S, R, N) = {(a.shape[1], a.shape[2], y.shape[1])}, "
                         f"got {tuple(b.shape)}")
    if y.dtype not in DTYPES or {x.dtype, a.dtype, b.dtype} != {y.dtype}:
        raise ValueError(f"lora_sgmv: x, y, a, b must share one dtype of {DTYPES}, got "
                         f"{x.dtype}, {y.dtype}, {a.dtype}, {b.dtype}")
    if not seg_starts.numel() == seg_lens.numel() == seg_slots.numel():
        raise ValueError("lora_sgmv: one start, length and slot per segment")
    if y.stride(1) != 1:
        raise ValueError("lora_sgmv: y must have contiguous columns (it is updated in place)")


def lora_sgmv_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
                    seg_lens: torch.Tensor, seg_slots: torch.Tensor,
                    shard_offsets: Sequence[int] | None = None) -> None:
    """The PyTorch reference (any device): a loop over segments and shards, two matmuls each."""
    check_args(y, x, a, b, seg_starts, seg_lens, seg_slots)
    offsets = shard_offsets_for(a, y, shard_offsets)
    for start, n, s in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        if s < 0 or n == 0:
            continue
        if not (0 <= start and start + n <= y.shape[0] and s < a.shape[1]):
            raise ValueError(f"lora_sgmv: segment (start {start}, length {n}, slot {s}) outside "
                             f"{y.shape[0]} rows / {a.shape[1]} slots")
        rows = slice(start, start + n)
        xs = x[rows].float()
        for shard, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            h = xs @ a[shard, s].float().T  # (n, R)
            y[rows, lo:hi] = (y[rows, lo:hi].float() + h @ b[s, :, lo:hi].float()).to(y.dtype)


def lora_sgmv_native(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
                     seg_lens: torch.Tensor, seg_slots: torch.Tensor,
                     shard_offsets: Sequence[int] | None = None) -> None:
    """The native CPU kernel (csrc/lora.cpp); the kernels must be loaded (native.load)."""
    check_args(y, x, a, b, seg_starts, seg_lens, seg_slots)
    torch.ops.kvmesh.lora_sgmv(y, x, a, b, seg_starts, seg_lens, seg_slots, shard_offsets_for(a, y, shard_offsets))


def lora_sgmv_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
                     seg_lens: torch.Tensor, seg_slots: torch.Tensor,
                     shard_offsets: Sequence[int] | None = None) -> None:
    """The Triton shrink and expand kernels (triton_lora.py): CUDA, or CPU when interpreting."""
    check_args(y, x, a, b, seg_starts, seg_lens, seg_slots)
    if not triton_can_run(x.device):
        raise RuntimeError(f"lora_sgmv: {triton_unavailable(x.device)}")
    triton_lora.sgmv(y, x, a, b, seg_starts, seg_lens, seg_slots, shard_offsets_for(a, y, shard_offsets))


def backend_for(x: torch.Tensor) -> str:
    """"cpu" (native, when loaded: this never builds), "triton" (CUDA) or "torch"."""
    if x.device.type == "cpu":
        return "cpu" if native.loaded() else "torch"
    if x.is_cuda and triton_can_run(x.device):
        return "triton"
    return "torch"


def lora_sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
              seg_lens: torch.Tensor, seg_slots: torch.Tensor, shard_offsets: Sequence[int] | None = None) -> None:
    """y += the LoRA delta of each segment's slot, in place (layouts: the module doc)."""
    backend = backend_for(x)
    if backend == "cpu":
        lora_sgmv_native(y, x, a, b, seg_starts, seg_lens, seg_slots, shard_offsets)
    elif backend == "triton":
        lora_sgmv_triton(y, x, a, b, seg_starts, seg_lens, seg_slots, shard_offsets)
    else:
        lora_sgmv_torch(y, x, a, b, seg_starts, seg_lens, seg_slots, shard_offsets)
