"""Fused / re-tiled ops for the CPU path.

`linear`: on this class of CPU, `F.linear` (one MKL sgemm) leaves a core idle for the
skinny GEMMs of decode (M = batch size): measured 2x slower than splitting the weight's
output rows into k zero-copy views and running them as one `bmm`, which ATen
parallelizes across the k slices. For tall inputs (prefill chunks) the split is
applied on the weight-transposed side, which is on par with or faster than
`F.linear`. Numerics are those of a plain matmul (different summation tiling only).
See benchmarks/README.md for the measurements.

`Linear` on CPU runs tall inputs (prefill chunks, M > SKINNY_ROWS) through oneDNN with
the weight reordered once into oneDNN's blocked layout (what vLLM's CPU backend does
with its `onednn_mm` handles): measured ~2x the GFLOP/s of MKL's sgemm or the bmm split
on prefill-shaped GEMMs here. The reordered copy is made on the first tall forward and
dropped whenever the module is moved or cast; it doubles the weight memory of the
dense layers (fp32 decode keeps reading the plain weight). On CPUs that multiply bf16
natively (AVX512-BF16, AMX) bf16 weights take the oneDNN path for every input, decode
included. Set KVMESH_ONEDNN_LINEAR=0 to turn it off.
"""

from __future__ import annotations

import os

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


_ONEDNN = (os.environ.get("KVMESH_ONEDNN_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
# bf16 GEMMs pay only where the CPU multiplies bf16 natively (AVX512-BF16 dot products or
# AMX tiles): there oneDNN does twice the fp32 FLOPs per cycle and reads half the bytes.
# Elsewhere bf16 weights are widened to fp32 inside each GEMM and are slower than fp32.
NATIVE_BF16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
# Weight dtypes oneDNN's packed linear serves for tall inputs (prefill chunks).
_ONEDNN_DTYPES = {torch.float32, torch.bfloat16} if NATIVE_BF16 else {torch.float32}
# ... and for skinny ones (decode): with native bf16 oneDNN beats the bmm split at every
# M (measured 2.4x at M = 1); in fp32 the bmm split keeps both cores busy at small M.
_ONEDNN_SKINNY_DTYPES = {torch.bfloat16} if NATIVE_BF16 else set()


def onednn_usable(weight: torch.Tensor, rows: int = SKINNY_ROWS + 1) -> bool:
    """Whether `Linear` runs an input of `rows` rows through oneDNN's packed GEMM."""
    if not (_ONEDNN and weight.device.type == "cpu"):
        return False
    return weight.dtype in (_ONEDNN_DTYPES if rows > SKINNY_ROWS else _ONEDNN_SKINNY_DTYPES)


class Linear(torch.nn.Linear):
    """nn.Linear whose forward uses `linear` above (same parameters and state dict), and
    oneDNN with a reordered weight for tall CPU inputs."""

    _packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and onednn_usable(self.weight, x.shape[0]):
            if self._packed is None:
                with torch.no_grad():
                    self._packed = self.weight.detach().to_mkldnn()
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)

    def _apply(self, fn, recurse: bool = True):
        self._packed = None  # moved or cast: repack from the new weight on first use
        return super()._apply(fn, recurse)

    def invalidate(self) -> None:
        """Drop the reordered weight after editing `weight` in place."""
        self._packed = None
