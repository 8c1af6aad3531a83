"""The MoE experts as two grouped GEMMs in Triton, in the style of vLLM's `fused_moe`.

    align:   the T k (token, expert) pairs sorted by expert, each expert's run padded to a
             multiple of BLOCK_M with a sentinel (T k); one expert id per BLOCK_M group
             (-1: a group past the end, its programs return at once)
    gemm 1:  C1[p] = x[p // k] @ w13[e]^T             (T k, 2I), one program per (group, N tile)
    act:     A[p] = silu(C1[p, :I]) * C1[p, I:]        (triton_ops.silu_and_mul)
    gemm 2:  C2[p] = weight[p] * (A[p] @ w2[e]^T)      (T k, H), the routing weight in the epilogue
    out[t] = sum_j C2[t k + j]                         (T, H)

Pair p = t k + j is token t's j-th choice, so the sorted ids index x (p // k), the routing
weights and the outputs directly. The number of groups is bounded without a host sync:
at most min(E, T k) experts are active, each wastes fewer than BLOCK_M padded rows.

Numerics: float32 accumulation (IEEE products for float32 models), the product rounded to
the model dtype once per GEMM; the routing weight multiplies the float32 accumulator
(transformers rounds the down projection first), the k outputs are summed by torch.
"""

from __future__ import annotations

import torch

from kvmesh.layers import triton_ops
from kvmesh.layers.triton_runtime import dot, tl, to_dtype, triton

if triton is not None:

    @triton.jit
    def _grouped_gemm(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, experts_ptr, N, K, num_valid,
                      stride_am, stride_be, stride_bn, stride_cm,
                      TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # C[p, n] = (w[p] *) sum_k A[p // TOP_K, k] B[e, n, k] for the BLOCK_M pairs p of group pid_m
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(experts_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
        valid = pair < num_valid
        rows = tl.where(valid, pair // TOP_K, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_base = a_ptr + rows[:, None] * stride_am
        b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            a = tl.load(a_base + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_base + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += dot(a, b, IEEE)
        if MUL_WEIGHT:
            w = tl.load(w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        c = to_dtype(acc, c_ptr.dtype.element_ty)
        tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], c, mask=valid[:, None] & n_ok[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per group: 16 while experts get few rows each (decode), 64 for prefill."""
    return 16 if num_pairs <= 4 * num_experts else 64


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (T, k) -> (sorted pairs (P,) int32, padded with T k; expert per group (P / block_m,)
    int32, -1 past the last group). All on the ids' device, no host sync; P is an upper bound."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    groups = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    # scatter_add, not bincount: bincount reads the max id back to the host (a sync on CUDA)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat.index_select(0, order)
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts).index_select(0, expert_of)
    pos = (padded_end - padded).index_select(0, expert_of) + rank
    sorted_pairs = torch.full((groups * block_m,), n, dtype=torch.int32, device=flat.device)
    sorted_pairs[pos] = order.to(torch.int32)
    starts = torch.arange(groups, device=flat.device) * block_m
    group_expert = torch.searchsorted(padded_end, starts, right=True)
    group_expert = torch.where(starts < padded_end[-1], group_expert, -1).to(torch.int32)
    return sorted_pairs, group_expert


def _launch(a, b, c, weights, sorted_pairs, group_expert, top_k: int, block_m: int) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (group_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](a, b, c, weights if weights is not None else c, sorted_pairs, group_expert,
                        n, k, c.shape[0], a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                        TOP_K=top_k, MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """x (T, H), w13 (E, 2I, H), w2 (E, H, I), routing weights / ids (T, k) -> (T, H)."""
    t, k = ids.shape
    e, h = w13.shape[0], x.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    block_m = block_m_for(t * k, e)
    sorted_pairs, group_expert = align_block_size(ids, e, block_m)
    gate_up = torch.empty((t * k, w13.shape[1]), dtype=x.dtype, device=x.device)
    _launch(x, w13, gate_up, None, sorted_pairs, group_expert, k, block_m)
    act = triton_ops.silu_and_mul(gate_up)
    down = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    _launch(act, w2, down, weights.reshape(-1).contiguous(), sorted_pairs, group_expert, 1, block_m)
    return down.view(t, k, h).sum(dim=1)
