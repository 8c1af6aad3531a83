"""Linear layers: y = x W^T + b with a tensor-parallel layout and a hook for LoRA deltas.

Layouts (`parallel`, over `OpContext.tp`, world size 1 by default = no sharding):

- "replicated": every rank holds the whole weight.
- "column": the output features are split; rank r holds rows [r N/tp, (r+1) N/tp) of W and
  b, and its output is its slice of y (QKV, gate-up: attention heads and MLP columns stay
  rank-local).
- "row": the input features are split; rank r holds columns [r K/tp, (r+1) K/tp) and computes
  a partial product; the partials are all-reduced, then the (whole) bias is added once.
  (o_proj, down_proj: their input is the previous column-parallel layer's slice.)

`weight_loader`s copy a full checkpoint tensor's rank slice into the parameter, so model
files and checkpoints never see the sharding. `MergedColumnLinear` stacks several
projections of one input (q / k / v, gate / up), each split per rank.

CPU GEMM paths (`forward_cpu`; which ones apply is fixed at bind time from the dtype and
`KernelConfig`, only the row count is read per call):

- up to SKINNY_KERNEL_ROWS rows (decode of 1-4 sequences): the skinny GEMM on the plain
  weight (csrc/skinny_gemm.cpp), float32 / bf16;
- SMALL_GEMM_ROWS rows of a float32 layer: the small-batch GEMM (csrc/small_gemm.cpp);
- otherwise oneDNN on a copy of the weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight`, what torch.compile's mkldnn pass and vLLM's
  `onednn_mm` do: 1.2-3x the GFLOP/s of the weight-split bmm at M = 4..48, ~1.1x MKL's
  sgemm on prefill chunks here); it doubles the dense layers' weight memory (the plain
  weight stays the parameter). bf16 weights take it only on CPUs that multiply bf16
  natively (AVX512-BF16, AMX);
- where oneDNN does not serve the dtype (or `onednn_linear` is off): `split_linear`.

LoRA: `set_delta(fn)` makes the layer return `fn(x, y)` for its base output y (before the
all-reduce of a row-parallel layer: each rank adds its shard's delta). The delta stays set
while adapters come and go (layers/lora.py); it is the identity on steps without adapter
rows, so the layer keeps its decode-stack form, and the stack steps aside on steps with
them (`lora.active()`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.layers.native import native_bf16
from kvmesh.layers.op import CustomOp, OpContext, fast_paths_changed

# `split_linear`: inputs with at most this many rows split the weight's output rows (decode-shaped).
SPLIT_WEIGHT_MAJOR_ROWS = 16


def _splits(out_features: int) -> int:
    k = max(4, torch.get_num_threads())
    while k > 1 and out_features % k:
        k -= 1
    return k


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias for x (M, in), weight (out, in), the CPU GEMM where oneDNN does
    not serve the dtype: `F.linear` (one MKL sgemm) leaves a core idle for the skinny GEMMs of
    decode; splitting the weight's output rows into k zero-copy views run as one `bmm` lets
    ATen parallelize across the slices (measured 2x faster at decode sizes). For tall inputs
    the split is applied on the weight-transposed side (on par with or faster than F.linear).
    Numerics: a plain matmul's, up to summation tiling."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    m, i = x.shape
    o = weight.shape[0]
    k = _splits(o)
    if k == 1:
        return F.linear(x, weight, bias)
    w = weight.view(k, o // k, i)
    if m <= SPLIT_WEIGHT_MAJOR_ROWS:
        # (k, o/k, i) @ (k, i, m) -> (k, o/k, m) -> (o, m) -> (m, o)
        y = torch.bmm(w, x.t().unsqueeze(0).expand(k, i, m)).view(o, m).t()
    else:
        # (k, m, i) @ (k, i, o/k) -> (k, m, o/k) -> (m, k, o/k) -> (m, o)
        y = torch.bmm(x.unsqueeze(0).expand(k, m, i), w.transpose(1, 2)).transpose(0, 1).reshape(m, o)
    if bias is not None:
        y = y + bias
    return y


_ONEDNN_BUILT = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_dtypes() -> set[torch.dtype]:
    """Weight dtypes oneDNN's packed GEMM serves at every batch size: bf16 pays only where the
    CPU multiplies bf16 natively (there oneDNN does twice the fp32 FLOPs per cycle and reads
    half the bytes); elsewhere bf16 weights are widened to fp32 inside each GEMM."""
    return {torch.float32, torch.bfloat16} if native_bf16() else {torch.float32}


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
# (80 rows: 0.91x), and the lm_head (49152 x 576) 1.03x at 16 rows to 1.27x at 48. Up to 8
# rows (6 on AVX2) the op runs the skinny kernel's loop, which streams the weight faster there
# (csrc/small_gemm.cpp has the numbers); so 5-7 rows, which took oneDNN and the layer-by-layer
# loop, run it too, and the decode stack with them. Fewer rows stay on the skinny kernel, more
# on oneDNN. float32 weights only: bf16 weights keep oneDNN, which runs
# them on AMX / AVX512-BF16. KernelConfig.small_gemm=false turns it off.
SMALL_GEMM_ROWS = (5, 64)


# Kinds of linear layer csrc/decode_stack.cpp runs (see `stack_form`): a float32 / bf16
# weight, or kvmesh's int8 / int4 (zero points or GGUF Q4_1 mins) weight-only quantized GEMM.
STACK_DENSE, STACK_INT8, STACK_INT4, STACK_INT4_MINS = 0, 1, 2, 3

PARALLEL_LAYOUTS = ("replicated", "column", "row")
Delta = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _shard(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor parallel size {tp_size}")
    return size // tp_size


class Linear(CustomOp):
    """y = x W^T + b (parameters `weight` (out, in) and `bias`, as nn.Linear) with a
    tensor-parallel layout; `in_features` / `out_features` are this rank's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, ctx: OpContext | None = None,
                 parallel: str = "replicated"):
        super().__init__(ctx)
        if parallel not in PARALLEL_LAYOUTS:
            raise ValueError(f"parallel: {parallel!r} is not one of {PARALLEL_LAYOUTS}")
        tp = self.ctx.tp
        self.parallel = parallel
        self.full_in_features, self.full_out_features = in_features, out_features
        self.in_features = _shard(in_features, tp.size, "in_features") if parallel == "row" else in_features
        self.out_features = _shard(out_features, tp.size, "out_features") if parallel == "column" else out_features
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=self.ctx.dtype))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=self.ctx.dtype)) if bias else None
        # nn.Linear's initialization (free on the meta device, where loaders build models).
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self.delta: Delta | None = None
        self._packed: torch.Tensor | None = None
        self.bind()

    # -- backend --------------------------------------------------------------

    def select(self, ctx: OpContext) -> str:
        return "cpu" if ctx.device.type == "cpu" else "torch"

    def bind(self) -> None:
        super().bind()
        ctx, dtype = self.ctx, self.ctx.dtype
        native = ctx.native
        self._skinny_rows = SKINNY_KERNEL_ROWS if native and dtype in SKINNY_DTYPES else 0
        small = native and ctx.kernels.small_gemm and dtype == torch.float32
        self._small_rows = SMALL_GEMM_ROWS if small else (1, 0)
        self._onednn = (ctx.device.type == "cpu" and ctx.kernels.onednn_linear and _ONEDNN_BUILT
                        and dtype in onednn_dtypes())
        self._packed = None
        self._base = self._impl
        self._reduce = self.parallel == "row" and ctx.tp.size > 1
        if self.delta is not None or self._reduce:
            self._impl = self._forward_composed

    def set_delta(self, delta: Delta | None) -> None:
        """Add `delta(x, y)` to this layer's output (LoRA); None removes it."""
        self.delta = delta
        self.bind()

    def _forward_composed(self, x: torch.Tensor) -> torch.Tensor:
        """The base GEMM with a LoRA delta and / or a row-parallel all-reduce around it: each
        rank adds its shard's delta before the reduce, the bias is added once, after it."""
        y = self._gemm(x, None) if self._reduce else self._base(x)
        if self.delta is not None:
            y = self.delta(x, y)
        if self._reduce:
            y = self.ctx.tp.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._cpu_gemm(x, bias) if self.backend == "cpu" else F.linear(x, self.weight, bias)

    # -- forwards -------------------------------------------------------------

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self._cpu_gemm(x, self.bias)

    def _cpu_gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2:
            return self._cpu_gemm(x.reshape(-1, x.shape[-1]), bias).view(*x.shape[:-1], self.out_features)
        m = x.shape[0]
        if m <= self._skinny_rows:
            return torch.ops.kvmesh.skinny_linear(x, self.weight, bias)
        lo, hi = self._small_rows
        if lo <= m <= hi:
            return torch.ops.kvmesh.small_linear(x, self.weight, bias)
        if self._onednn:
            if self._packed is None:
                self.prepack()
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, bias, "none", [], "")
        return split_linear(x, self.weight, bias)

    # -- fast paths and weights -------------------------------------------------

    def prepack(self) -> None:
        """Reorder the weight for oneDNN's packed GEMM if it has none yet (a no-op where oneDNN
        does not serve this weight). The model runner calls it for every layer at start-up:
        decode batches up to SMALL_GEMM_ROWS[1] rows never reach oneDNN, so the reorder used to
        land on the first prompt longer than that, ~2 s for SmolLM2-135M that a server's first
        long request waited for (and every request queued behind it)."""
        if self._packed is None and self._onednn and self.weight.device.type == "cpu":
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_HINT_ROWS)

    def invalidate(self) -> None:
        """Drop the reordered weight after editing `weight` in place."""
        self._packed = None
        fast_paths_changed()

    def stack_form(self) -> tuple[int, list[torch.Tensor]] | None:
        """How csrc/decode_stack.cpp runs this layer for up to SKINNY_KERNEL_ROWS rows:
        (kind, tensors), or None where it cannot (no native kernel for the dtype). Dense
        weights run the skinny GEMM, as `forward` does; a row-parallel shard's sum and bias
        the stack does itself, as `_forward_composed` (o and down are the row-parallel
        layers). A LoRA delta does not matter here: the stack runs only steps without adapter rows."""
        if not self._skinny_rows or self.weight.device.type != "cpu":
            return None
        return STACK_DENSE, [self.weight]

    def _apply(self, fn, recurse: bool = True):
        self._packed = None  # moved or cast: repack from the new weight on first use
        fast_paths_changed()
        return super()._apply(fn, recurse)

    def local_slice(self, loaded: torch.Tensor, shard: str | None = None) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (weight or bias; a row-parallel
        layer's bias is whole: it is added once, after the reduce). Quantized loading cuts the
        float tensors with it before quantizing them (quant/loader.py)."""
        tp = self.ctx.tp
        if self.parallel == "column" and loaded.shape[0] == self.full_out_features:
            return loaded.narrow(0, tp.rank * self.out_features, self.out_features)
        if self.parallel == "row" and loaded.dim() == 2 and loaded.shape[1] == self.full_in_features:
            return loaded.narrow(1, tp.rank * self.in_features, self.in_features)
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy a full checkpoint tensor (weight or bias) into `param`: this rank's slice of it."""
        loaded = self.local_slice(loaded)
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")
        param.data.copy_(loaded)
        self.invalidate()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"parallel={self.parallel}, backend={self.backend}")


