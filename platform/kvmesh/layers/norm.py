"""RMSNorm, alone and fused with the residual add that precedes it in a decoder layer.

    rms_norm(x)         = w * to_dtype(x * rsqrt(mean(x^2) + eps))    (math in float32)
    add_forward(h, a)   = (h + a, rms_norm(h + a))

Gemma's norms (`offset=1`) store a zero-centred weight and scale by (1 + w), in float32
before the cast: to_dtype(x * rsqrt(mean(x^2) + eps) * (1 + w)).

Backends: torch (the reference: normalize in float32, scale in the model dtype, as
transformers does), cpu (csrc/fused_ops.cpp), triton (triton_ops.py); same numbers up to
float summation order.
"""

from __future__ import annotations

import torch

from kvmesh.layers import triton_ops
from kvmesh.layers.op import CustomOp, OpContext


class RMSNorm(CustomOp):
    def __init__(self, dim: int, eps: float, ctx: OpContext | None = None, offset: float = 0.0):
        super().__init__(ctx)
        self.eps, self.offset = eps, offset
        self.weight = torch.nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.bind()

    def select(self, ctx: OpContext) -> str:
        # The kernels scale by w: Gemma's (1 + w) is passed as w in float32 (the kernel's
        # math and cast order then equal Gemma's); other dtypes run the reference.
        if self.offset and not (ctx.dtype == torch.float32 and super().select(ctx) == "cpu"):
            return "torch"
        return super().select(ctx)

    def _scale(self) -> torch.Tensor:
        return self.weight + self.offset if self.offset else self.weight

    def bind(self) -> None:
        super().bind()
        self._add = getattr(self, f"add_forward_{self.backend}")

    def add_forward(self, residual: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + update, norm(residual + update)) in one op where the backend fuses it."""
        return self._add(residual, update)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        if self.offset:
            return (x.float() * torch.rsqrt(var + self.eps) * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)

    def add_forward_torch(self, residual: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual + update
        return h, self.forward_torch(h)

    # The kernels take (T, hidden) rows; other shapes take the reference.
    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward_torch(x)
        return torch.ops.kvmesh.rms_norm(x, self._scale(), self.eps)

    def add_forward_cpu(self, residual: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual.dim() != 2:
            return self.add_forward_torch(residual, update)
        return torch.ops.kvmesh.add_rms_norm(residual, update, self._scale(), self.eps)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward_torch(x)
        return triton_ops.rms_norm(x, self.weight, self.eps)

    def add_forward_triton(self, residual: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual.dim() != 2:
            return self.add_forward_torch(residual, update)
        return triton_ops.add_rms_norm(residual, update, self.weight, self.eps)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}, backend={self.backend}"
