"""Fused / re-tiled ops for the CPU path.

`linear`: on this class of CPU, `F.linear` (one MKL sgemm) leaves a core idle for the
skinny GEMMs of decode (M = batch size): measured 2x slower than splitting the weight's
output rows into k zero-copy views and running them as one `bmm`, which ATen
parallelizes across the k slices. For tall inputs (prefill chunks) the split is
applied on the weight-transposed side, which is on par with or faster than
`F.linear`. Numerics are those of a plain matmul (different summation tiling only).
See benchmarks/README.md for the measurements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Inputs with at most this many rows use the weight-major bmm (decode-shaped).
SKINNY_ROWS = 16


def _splits(out_features: int) -> int:
    k = max(4, torch.get_num_threads())
    while k > 1 and out_features % k:
        k -= 1
    return k


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias for x (M, in), weight (out, in)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    m, i = x.shape
    o = weight.shape[0]
    k = _splits(o)
    if k == 1:
        return F.linear(x, weight, bias)
    w = weight.view(k, o // k, i)
    if m <= SKINNY_ROWS:
        # (k, o/k, i) @ (k, i, m) -> (k, o/k, m) -> (o, m) -> (m, o)
        y = torch.bmm(w, x.t().unsqueeze(0).expand(k, i, m)).view(o, m).t()
    else:
        # (k, m, i) @ (k, i, o/k) -> (k, m, o/k) -> (m, k, o/k) -> (m, o)
        y = torch.bmm(x.unsqueeze(0).expand(k, m, i), w.transpose(1, 2)).transpose(0, 1).reshape(m, o)
    if bias is not None:
        y = y + bias
    return y


class Linear(torch.nn.Linear):
    """nn.Linear whose forward uses `linear` above (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
