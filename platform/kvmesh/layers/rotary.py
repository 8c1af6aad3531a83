"""Rotary position embedding applied to the fused QKV projection.

`RotaryQKV` splits a (T, (H + 2 KVH) D) projection into q (T, H, D), k (T, KVH, D) and
v (T, KVH, D) and rotates q and k (rotate-half convention, HF Llama) by the per-token
cos / sin tables (T, 1, D) of models/rope.py. Backends: torch (`apply_rope`), cpu
(csrc/fused_ops.cpp rope_qkv: one pass, no intermediate q / k copies), triton.
"""

from __future__ import annotations

import torch

from kvmesh.layers import triton_ops
from kvmesh.layers.op import CustomOp, OpContext


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D), rotate-half convention (HF Llama)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class RotaryQKV(CustomOp):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ctx: OpContext | None = None):
        super().__init__(ctx)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.bind()

    def forward_torch(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)  # (T, H, D)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)  # (T, KVH, D)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)

    def forward_cpu(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return torch.ops.kvmesh.rope_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads)

    def forward_triton(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return triton_ops.rope_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, backend={self.backend}"
