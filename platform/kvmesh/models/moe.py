"""The sparse MLP block of Mixtral and Qwen3-MoE: a router gate and the experts.

Checkpoints store each expert's projections apart (`mlp.experts.<e>.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.<e>.w1.weight`) or, as transformers 5.x holds them in
memory, all experts in one tensor (`mlp.experts.gate_up_proj` (E, 2I, H),
`mlp.experts.down_proj` (E, H, I)); both load into FusedMoE's w13 / w2 (names parsed by
layers/moe.py `expert_tensor`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvmesh.layers.linear import Linear
from kvmesh.layers.moe import FusedMoE
from kvmesh.layers.op import OpContext
from kvmesh.models.arch import ArchConfig


def expert_keys(param_name: str, num_experts: int, expert: int | None, shard: str) -> set[str]:
    """The (expert, shard) pieces of a FusedMoE parameter one checkpoint tensor fills."""
    experts = range(num_experts) if expert is None else (expert,)
    shards = ("gate", "up") if shard == "gate_up" else (shard,)
    return {f"{param_name}:{e}:{s}" for e in experts for s in shards}


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False, ctx=ctx)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                renormalize=cfg.norm_topk_prob or cfg.architecture == "MixtralForCausalLM", ctx=ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
