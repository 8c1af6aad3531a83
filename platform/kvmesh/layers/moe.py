"""Mixture-of-Experts feed-forward (Mixtral, Qwen3-MoE): route each token to its top-k
experts, run each expert's gated MLP silu(x Wg^T) * (x Wu^T) Wd^T on its tokens, sum the
outputs weighted by the routing probabilities.

Parameters, as transformers 5.x holds them in memory:
    w13 (E, 2I, H)   per expert the gate rows [0, I) then the up rows [I, 2I)
    w2  (E, H, I)    per expert the down projection
The router gate (a plain `Linear(H, E)`) belongs to the model: `forward` takes its logits.

Routing (`route`, transformers' MixtralTopKRouter / Qwen3MoeTopKRouter op for op):
softmax over all E experts in float32, top-k, divided by the top-k sum when `renormalize`
(Mixtral always, Qwen3-MoE when `norm_topk_prob`), cast to the logits' dtype.

Backends (bound at construction, layers/op.py):
- torch: the reference, transformers' loop over the experts that got a token;
- cpu: the (token, expert) pairs sorted by expert once, so each active expert's tokens are
  one contiguous block of rows: one GEMM pair per active expert on the native GEMMs a dense
  Linear uses for that many rows (skinny <= 4 rows, small-batch up to 64 float32 rows, else
  the weight-split bmm on the plain weight: a oneDNN packed copy of every expert would
  double the experts' memory, the bulk of an MoE model), outputs weighted and scattered
  back with one index_add;
- triton: layers/triton_moe.py, the grouped GEMM over tokens sorted and padded per expert.

Tensor parallel (OpContext.tp, world size 1 by default): each rank holds I / tp of every
expert's intermediate columns (w13 rows, w2 columns) and the outputs are all-reduced, as
vLLM shards experts without expert parallelism.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.layers import triton_moe
from kvmesh.layers.linear import SKINNY_DTYPES, SKINNY_KERNEL_ROWS, SMALL_GEMM_ROWS, split_linear
from kvmesh.layers.op import CustomOp, OpContext, fast_paths_changed

SHARDS = ("gate", "up", "down", "gate_up")

# Checkpoint names of expert weights -> shard: per expert (Mixtral w1 / w3 / w2 and
# Qwen3-MoE gate / up / down projections) or fused over experts (transformers 5.x).
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(\.weight)?$")
_PROJ_SHARD = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
               "down_proj": "down", "gate_up_proj": "gate_up"}


def expert_tensor(name: str) -> tuple[str, int | None, str] | None:
    """(experts module path, expert id or None for all experts, shard) for a checkpoint tensor
    name of an expert weight, else None. `model.layers.3.mlp.experts.5.up_proj.weight` ->
    ("model.layers.3.mlp.experts", 5, "up"); `...experts.gate_up_proj` -> (..., None, "gate_up")."""
    m = _PER_EXPERT.match(name)
    if m:
        return m["prefix"], int(m["e"]), _PROJ_SHARD[m["proj"]]
    m = _FUSED.match(name)
    if m:
        return m["prefix"], None, _PROJ_SHARD[m["proj"]]
    return None


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) -> (weights (T, k) in `dtype` (default: the logits'), expert ids
    (T, k) int64).

    transformers' order: softmax in float32 over all experts, top-k (ties: topk's order),
    divide by the top-k sum in float32, then cast. (Mixtral's own block keeps the weights in
    float32 and multiplies bf16 expert outputs by them; at float32 the two are the same.)"""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype or router_logits.dtype), ids


