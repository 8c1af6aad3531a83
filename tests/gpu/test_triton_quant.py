"""The Triton weight-only int8 / int4 matmuls against dequantize-then-matmul (the
reference path of quant/kernels.py): per-channel and grouped int8, int4 with zero points
and with GGUF minima, ragged M / N / K, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from gpu_marks import requires_triton

from kvmesh.quant import triton_gemm
from kvmesh.quant.primitives import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

pytestmark = requires_triton


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(1, 96, 128), (5, 70, 192)])
def test_int8_per_channel_and_grouped(device, dtype, m, n, k):
    g = torch.Generator().manual_seed(m * n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g).to(dtype)
    q, s = quantize_int8(w)
    y = triton_gemm.int8_matmul(x.to(device), q.to(device), s.to(device))
    ref = x.float() @ dequantize_int8(q, s, dtype).float().T
    assert y.dtype == dtype and _rel(y.cpu(), ref) < _tol(dtype)
    sg = (torch.rand(n, k // 32, generator=g) + 0.1) / 100  # GGUF Q8_0-style: a scale per 32 columns
    y = triton_gemm.int8_matmul(x.to(device), q.to(device), sg.to(device))
    assert _rel(y.cpu(), x.float() @ dequantize_int8(q, sg, dtype).float().T) < _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("mins", [False, True])
def test_int4(device, dtype, group, mins):
    m, n, k = 3, 80, 256
    gen = torch.Generator().manual_seed(group + mins)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen).to(dtype)
    q, s, z = quantize_int4(w, group)
    off = (-z.float() * s.float()).to(torch.float16) if mins else z
    packed = pack_int4(q)
    y = triton_gemm.int4_matmul(x.to(device), packed.to(device), s.to(device), off.to(device), mins)
    ref = x.float() @ dequantize_int4(unpack_int4(packed), s, off, dtype, mins).float().T
    assert y.shape == (m, n) and not y.isnan().any()
    assert _rel(y.cpu(), ref) < _tol(dtype)
