"""The batched multi-LoRA delta in Triton: a shrink and an expand kernel (punica's SGMV).

    shrink:  h[t, l] = x[t] @ a[l, s]^T                     (T, L, R) fp32; grid (segment, M tile, shard)
    expand:  y[t, off_l:off_l+1] += h[t, l] @ b[s, :, off_l:off_l+1]   grid (segment, M tile, N tile),
             one launch per shard

Layouts and numerics are lora_kernels.py's (b rank-major (S, R, N), h in fp32, y rounded once).
The grid is sized from T, never from the segments' lengths (no host sync, so the launches can
be captured in a CUDA graph): a program whose M tile lies past its segment's end, or whose
segment runs the base model (slot < 0), returns at once. Ranks are padded to BLOCK_R >= 16
(tl.dot's minimum), one tile: R <= 64. Call through lora_kernels.lora_sgmv_triton, which
checks the arguments.
"""

from __future__ import annotations

import torch

from kvmesh.layers.triton_runtime import dot, next_pow2, tl, to_dtype, triton

if triton is not None:

    @triton.jit
    def _shrink(x_ptr, a_ptr, h_ptr, starts_ptr, lens_ptr, slots_ptr, K, R,
                stride_xm, stride_al, stride_as, stride_ar, stride_hm,
                IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # h[rows, l, :R] = x[rows] @ a[l, slot, :R]^T for the BLOCK_M rows of tile pid_m of segment seg
        seg = tl.program_id(0)
        pid_m = tl.program_id(1)
        shard = tl.program_id(2).to(tl.int64)
        slot = tl.load(slots_ptr + seg).to(tl.int64)
        length = tl.load(lens_ptr + seg)
        if (slot < 0) | (pid_m * BLOCK_M >= length):
            return
        start = tl.load(starts_ptr + seg).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < length
        rows = start + offs_m
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        x_base = x_ptr + rows[:, None] * stride_xm
        a_base = a_ptr + shard * stride_al + slot * stride_as + offs_r[None, :] * stride_ar
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            xt = tl.load(x_base + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_base + kk[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            acc += dot(xt, at, IEEE)
        h = h_ptr + rows[:, None] * stride_hm + shard * R + offs_r[None, :]
        tl.store(h, acc, mask=m_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _expand(h_ptr, b_ptr, y_ptr, starts_ptr, lens_ptr, slots_ptr, col0, N_l, R,
                stride_hm, stride_bs, stride_br, stride_ym,
                IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        # y[rows, col0 + n] += h[rows, :R] @ b[slot, :R, col0 + n] for the tile's n < N_l
        seg = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(2)
        slot = tl.load(slots_ptr + seg).to(tl.int64)
        length = tl.load(lens_ptr + seg)
        if (slot < 0) | (pid_m * BLOCK_M >= length):
            return
        start = tl.load(starts_ptr + seg).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < length
        rows = start + offs_m
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_l
        cols = col0 + offs_n
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        h = tl.load(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :],
                    other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + cols[None, :],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        delta = dot(h, bt, IEEE)
        mask = m_ok[:, None] & n_ok[None, :]
        y = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        acc = tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta
        tl.store(y, to_dtype(acc, y_ptr.dtype.element_ty), mask=mask)


def block_m_for(num_rows: int) -> int:
    """Rows per tile: 16 for decode-sized steps, 64 for prefill."""
    return 16 if num_rows <= 256 else 64


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
         seg_lens: torch.Tensor, seg_slots: torch.Tensor, offsets: list[int]) -> None:
    """y += the LoRA delta in place; arguments already checked (lora_kernels.check_args)."""
    t, k = x.shape
    num_segments, (num_shards, _, r, _) = seg_slots.numel(), a.shape
    if t == 0 or num_segments == 0 or r == 0:
        return
    if r > 64:
        raise ValueError(f"lora_sgmv (triton): rank {r} > 64")
    x, a, b = (v if v.stride(-1) == 1 else v.contiguous() for v in (x, a, b))
    starts, lens, slots = (v.contiguous() for v in (seg_starts, seg_lens, seg_slots))
    h = torch.empty((t, num_shards * r), dtype=torch.float32, device=x.device)
    block_m, block_r = block_m_for(t), max(16, next_pow2(r))
    block_k = min(64, max(16, next_pow2(k)))
    ieee = y.dtype == torch.float32  # bf16 models: TF32 products (bf16's b is exact in TF32)
    m_tiles = triton.cdiv(t, block_m)
    _shrink[(num_segments, m_tiles, num_shards)](
        x, a, h, starts, lens, slots, k, r, x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
        IEEE=ieee, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k)
    for shard, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if hi == lo:
            continue
        block_n = min(64, max(16, next_pow2(hi - lo)))
        _expand[(num_segments, m_tiles, triton.cdiv(hi - lo, block_n))](
            h[:, shard * r:], b, y, starts, lens, slots, lo, hi - lo, r,
            h.stride(0), b.stride(0), b.stride(1), y.stride(0),
            IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
