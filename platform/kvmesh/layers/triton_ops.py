"""Fused element-wise ops of the Llama-family decoder in Triton (the CUDA twins of
csrc/fused_ops.cpp): one launch each instead of 3 to 12 PyTorch ops.

    rms_norm(x, w, eps)             = w * to_dtype(x * rsqrt(mean(x^2) + eps))   (math in fp32)
    add_rms_norm(h, a, w, eps)      = (h + a, rms_norm(h + a, w, eps))
    rope_qkv(qkv, cos, sin, H, KVH) = (rope(q), rope(k), v) from the fused QKV projection
                                      (T, (H + 2 KVH) D); rotate-half convention (HF Llama)
    silu_and_mul(gu)                = silu(gu[:, :I]) * gu[:, I:]

Numerics follow the PyTorch reference (layers/norm.py, rotary.py, activation.py) step by
step, including its roundings to the model dtype between steps; the differences are float
summation order, FMA contraction and the hardware rsqrt / exp.

The layers bind these on CUDA, or on CPU under TRITON_INTERPRET=1 with
`KernelConfig.layer_ops="triton"` (tests: the kernels interpreted).
"""

from __future__ import annotations

import torch

from kvmesh.layers.triton_runtime import next_pow2, tl, to_dtype, triton

if triton is not None:

    @triton.jit
    def _rms_norm(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, eps,
                  N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
        if ADD:
            r = tl.load(r_ptr + row * stride_r + offs, mask=m, other=0.0)
            x = to_dtype(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * N + offs, x, mask=m)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        y = to_dtype(xf * inv, x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + offs, to_dtype(w * y, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_qk(qkv_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_c,
                 D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, NQK: tl.constexpr):
        # program (token, head) over the H + KVH rotated heads; out: (T, H + KVH, D)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        m = d < D
        base = qkv_ptr + t * stride_t + h * D
        x = tl.load(base + d, mask=m, other=0.0).to(tl.float32)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        xr = tl.load(base + partner, mask=m, other=0.0).to(tl.float32)
        rot = tl.where(d < HALF, -xr, xr)
        c = tl.load(cos_ptr + t * stride_c + d, mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_c + d, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        a = to_dtype(x * c, dt).to(tl.float32)
        b = to_dtype(rot * s, dt).to(tl.float32)
        tl.store(out_ptr + (t * NQK + h) * D + d, to_dtype(a + b, dt), mask=m)

    @triton.jit
    def _silu_and_mul(gu_ptr, out_ptr, stride_t, INNER: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < INNER
        g = tl.load(gu_ptr + t * stride_t + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * stride_t + INNER + offs, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        s = to_dtype(g / (1.0 + tl.exp(-g)), dt).to(tl.float32)
        tl.store(out_ptr + t * INNER + offs, to_dtype(s * u, dt), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, N) -> (T, N)."""
    x = _rows(x)
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        _rms_norm[(t,)](x, x, weight, out, out, x.stride(0), x.stride(0), eps, N=n, BLOCK=next_pow2(n), ADD=False)
    return out


def add_rms_norm(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + update, rms_norm(residual + update)), both (T, N)."""
    residual, update = _rows(residual), _rows(update)
    t, n = residual.shape
    total = torch.empty((t, n), dtype=residual.dtype, device=residual.device)
    out = torch.empty_like(total)
    if t:
        _rms_norm[(t,)](residual, update, weight, out, total, residual.stride(0), update.stride(0), eps,
                        N=n, BLOCK=next_pow2(n), ADD=True)
    return total, out


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
             num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (T, (H + 2 KVH) D), cos / sin (T, 1, D) -> q (T, H, D), k (T, KVH, D), v (T, KVH, D).

    q and k are views of one (T, H + KVH, D) buffer; v is a view of `qkv`."""
    qkv = _rows(qkv)
    t, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    nqk = num_heads + num_kv_heads
    cos, sin = cos.reshape(t, d), sin.reshape(t, d)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    qk = torch.empty((t, nqk, d), dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_qk[(t, nqk)](qkv, cos, sin, qk, qkv.stride(0), cos.stride(0),
                           D=d, HALF=d // 2, BLOCK_D=next_pow2(d), NQK=nqk)
    v = qkv[:, nqk * d:].view(t, num_kv_heads, d)
    return qk[:, :num_heads], qk[:, num_heads:], v


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 I) -> (T, I)."""
    gate_up = _rows(gate_up)
    t, w = gate_up.shape
    i = w // 2
    out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    block = min(next_pow2(i), 1024)
    if t:
        _silu_and_mul[(t, -(-i // block))](gate_up, out, gate_up.stride(0), INNER=i, BLOCK=block)
    return out
