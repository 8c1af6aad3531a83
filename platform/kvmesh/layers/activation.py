"""The gated MLP's activation on the fused (T, 2I) gate-up projection: silu(gate) * up
(Llama family; backends torch, cpu (csrc/fused_ops.cpp), triton (triton_ops.py)) and
gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`; torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.layers import triton_ops
from kvmesh.layers.op import CustomOp, OpContext


class SiluAndMul(CustomOp):
    def __init__(self, ctx: OpContext | None = None):
        super().__init__(ctx)
        self.bind()

    def forward_torch(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvmesh.silu_and_mul(gate_up)

    def forward_triton(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_ops.silu_and_mul(gate_up)


class GeluTanhAndMul(CustomOp):
    def __init__(self, ctx: OpContext | None = None):
        super().__init__(ctx)
        self.bind()

    def forward_torch(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