Expert = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                    expert: Expert) -> torch.Tensor:
    """sum_j weights[t, j] * expert(ids[t, j], x[t]) for x (T, H), weights / ids (T, k) -> (T, H).

    The T k (token, expert) pairs are sorted by expert once (stable: within an expert, token
    order), so expert e's rows are one contiguous block of the gathered input and `expert(e,
    rows)` runs once per active expert. The weighted outputs are scattered back by one
    index_add in sorted order, i.e. each token's contributions are summed in ascending expert
    id, the order of transformers' loop (same float sums). One token (batch-1 decode) skips
    the sort and scatter: its k outputs are weighted and summed directly."""
    t, k = ids.shape
    if t == 1:  # decode of one sequence: k experts of one row each, no grouping to do
        ys = torch.cat([expert(e, x) for e in ids[0].tolist()])  # (k, H)
        return (ys * weights.reshape(k, 1)).sum(dim=0, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (T k,) pair index, grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync
    tokens = order // k
    xs = x.index_select(0, tokens)  # (T k, H)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = expert(e, xs[start:start + n])
            start += n
    ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def gemm_rows(ctx: OpContext) -> tuple[int, int]:
    """(skinny, small): expert groups of up to `skinny` rows take the skinny kernel, up to
    `small` the small-batch one (0: not at all), as layers/linear.py chooses for a dense
    Linear minus oneDNN (it needs a packed copy of the weight; the small-batch GEMM also takes
    5-7 rows here, where a Linear goes to oneDNN)."""
    native, dtype = ctx.native, ctx.dtype
    skinny = SKINNY_KERNEL_ROWS if native and dtype in SKINNY_DTYPES else 0
    small = SMALL_GEMM_ROWS[1] if native and ctx.kernels.small_gemm and dtype == torch.float32 else 0
    return skinny, small


def cpu_gemm(ctx: OpContext) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """y = x @ w.T on CPU for `ctx`'s dtype, the kernel chosen by the row count (gemm_rows)."""
    skinny, small = gemm_rows(ctx)
    dtype = ctx.dtype
    skinny_op = torch.ops.kvmesh.skinny_linear if skinny else None
    small_op = torch.ops.kvmesh.small_linear if small else None

    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m <= skinny:
            return skinny_op(x, w, None)
        if m <= small:
            return small_op(x, w, None)
        if dtype != torch.float32:
            # bf16 / fp16: F.linear (oneDNN's reduced-precision GEMM; native bf16 dot products
            # on AVX512-BF16 / AMX), 1.4x split_linear's bmm on Mixtral's 32-row groups here
            return F.linear(x, w)
        return split_linear(x, w)

    return gemm


def silu_and_mul_fn(ctx: OpContext) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated activation (T, 2I) -> (T, I) for `ctx`: the native op where it serves."""
    if ctx.native:
        return torch.ops.kvmesh.silu_and_mul

    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    return silu_and_mul


class FusedMoE(CustomOp):
    """The experts of a sparse MoE block: forward(x (T, H), router_logits (T, E)) -> (T, H).
    `intermediate_size` is one expert's (the full one; this rank holds I / tp of it)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, ctx: OpContext | None = None):
        super().__init__(ctx)
        tp = self.ctx.tp
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
        if intermediate_size % tp.size:
            raise ValueError(f"intermediate_size ({intermediate_size}) is not divisible by the tensor "
                             f"parallel size {tp.size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = i = intermediate_size // tp.size
        dtype = self.ctx.dtype
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i, dtype=dtype))
        if not self.w13.is_meta:  # (as VocabParallelEmbedding: normal_ on meta imports torch._dynamo)
            nn.init.normal_(self.w13, std=hidden_size ** -0.5)
            nn.init.normal_(self.w2, std=intermediate_size ** -0.5)
        self.bind()

    def bind(self) -> None:
        super().bind()
        self._gemm = cpu_gemm(self.ctx)
        self._rows = gemm_rows(self.ctx)
        self._act = silu_and_mul_fn(self.ctx)
        self._reduce = self.ctx.tp.size > 1

    # -- forwards -------------------------------------------------------------

    def forward_torch(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            gate, up = F.linear(x[token], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return self._all_reduce(out)

    def forward_cpu(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """`grouped_experts` on the native GEMMs, the loop over experts in C++ (csrc/moe.cpp):
        the same kernels per group without four interpreted ops per active expert (a
        Qwen3-MoE-shaped layer, 32 experts: 1.77 vs 2.26 ms at 8 tokens, 3.02 vs 3.66 at 32).
        One token keeps the Python path, which skips the sort (0.27 vs 0.68 ms)."""
        if x.shape[0] == 1:
            return self.forward_cpu_loop(x, router_logits)
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        out = torch.ops.kvmesh.moe_experts(x, weights, ids, self.w13, self.w2, *self._rows)
        return self._all_reduce(out)

    def forward_cpu_loop(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """forward_cpu with the loop over experts in Python (the reference for the C++ op)."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        w13, w2, gemm, act = self.w13, self.w2, self._gemm, self._act

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return gemm(act(gemm(rows, w13[e])), w2[e])

        return self._all_reduce(grouped_experts(x, weights, ids, self.num_experts, expert))

    def forward_triton(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        return self._all_reduce(triton_moe.fused_moe(x, self.w13, self.w2, weights, ids))

    def _all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        return self.ctx.tp.all_reduce(out) if self._reduce else out

    # -- weights --------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter | None, loaded: torch.Tensor, expert_id: int | None,
                      shard: str) -> None:
        """Copy a checkpoint expert weight into `param` (w13 for "gate" / "up" / "gate_up", w2
        for "down"; None: that one): this rank's slice of it. `expert_id` None: `loaded` holds
        all experts fused (E, 2I, H) / (E, H, I), else one expert's (I, H) / (H, I)."""
        if shard not in SHARDS:
            raise ValueError(f"unknown shard {shard!r}; expert weights are {SHARDS}")
        target = self.w2 if shard == "down" else self.w13
        if param is not None and param is not target:
            raise ValueError(f"shard {shard!r} belongs to {'w2' if shard == 'down' else 'w13'}")
        with torch.no_grad():
            for name, experts, start, rows, src in shard_sources(self, loaded, expert_id, shard):
                dst = getattr(self, name).data[experts].narrow(1, start, rows)
                if dst.shape != src.shape:
                    raise ValueError(f"shard {shard!r}: checkpoint {tuple(loaded.shape)} does not fit experts of "
                                     f"hidden {self.hidden_size}, intermediate {self.full_intermediate_size} "
                                     f"(model {name} {tuple(getattr(self, name).shape)})")
                dst.copy_(src)
        fast_paths_changed()

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, renormalize={self.renormalize}, "
                f"backend={self.backend}")


def shard_sources(moe, loaded: torch.Tensor, expert_id: int | None,
                  shard: str) -> list[tuple[str, slice, int, int, torch.Tensor]]:
    """Where a checkpoint expert tensor lands in `moe` (a FusedMoE or its quantized twin):
    [(param "w13" / "w2", experts, first row and rows on dim 1, source (e, rows, cols))], the
    source being this rank's slice (rows of gate / up, columns of down) of `loaded`; the
    caller checks that the source has the destination's shape."""
    if shard not in SHARDS:
        raise ValueError(f"unknown shard {shard!r}; expert weights are {SHARDS}")
    if expert_id is None:
        if loaded.dim() != 3 or loaded.shape[0] != moe.num_experts:
            raise ValueError(f"shard {shard!r}: an all-experts tensor must be ({moe.num_experts}, rows, cols), "
                             f"got {tuple(loaded.shape)}")
        experts, src = slice(None), loaded
    else:
        if not 0 <= expert_id < moe.num_experts:
            raise ValueError(f"expert id {expert_id} outside [0, {moe.num_experts})")
        if loaded.dim() != 2:
            raise ValueError(f"shard {shard!r}: one expert's tensor must be 2-D, got {tuple(loaded.shape)}")
        experts, src = slice(expert_id, expert_id + 1), loaded.unsqueeze(0)
    full, i, r = moe.full_intermediate_size, moe.intermediate_size, moe.ctx.tp.rank

    def local(t: torch.Tensor, dim: int) -> torch.Tensor:
        # this rank's I / tp of a full-size dim (other sizes pass through to the shape check)
        return t.narrow(dim, r * i, i) if t.shape[dim] == full else t

    if shard == "down":
        return [("w2", experts, 0, moe.hidden_size, local(src, 2))]
    if shard == "gate_up":
        if src.shape[1] != 2 * full:
            return [("w13", experts, 0, 2 * i, src)]  # the caller reports the shape
        return [("w13", experts, 0, i, src.narrow(1, r * i, i)),
                ("w13", experts, i, i, src.narrow(1, full + r * i, i))]
    return [("w13", experts, i if shard == "up" else 0, i, local(src, 1))]
