"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing over E gated experts.

Provisional reference implementation (torch), to be replaced by the fused CPU / Triton
paths: the interface below is what the models call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.layers.op import CustomOp, OpContext


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    """(weights (T, k) in `dtype`, expert ids (T, k)): softmax over all experts in float32,
    top-k, renormalized over the chosen k when `renormalize` (as transformers does)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedMoE(CustomOp):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, ctx: OpContext | None = None):
        super().__init__(ctx)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.bind()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int | None, shard: str) -> None:
        i = self.intermediate_size
        rows = {"gate": (0, i), "up": (i, i), "gate_up": (0, 2 * i), "down": (0, self.hidden_size)}[shard]
        dest = param.data if expert_id is None else param.data[expert_id]
        dest.narrow(-2, *rows).copy_(loaded)

    def forward_torch(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tok], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out
