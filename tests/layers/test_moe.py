"""FusedMoE against transformers' own sparse MoE blocks (Mixtral, Qwen3-MoE): the block built
from a tiny config with every parameter randomized, its weights loaded into FusedMoE (per
expert and fused 3-D) plus a Linear router gate, each backend compared at float32 and bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kvmesh.config import KernelConfig
from kvmesh.layers.linear import Linear
from kvmesh.layers.moe import FusedMoE, expert_tensor, route
from kvmesh.layers.op import OpContext, TPGroup

H, I = 32, 48
BACKENDS = {"torch": KernelConfig(cpu_kernels=False), "cpu": KernelConfig()}


def hf_block(arch: str, num_experts: int, top_k: int, norm_topk_prob: bool = True, seed: int = 0):
    common = dict(hidden_size=H, num_experts_per_tok=top_k, hidden_act="silu", experts_implementation="eager")
    if arch == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=I, num_local_experts=num_experts, **common))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(moe_intermediate_size=I, num_experts=num_experts,
                                                      norm_topk_prob=norm_topk_prob, **common))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block.eval()


def kvmesh_moe(block, backend: str, fused: bool, dtype=torch.float32, tp: TPGroup | None = None):
    """(FusedMoE, router Linear) holding `block`'s weights, loaded per expert or fused."""
    experts = block.experts
    e, top_k = experts.gate_up_proj.shape[0], block.gate.top_k
    renorm = getattr(block.gate, "norm_topk_prob", True)
    ctx = OpContext(dtype=dtype, kernels=BACKENDS[backend], tp=tp or TPGroup())
    moe = FusedMoE(e, top_k, H, I, renormalize=renorm, ctx=ctx)
    gate = Linear(H, e, bias=False, ctx=OpContext(dtype=dtype, kernels=BACKENDS[backend]))
    gate.weight_loader(gate.weight, block.gate.weight.detach())
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if fused:
        moe.weight_loader(moe.w13, gate_up, None, "gate_up")
        moe.weight_loader(moe.w2, down, None, "down")
    else:
        for i in range(e):
            moe.weight_loader(moe.w13, gate_up[i, :I], i, "gate")
            moe.weight_loader(moe.w13, gate_up[i, I:], i, "up")
            moe.weight_loader(None, down[i], i, "down")
    return moe, gate


def run(moe, gate, x):
    with torch.no_grad():
        return moe(x, gate(x))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("arch, top_k, norm", [("mixtral", 2, True), ("mixtral", 1, True), ("qwen3_moe", 2, False),
                                               ("qwen3_moe", 2, True), ("qwen3_moe", 1, False)])
@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_matches_transformers_fp32(backend, arch, top_k, norm, fused):
    block = hf_block(arch, num_experts=8, top_k=top_k, norm_topk_prob=norm, seed=top_k)
    moe, gate = kvmesh_moe(block, backend, fused)
    assert moe.backend == backend
    for t in (1, 7, 64):
        x = torch.randn(1, t, H, generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            ref = block(x)[0]
        out = run(moe, gate, x[0])
        assert out.shape == (t, H) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_expert_without_tokens(backend):
    """Experts 2 and 5 get no token (their logits are far below the others'): skipped, and
    the rest still match transformers' experts run on the same routing."""
    block = hf_block("qwen3_moe", num_experts=8, top_k=2, norm_topk_prob=True)
    moe, _ = kvmesh_moe(block, backend, fused=True)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(4))
    logits[:, [2, 5]] = -30.0
    weights, ids = route(logits, 2, True)
    assert not torch.isin(ids, torch.tensor([2, 5])).any()
    with torch.no_grad():
        ref = block.experts(x, ids, weights)
        out = moe(x, logits)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    moe.w13.data[[2, 5]] = float("nan")  # never read
    with torch.no_grad():
        assert not moe(x, logits).isnan().any()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_route_matches_transformers_router(arch):
    block = hf_block(arch, num_experts=8, top_k=2, norm_topk_prob=arch == "mixtral")
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, ref_w, ref_ids = block.gate(x)
    weights, ids = route(logits, 2, renormalize=arch == "mixtral")
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w.to(logits.dtype), rtol=0, atol=0)
    assert weights.dtype == logits.dtype


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bf16_close_to_transformers(backend, arch):
    block = hf_block(arch, num_experts=8, top_k=2, norm_topk_prob=True)
    bf16_block = copy.deepcopy(block).to(torch.bfloat16)
    moe, gate = kvmesh_moe(block, backend, fused=True, dtype=torch.bfloat16)
    for t in (1, 7, 64):
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            ref = block(x[None])[0]
            ref_bf16 = bf16_block(x[None].to(torch.bfloat16))[0].float()
            out = run(moe, gate, x.to(torch.bfloat16))
        assert out.dtype == torch.bfloat16
        rel = (out.float() - ref_bf16).norm() / ref_bf16.norm()
        assert rel < 1e-2, (t, rel)
        # Against float32, on the tokens whose bf16 logits pick the same experts (a near tie
        # may flip at bf16, in transformers too).
        with torch.no_grad():
            same = (route(gate(x.to(torch.bfloat16)), 2, True)[1].sort(1)[0]
                    == route(block.gate(x)[0], 2, True)[1].sort(1)[0]).all(1)
        assert same.float().mean() > 0.9
        rel = (out.float()[same] - ref[same]).norm() / ref[same].norm()
        assert rel < 2e-2, (t, rel)


