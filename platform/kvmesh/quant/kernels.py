"""Quantized matmuls: y = x @ dequant(W)^T, with the path chosen per device and batch size.

Three paths, same numbers up to float summation order:

- `native`: kvmesh's AVX2 kernel (layers/csrc/quant_gemm.cpp, part of the one native
  build) for skinny inputs on CPU (decode: M <= NATIVE_MAX_ROWS). It reads each weight byte once and keeps activations in
  float32: this is where the speed of quantized decode comes from.
- `triton`: on CUDA, Triton kernels (triton_gemm.py) for inputs up to
  triton_gemm.MAX_ROWS rows: the weight is dequantized in registers, each byte read once.
- `dequant`: dequantize the weight to the activation dtype, then `ops.linear`. Always
  correct, runs on every device; used for tall inputs (prefill, where the matmul is
  compute-bound and the dequantize is amortized over many rows), on CUDA, where the
  kernel cannot be built, and for layouts the kernel does not take (int4 groups that
  are not a multiple of 32 columns, int8 rows or groups not a multiple of 16).

PyTorch's own CPU ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) were
measured again against this kernel (torch 2.13, AVX2-only EPYC, 1 thread, 30 layers of
SmolLM2 shapes so weights stream from memory, batch 1, busy machine: indicative):
`_weight_int4pack_mm_for_cpu` took ~500 ms per token's projections, float32 ~44 ms,
kvmesh int4 g32 ~15 ms; so it is not used.
"""

from __future__ import annotations

import torch

from kvmesh.layers import native
from kvmesh.layers.linear import split_linear
from kvmesh.quant import triton_gemm
from kvmesh.quant.primitives import dequantize_int4, dequantize_int8, unpack_int4

# Rows up to which the native kernel beats dequantize + matmul (measured, see benchmarks/README.md).
NATIVE_MAX_ROWS = 32


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[0] <= triton_gemm.MAX_ROWS and triton_gemm.can_run(x)


def native_usable(rows: int, device: torch.device) -> bool:
    """Whether an input of `rows` rows on `device` runs the native kernel (layouts aside)."""
    return rows <= NATIVE_MAX_ROWS and device.type == "cpu" and native.has_quant_gemm()


def int8_native_layout(k: int, scales: torch.Tensor) -> bool:
    """Whether the native kernel takes an int8 weight of `k` columns with these scales."""
    g = k if scales.dim() == 1 else k // scales.shape[1]
    return k % 16 == 0 and g % 16 == 0


def int4_native_layout(k: int, scales: torch.Tensor) -> bool:
    """Whether the native kernel takes an int4 weight of `k` columns with these scales."""
    return (k // scales.shape[1]) % 32 == 0


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, native_ok: bool = True) -> torch.Tensor:
    """x (M, K) float, qweight (N, K) int8, scales float32 (N,) or (N, K / G) -> (M, N) in x.dtype.
    `native_ok` False (KernelConfig.quantized_cpu_gemm off) keeps the native kernel out."""
    if use_triton(x):
        return triton_gemm.int8_matmul(x, qweight, scales)
    k = x.shape[1]
    if native_ok and int8_native_layout(k, scales) and native_usable(x.shape[0], x.device):
        y = torch.ops.kvmesh.int8_linear(_as_f32(x), qweight, scales)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    return split_linear(x, dequantize_int8(qweight, scales, x.dtype))


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                mins: bool = False, native_ok: bool = True) -> torch.Tensor:
    """x (M, K), qweight packed (N, K / 2) uint8, scales / offsets fp16 (N, K / G) -> (M, N).

    `offsets` are zero points, or GGUF Q4_1 minima when `mins` (see primitives.py).
    """
    if use_triton(x):
        return triton_gemm.int4_matmul(x, qweight, scales, offsets, mins)
    k = x.shape[1]
    if native_ok and int4_native_layout(k, scales) and native_usable(x.shape[0], x.device):
        y = torch.ops.kvmesh.int4_linear(_as_f32(x), qweight, scales, offsets, mins)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    return split_linear(x, dequantize_int4(unpack_int4(qweight), scales, offsets, x.dtype, mins))