class MergedColumnLinear(Linear):
    """Several projections of the same input stacked on the output dim (q / k / v, gate / up),
    each column-split across ranks; `offsets` are this rank's (start, size) per shard.

    `replicas[name]` ranks share one slice of that projection (default 1): K / V with fewer
    KV heads than ranks are split into num_kv_heads slices, rank r holding slice
    r // (tp / num_kv_heads), so every query head finds its KV head on its own rank."""

    def __init__(self, in_features: int, out_sizes: dict[str, int], bias: bool, ctx: OpContext | None = None,
                 replicas: dict[str, int] | None = None):
        ctx = ctx or OpContext()
        tp = ctx.tp.size
        self.replicas = {name: (replicas or {}).get(name, 1) for name in out_sizes}
        locals_ = {}
        for name, size in out_sizes.items():
            reps = self.replicas[name]
            if tp % reps:
                raise ValueError(f"projection {name!r}: {reps} replicas do not divide the tensor parallel size {tp}")
            locals_[name] = _shard(size, tp // reps, f"projection {name!r}")
        super().__init__(in_features, sum(locals_.values()) * tp, bias=bias, ctx=ctx,
                         parallel="column" if tp > 1 else "replicated")
        self.full_out_features = sum(out_sizes.values())
        self.full_sizes = dict(out_sizes)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, local in locals_.items():
            self.offsets[name] = (start, local)
            start += local

    def local_slice(self, loaded: torch.Tensor, shard: str | None = None) -> torch.Tensor:
        """This rank's rows of one checkpoint projection (`shard`), or, for None, of a tensor
        storing every projection fused (Phi-3), as this layer stacks them."""
        if shard is None:
            parts = loaded.split(list(self.full_sizes.values()), dim=0)
            return torch.cat([self.local_slice(part, name) for name, part in zip(self.full_sizes, parts)])
        if shard not in self.offsets:
            raise ValueError(f"unknown shard {shard!r}; this layer has {sorted(self.offsets)}")
        size, full = self.offsets[shard][1], self.full_sizes[shard]
        if loaded.shape[0] != full:
            raise ValueError(f"shard {shard}: checkpoint has {loaded.shape[0]} rows, expected {full}")
        return loaded.narrow(0, (self.ctx.tp.rank // self.replicas[shard]) * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy one checkpoint projection (e.g. "k"), weight or bias, into its rows of the fused param."""
        if shard not in self.offsets:
            raise ValueError(f"unknown shard {shard!r}; this layer has {sorted(self.offsets)}")
        local = self.local_slice(loaded, shard)
        start, size = self.offsets[shard]
        param.data.narrow(0, start, size).copy_(local)
        self.invalidate()


def prepack_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> None:
    """`Linear.prepack` every layer of `model` (see there) but those named in `skip`: the
    output head gets one row per sequence (the skinny / small-batch GEMMs up to 64), so a
    packed copy of it (113 MB for SmolLM2-135M) would sit unused; a step that needs more rows
    (prompt logprobs) packs it then."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] not in skip:
            module.prepack()
