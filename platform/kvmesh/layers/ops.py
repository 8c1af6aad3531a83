"""Fused / re-tiled ops for the CPU path.

`linear`: on this class of CPU, `F.linear` (one MKL sgemm) leaves a core idle for the
skinny GEMMs of decode (M = batch size): measured 2x slower than splitting the weight's
output rows into k zero-copy views and running them as one `bmm`, which ATen
parallelizes across the k slices. For tall inputs (prefill chunks) the split is
applied on the weight-transposed side, which is on par with or faster than
`F.linear`. Numerics are those of a plain matmul (different summation tiling only).
See benchmarks/README.md for the measurements.

`Linear` on CPU runs every GEMM through oneDNN with the weight reordered once into
oneDNN's blocked layout for a 64-row batch (`mkldnn._reorder_linear_weight`, what
torch.compile's mkldnn pass and vLLM's `onednn_mm` handles do): measured 1.2-3x the
GFLOP/s of the bmm split at decode sizes (M = 4..48) and ~1.1x MKL's sgemm on prefill
chunks here. The reordered copy is made on the first forward and dropped whenever the
module is moved or cast; it doubles the weight memory of the dense layers (the plain
weight stays the parameter: state dict, tied embeddings, quantization read it). bf16
weights take this path only on CPUs that multiply bf16 natively (AVX512-BF16, AMX).
Set KVMESH_ONEDNN_LINEAR=0 to use `linear` (the bmm split) instead. Decode-sized inputs
skip oneDNN for kvmesh's own kernels on the plain weight: 1-4 rows the skinny GEMM
(csrc/skinny_gemm.cpp), 8-64 rows of a float32 layer the small-batch GEMM
(csrc/small_gemm.cpp); see SKINNY_KERNEL_ROWS and SMALL_GEMM_ROWS below.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvmesh.layers import cpu_kernels

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
# Weight dtypes oneDNN's packed GEMM serves, at every batch size.
_ONEDNN_DTYPES = {torch.float32, torch.bfloat16} if NATIVE_BF16 else {torch.float32}
# Rows the weight's blocked layout is chosen for (oneDNN's batch-size hint). Measured on
# SmolLM2's shapes with 2 threads: a layout reordered for 64 rows runs M = 4 .. 512 at
# 1.0-1.6x the GFLOP/s of a plain `to_mkldnn()` weight and 1.2-3x the bmm split; hints
# of 16 or 512 do as well, a hint of 1 is worse everywhere.
PACK_HINT_ROWS = 64


# A few rows (decode of 1-4 sequences) make a matrix-vector product bound by streaming the
# weight from DRAM: csrc/skinny_gemm.cpp reads the plain weight faster than oneDNN's packed
# GEMM. All of SmolLM2's linears, 2 threads, weights out of cache, AVX512-BF16 Zen 4:
#   rows          1      2      3      4
#   fp32 skinny  19.8   21.0   22.5   24.4 ms     oneDNN 25.0   26.9   22.3   21.6 ms
#   bf16 skinny  13.2   14.3   16.2   18.1 ms     oneDNN 15.3   15.9   15.7   15.0 ms
# and on an Intel Xeon (AMX), with the skinny kernel's prefetch two tiles ahead:
#   fp32 skinny   -      -     27.3   29.6 ms     oneDNN  -      -     37.1   34.8 ms
#   bf16 skinny   -      -     16.3   17.3 ms     oneDNN  -      -     20.1   20.4 ms
# Up to 4 rows the skinny GEMM also lets the step run as one decode_stack call (~4 ms less
# per-op cost at SmolLM2's size), which outweighs Zen 4's 3 ms oneDNN lead at 4 rows.
SKINNY_KERNEL_ROWS = 4
SKINNY_DTYPES = (torch.float32, torch.bfloat16)


# Decode batches of a few dozen rows: csrc/small_gemm.cpp streams the plain weight once while
# computing all rows from registers, where oneDNN's packed GEMM pays for the weight stream and
# the FLOPs one after the other. All of SmolLM2-135M's decoder linears, 2 threads, weights
# out of cache, Intel Xeon (AVX-512; the AVX2 row: kernel built without AVX-512, oneDNN
# limited with ONEDNN_MAX_CPU_ISA=AVX2):
#   rows                     8     12    16    24    32    48    64
#   small / oneDNN AVX-512  1.01x 1.10x 1.18x 1.16x 1.34x 1.41x 1.29x
#   small / oneDNN AVX2     1.61x 1.54x 1.71x 1.17x 1.42x 1.28x 1.22x
# (80 rows: 0.91x), and the lm_head (49152 x 576) 1.03x at 16 rows to 1.27x at 48. Fewer rows
# stay on the skinny kernel / oneDNN, more on oneDNN. float32 weights only: bf16 weights keep
# oneDNN, which runs them on AMX / AVX512-BF16. KVMESH_SMALL_GEMM=0 turns it off.
SMALL_GEMM = os.environ.get("KVMESH_SMALL_GEMM", "1") != "0"
SMALL_GEMM_ROWS = (8, 64)


# Kinds of linear layer csrc/decode_stack.cpp runs (see `stack_linear`): a float32 weight,
# or kvmesh's int8 / int4 (zero points or GGUF Q4_1 mins) weight-only quantized kernels.
STACK_DENSE, STACK_INT8, STACK_INT4, STACK_INT4_MINS = 0, 1, 2, 3


def onednn_usable(weight: torch.Tensor) -> bool:
    """Whether `Linear` runs its GEMMs through oneDNN with a packed weight."""
    return _ONEDNN and weight.device.type == "cpu" and weight.dtype in _ONEDNN_DTYPES


class Linear(torch.nn.Linear):
    """nn.Linear (same parameters and state dict) whose CPU forward runs the skinny kernel for
    a few rows, the small-batch kernel for a few dozen (fp32), else oneDNN on a reordered copy
    of the weight, or `linear` above where oneDNN does not serve the dtype."""

    _packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[0] <= SKINNY_KERNEL_ROWS and self.weight.dtype in SKINNY_DTYPES
                and x.dtype == self.weight.dtype and cpu_kernels.fused(x)):
            return torch.ops.kvmesh.skinny_linear(x, self.weight, self.bias)
        if (SMALL_GEMM and x.dim() == 2 and SMALL_GEMM_ROWS[0] <= x.shape[0] <= SMALL_GEMM_ROWS[1]
                and self.weight.dtype == torch.float32 and x.dtype == torch.float32 and cpu_kernels.fused(x)):
            return torch.ops.kvmesh.small_linear(x, self.weight, self.bias)
        if x.dim() == 2 and onednn_usable(self.weight):
            self.prepack()
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)

    def prepack(self) -> None:
        """Reorder the weight for oneDNN's packed GEMM if it has none yet (a no-op where oneDNN
        does not serve this weight). The model runner calls it for every layer at start-up:
        decode batches up to SMALL_GEMM_ROWS[1] rows never reach oneDNN, so the reorder used to
        land on the first prompt longer than that, ~2 s for SmolLM2-135M that a server's first
        long request waited for (and every request queued behind it)."""
        if self._packed is None and onednn_usable(self.weight):
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_HINT_ROWS)

    def stack_linear(self) -> tuple[int, list[torch.Tensor], int] | None:
        """How csrc/decode_stack.cpp runs this layer for up to SKINNY_KERNEL_ROWS rows:
        (kind, tensors, kernel address), or None where it cannot. A float32 / bf16 weight
        runs the skinny GEMM, as `forward` does for those rows."""
        if self.weight.dtype not in SKINNY_DTYPES or self.weight.device.type != "cpu":
            return None
        return STACK_DENSE, [self.weight], 0

    def _apply(self, fn, recurse: bool = True):
        self._packed = None  # moved or cast: repack from the new weight on first use
        return super()._apply(fn, recurse)

    def invalidate(self) -> None:
        """Drop the reordered weight after editing `weight` in place."""
        self._packed = None


def prepack_linears(model: torch.nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> None:
    """`Linear.prepack` every layer of `model` (see there) but those named in `skip`: the
    output head gets one row per sequence (the skinny / small-batch GEMMs up to 64), so a
    packed copy of it (113 MB for SmolLM2-135M) would sit unused; a step that needs more rows
    (prompt logprobs) packs it then."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] not in skip:
            module.prepack()
