"""The fused Triton ops against the PyTorch reference ops of models/llama.py and rope.py,
fp32 and bf16, on fresh random inputs (poisoned outputs: every element is written)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_marks import requires_triton

from kvmesh.layers import triton_ops
from kvmesh.layers.rotary import apply_rope

pytestmark = requires_triton
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _rms_ref(x, w, eps):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, n", [(1, 64), (7, 96), (3, 576)])
def test_rms_norm_and_residual_add(device, dtype, t, n):
    g = torch.Generator().manual_seed(t * n)
    x, a = torch.randn(t, n, generator=g).to(dtype), torch.randn(t, n, generator=g).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    out = triton_ops.rms_norm(x.to(device), w.to(device), 1e-5)
    torch.testing.assert_close(out.cpu(), _rms_ref(x, w, 1e-5), **_tol(dtype))
    total, normed = triton_ops.add_rms_norm(x.to(device), a.to(device), w.to(device), 1e-5)
    assert torch.equal(total.cpu(), x + a)
    torch.testing.assert_close(normed.cpu(), _rms_ref(x + a, w, 1e-5), **_tol(dtype))
    assert not normed.isnan().any() and not out.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h, kvh, d", [(4, 2, 16), (3, 1, 64), (2, 2, 32)])
def test_rope_on_fused_qkv(device, dtype, h, kvh, d):
    t = 5
    g = torch.Generator().manual_seed(h * d)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype)
    ang = torch.rand(t, 1, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    q, k, v = triton_ops.rope_qkv(qkv.to(device), cos.to(device), sin.to(device), h, kvh)
    rq, rk, rv = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    torch.testing.assert_close(q.cpu(), apply_rope(rq.reshape(t, h, d), cos, sin), **_tol(dtype))
    torch.testing.assert_close(k.cpu(), apply_rope(rk.reshape(t, kvh, d), cos, sin), **_tol(dtype))
    assert torch.equal(v.cpu(), rv.reshape(t, kvh, d))
    assert q.shape == (t, h, d) and k.shape == (t, kvh, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, i", [(1, 128), (6, 1536), (2, 40)])
def test_silu_and_mul(device, dtype, t, i):
    g = torch.Generator().manual_seed(i)
    gu = torch.randn(t, 2 * i, generator=g).to(dtype) * 3
    out = triton_ops.silu_and_mul(gu.to(device))
    ref = F.silu(gu[:, :i]) * gu[:, i:]
    torch.testing.assert_close(out.cpu(), ref, **_tol(dtype))


def test_bound_only_where_asked():
    from kvmesh.config import KernelConfig
    from kvmesh.layers.norm import RMSNorm
    from kvmesh.layers.op import OpContext

    assert RMSNorm(8, 1e-6).backend != "triton"  # CPU layers keep the C++ / PyTorch ops unless asked
    assert RMSNorm(8, 1e-6, OpContext(kernels=KernelConfig(layer_ops="triton"))).backend == "triton"