def test_tensor_parallel_shards_sum_to_the_whole(monkeypatch):
    """Two ranks each hold half of every expert's intermediate columns; their partial outputs
    (the all-reduce replaced by a sum here) add up to the unsharded layer's."""
    monkeypatch.setattr(TPGroup, "all_reduce", lambda self, x: x)
    block = hf_block("mixtral", num_experts=4, top_k=2)
    whole, gate = kvmesh_moe(block, "cpu", fused=True)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(6))
    parts = []
    for rank in range(2):
        for fused in (True, False):
            moe, _ = kvmesh_moe(block, "cpu", fused=fused, tp=TPGroup(rank, 2))
            assert moe.w13.shape == (4, I, H) and moe.w2.shape == (4, H, I // 2)
            parts.append(run(moe, gate, x))
    torch.testing.assert_close(parts[0], parts[1])
    torch.testing.assert_close(parts[0] + parts[2], run(whole, gate, x), rtol=1e-5, atol=1e-5)


def test_loader_rejects_wrong_shapes_and_shards():
    moe = FusedMoE(4, 2, H, I, renormalize=True)
    with pytest.raises(ValueError, match="shard"):
        moe.weight_loader(moe.w13, torch.zeros(I + 1, H), 0, "gate")
    with pytest.raises(ValueError, match="unknown shard"):
        moe.weight_loader(moe.w13, torch.zeros(I, H), 0, "w1")
    with pytest.raises(ValueError, match="experts"):
        moe.weight_loader(moe.w13, torch.zeros(3, 2 * I, H), None, "gate_up")
    with pytest.raises(ValueError, match="belongs to w2"):
        moe.weight_loader(moe.w13, torch.zeros(H, I), 0, "down")
    with pytest.raises(ValueError, match="expert id"):
        moe.weight_loader(moe.w2, torch.zeros(H, I), 4, "down")


def test_expert_tensor_names():
    assert expert_tensor("model.layers.3.block_sparse_moe.experts.5.w1.weight") == (
        "model.layers.3.block_sparse_moe.experts", 5, "gate")
    assert expert_tensor("model.layers.0.block_sparse_moe.experts.0.w3.weight")[2] == "up"
    assert expert_tensor("model.layers.0.block_sparse_moe.experts.0.w2.weight")[2] == "down"
    assert expert_tensor("model.layers.1.mlp.experts.12.up_proj.weight") == ("model.layers.1.mlp.experts", 12, "up")
    assert expert_tensor("model.layers.1.mlp.experts.gate_up_proj") == ("model.layers.1.mlp.experts", None, "gate_up")
    assert expert_tensor("model.layers.1.mlp.experts.down_proj") == ("model.layers.1.mlp.experts", None, "down")
    assert expert_tensor("model.layers.1.mlp.gate.weight") is None
    assert expert_tensor("model.layers.1.mlp.down_proj.weight") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_grouped_op_equals_the_python_loop(dtype):
    """csrc/moe.cpp runs the same kernels per expert group as the Python loop it replaces
    (skinny, small-batch by group size): the same bits; groups past the small-batch GEMM take
    ATen's linear in C++ where the fp32 loop splits the weight (split_linear): equal up to
    float summation order there."""
    block = hf_block("qwen3_moe", num_experts=8, top_k=2)
    moe, gate = kvmesh_moe(block, "cpu", fused=False, dtype=dtype)
    assert moe.backend == "cpu"
    g = torch.Generator().manual_seed(3)
    for t in (1, 2, 7, 40, 300):  # groups of ~1, 2, 5 (small GEMM), 10, 75 (ATen) rows
        x = torch.randn(t, moe.hidden_size, generator=g).to(dtype)
        logits = gate(x)
        with torch.no_grad():
            ours, loop = moe(x, logits), moe.forward_cpu_loop(x, logits)
        if t < 300 or dtype != torch.float32:
            assert torch.equal(ours, loop), t
        else:
            torch.testing.assert_close(ours, loop, rtol=1e-5, atol=1e-5)
