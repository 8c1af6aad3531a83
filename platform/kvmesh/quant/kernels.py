"""Quantized matmuls: y = x @ dequant(W)^T, with the path chosen per device and batch size.

Two paths, same numbers up to float summation order:

- `native`: kvmesh's AVX2 kernel (csrc/cpu_gemm.c) for skinny inputs on CPU (decode:
  M <= NATIVE_MAX_ROWS). It reads each weight byte once: this is where the speed of
  quantized decode comes from.
- `dequant`: dequantize the weight to the activation dtype, then `ops.linear`. Always
  correct, runs on every device; used for tall inputs (prefill, where the matmul is
  compute-bound and the dequantize is amortized over many rows), on CUDA, and where
  the kernel cannot be built.

PyTorch's own CPU ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) were
measured and rejected on this class of CPU: slower than float32 at every M (see
benchmarks/README.md).
"""

from __future__ import annotations

import torch

from kvmesh.quant import native
from kvmesh.quant.primitives import dequantize_int4, dequantize_int8, unpack_int4
from kvmesh.worker.ops import linear

# Rows up to which the native kernel beats dequantize + matmul (measured, see README).
NATIVE_MAX_ROWS = 32


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def use_native(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.shape[0] <= NATIVE_MAX_ROWS and native.get_lib() is not None


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) float, qweight (N, K) int8, scales (N,) float32 -> (M, N) in x.dtype."""
    k = x.shape[1]
    if use_native(x) and k % 16 == 0:
        xf = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
        native.get_lib().kvm_int8_gemm(_ptr(xf), x.shape[0], k, _ptr(qweight), _ptr(scales),
                                       qweight.shape[0], _ptr(y))
        return y.to(x.dtype)
    return linear(x, dequantize_int8(qweight, scales, x.dtype))


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """x (M, K), qweight packed (N, K / 2) uint8, scales / zeros fp16 (N, K / G) -> (M, N)."""
    m, k = x.shape
    groups = scales.shape[1]
    g = k // groups
    if use_native(x) and g % 16 == 0:
        xf = x.to(torch.float32)
        xe, xo = xf[:, 0::2].contiguous(), xf[:, 1::2].contiguous()
        xs = xf.view(m, groups, g).sum(dim=2).contiguous()
        y = torch.empty(m, qweight.shape[0], dtype=torch.float32)
        native.get_lib().kvm_int4_gemm(_ptr(xe), _ptr(xo), _ptr(xs), m, k, _ptr(qweight), _ptr(scales),
                                       _ptr(zeros), qweight.shape[0], g, _ptr(y))
        return y.to(x.dtype)
    return linear(x, dequantize_int4(unpack_int4(qweight), scales, zeros, x.dtype))
