"""Weight-only int8 / int4 matmuls in Triton for decode-sized inputs on CUDA.

y = x @ dequant(W)^T with the weight dequantized tile by tile in registers: each weight
byte is read once from device memory (int8: 1 byte, int4: half a byte plus fp16 scales
per group), which is where quantized decode saves time on a bandwidth-bound GPU. Formats
are those of primitives.py (row-major over the output dim; int4 packed two per byte, low
nibble = even column; scales float32 per row or per group for int8, fp16 per group for
int4 with zero points or GGUF minima).

The dequantized tile is rounded to the activation dtype before the dot, as the
`dequant` path (dequantize, then matmul) does; accumulation is float32.
"""

from __future__ import annotations

import torch

from kvmesh.layers.triton_runtime import AVAILABLE, INTERPRET, dot, tl, to_dtype, triton

# Rows up to which these kernels serve (decode / small verify batches); taller inputs
# dequantize once and use cuBLAS, which is compute-bound there.
MAX_ROWS = 64
BLOCK_N = 64
BLOCK_K = 64


def can_run(x: torch.Tensor) -> bool:
    if not AVAILABLE:
        return False
    return (x.is_cuda and not INTERPRET) or (INTERPRET and x.device.type == "cpu")


if triton is not None:

    @triton.jit
    def _wq_gemm(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, G, stride_xm, stride_qn, stride_sn, stride_ym,
                 INT4: tl.constexpr, MINS: tl.constexpr, GROUPED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mm = rm < M
        nm = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            km = rk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            wmask = nm[:, None] & km[None, :]
            if INT4:
                packed = tl.load(q_ptr + rn[:, None] * stride_qn + (rk // 2)[None, :], mask=wmask, other=0)
                q = ((packed.to(tl.int32) >> ((rk % 2) * 4)[None, :]) & 0xF).to(tl.float32)
            else:
                q = tl.load(q_ptr + rn[:, None] * stride_qn + rk[None, :], mask=wmask, other=0).to(tl.float32)
            if GROUPED:
                sidx = rn[:, None] * stride_sn + (rk // G)[None, :]
                s = tl.load(s_ptr + sidx, mask=wmask, other=0.0).to(tl.float32)
            else:
                s = tl.load(s_ptr + rn, mask=nm, other=0.0).to(tl.float32)[:, None]
            if INT4:
                off = tl.load(o_ptr + sidx, mask=wmask, other=0.0).to(tl.float32)
                if MINS:
                    w = q * s + off
                else:
                    w = (q - off) * s
            else:
                w = q * s
            w = to_dtype(w, x_ptr.dtype.element_ty)  # (BLOCK_N, BLOCK_K)
            acc += dot(x, tl.trans(w), IEEE)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], to_dtype(acc, y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


def _launch(x, qweight, scales, offsets, int4: bool, mins: bool, n: int) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    grouped = int4 or scales.dim() == 2
    g = k // scales.shape[1] if grouped else k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    grid = (-(-m // block_m), -(-n // BLOCK_N))
    _wq_gemm[grid](x, qweight, scales, offsets if offsets is not None else scales, y, m, n, k, g,
                   x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                   INT4=int4, MINS=mins, GROUPED=grouped, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                   IEEE=x.dtype == torch.float32)
    return y


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K), qweight int8 (N, K), scales float32 (N,) or (N, K / G) -> (M, N) in x.dtype."""
    return _launch(x, qweight, scales.contiguous(), None, False, False, qweight.shape[0])


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                mins: bool = False) -> torch.Tensor:
    """x (M, K), qweight packed uint8 (N, K / 2), scales / offsets fp16 (N, K / G) -> (M, N)."""
    return _launch(x, qweight, scales.contiguous(), offsets.contiguous(), True, mins, qweight.shape[0])
