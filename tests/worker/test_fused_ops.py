"""csrc/fused_ops.cpp against the PyTorch reference ops of kvmesh/models (llama.py,
rope.py), in float32 (summation-order tolerance) and bf16 / fp16 (the reference's
roundings between steps are reproduced, so results are equal or within one ulp)."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.layers.norm import RMSNorm
from kvmesh.layers import native
from kvmesh.layers.rotary import apply_rope

pytestmark = pytest.mark.skipif(not native.load(), reason="CPU kernels need a C++ compiler")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:  # one ulp of the low-precision dtype at most
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def _ref_norm(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_rms_norm_and_fused_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    n = 96
    x, a = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    _close(torch.ops.kvmesh.rms_norm(x, w, 1e-6), _ref_norm(x, w, 1e-6))
    h, y = torch.ops.kvmesh.add_rms_norm(x, a, w, 1e-6)
    assert torch.equal(h, x + a)  # the residual add rounds like `x + a`
    _close(y, _ref_norm(x + a, w, 1e-6))
    # The module picks the fused op for 2-D CPU input and the reference otherwise.
    norm = RMSNorm(n, 1e-6).to(dtype)
    norm.weight.data.copy_(w)
    _close(norm(x), _ref_norm(x, w, 1e-6))
    _close(norm(x.unsqueeze(0))[0], _ref_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (9, 3, 64), (2, 2, 8)])
def test_rope_qkv_matches_split_and_apply_rope(dtype, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(heads * dim)
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    ang = torch.randn(t, 1, dim // 2, generator=g)
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    q, k, v = torch.ops.kvmesh.rope_qkv(qkv, cos, sin, heads, kv_heads)
    rq, rk, rv = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    _close(q, apply_rope(rq.view(t, heads, dim), cos, sin))
    _close(k, apply_rope(rk.view(t, kv_heads, dim), cos, sin))
    assert torch.equal(v, rv.reshape(t, kv_heads, dim))
    assert v.data_ptr() != qkv.data_ptr()  # outputs never alias the input


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gu = (3 * torch.randn(7, 2 * 48, generator=torch.Generator().manual_seed(1))).to(dtype)
    gate, up = gu.split(48, dim=-1)
    _close(torch.ops.kvmesh.silu_and_mul(gu), F.silu(gate) * up)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(RuntimeError, match="rms_norm: x"):
        torch.ops.kvmesh.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="not \\(H \\+ 2 KVH\\) \\* D"):
        torch.ops.kvmesh.rope_qkv(torch.randn(2, 30), torch.ones(2, 1, 4), torch.ones(2, 1, 4), 2, 1)
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        torch.ops.kvmesh.silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152])
def test_argmax_rows_equals_torch(vocab):
    """First index of the max (ties), of the first NaN, infinities; the sampler's greedy pick."""
    from kvmesh.worker.sampler import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = 0.0  # all tied: index 0
    if vocab > 3:
        x[2, vocab // 2] = x[2, vocab - 1] = 1e9  # a tie between two maxima: the first
        x[3, vocab - 1] = float("nan")  # a NaN wins wherever it is
        x[4, 1] = float("nan")
        x[4, 2] = float("nan")
        x[5, vocab - 2] = float("inf")
        x[6] = float("-inf")
        x[7, 0] = float("-inf")
    out = torch.ops.kvmesh.argmax_rows(x)
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(-1))
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert torch.equal(torch.ops.kvmesh.argmax_rows(x[:, : max(1, vocab // 2)]), x[:, : max(1, vocab // 2)].argmax(-1))
    assert torch.ops.kvmesh.argmax_rows(torch.zeros(0, vocab)).shape == (0,)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvmesh.argmax_rows(x.double())
