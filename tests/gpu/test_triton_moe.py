"""The Triton fused MoE (layers/triton_moe.py) against FusedMoE's PyTorch reference, fp32 and
bf16, at tiny sizes (interpreted on CPU here), and its block alignment exactly."""

from __future__ import annotations

import pytest
import torch
from gpu_marks import requires_triton

from kvmesh.config import KernelConfig
from kvmesh.layers import triton_moe
from kvmesh.layers.moe import FusedMoE, route
from kvmesh.layers.op import OpContext

pytestmark = requires_triton


def test_align_block_size_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5; expert 1 gets none
    pairs, experts = triton_moe.align_block_size(ids, num_experts=4, block_m=4)
    s = 6  # the padding sentinel: T k
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5; expert 3: pair 3; each padded to 4
    want = [1, 4, s, s, 0, 2, 5, s, 3, s, s, s]
    assert pairs[:12].tolist() == want and (pairs[12:] == s).all()
    assert experts[:3].tolist() == [0, 2, 3] and (experts[3:] == -1).all()
    assert pairs.numel() == experts.numel() * 4 >= 12


def _moe(device, dtype, e, k, h, i, renorm, seed):
    g = torch.Generator().manual_seed(seed)
    ref = FusedMoE(e, k, h, i, renormalize=renorm, ctx=OpContext(dtype=dtype, kernels=KernelConfig(cpu_kernels=False)))
    with torch.no_grad():
        ref.w13.copy_(torch.randn(ref.w13.shape, generator=g) * 0.3)
        ref.w2.copy_(torch.randn(ref.w2.shape, generator=g) * 0.3)
    tri = FusedMoE(e, k, h, i, renormalize=renorm,
                   ctx=OpContext(device=device, dtype=dtype, kernels=KernelConfig(layer_ops="triton")))
    tri.weight_loader(tri.w13, ref.w13.detach(), None, "gate_up")
    tri.weight_loader(tri.w2, ref.w2.detach(), None, "down")
    return ref, tri


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, e, k, h, i, renorm", [(1, 4, 2, 32, 48, True), (5, 8, 1, 48, 32, False),
                                                   (40, 4, 2, 32, 16, True)])
def test_fused_moe_matches_reference(device, dtype, t, e, k, h, i, renorm):
    ref, tri = _moe(device, dtype, e, k, h, i, renorm, seed=t)
    assert tri.backend == "triton"
    g = torch.Generator().manual_seed(t + 1)
    x = torch.randn(t, h, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g).to(dtype)
    if t > 4:
        logits[:, 1] = -30.0  # an expert without tokens
    with torch.no_grad():
        want = ref(x, logits)
        out = tri(x.to(device), logits.to(device)).cpu()
    assert out.dtype == dtype and out.shape == (t, h)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        assert ((out.float() - want.float()).norm() / want.float().norm()) < 1e-2


def test_fused_moe_block_m_64_and_empty_batch(device):
    """Prefill-shaped: 64-row groups (more pairs than 4 per expert); and zero tokens."""
    e, k, h, i = 2, 2, 16, 16
    ref, tri = _moe(device, torch.float32, e, k, h, i, True, seed=9)
    t = 5 * e  # 2 t = 20 pairs > 4 e -> BLOCK_M 64
    assert triton_moe.block_m_for(t * k, e) == 64
    g = torch.Generator().manual_seed(10)
    x, logits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(tri(x.to(device), logits.to(device)).cpu(), ref(x, logits), rtol=1e-5, atol=1e-5)
        weights, ids = route(logits[:0], k, True)
        assert triton_moe.fused_moe(x[:0].to(device), tri.w13, tri.w2, weights, ids).shape == (0, h)
