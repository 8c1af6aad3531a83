"""Quantize / dequantize primitives: plain functions on tensors, no modules.

Two weight formats, both laid out row-major over the output dim so that a fused
projection (qkv, gate_up) is just its shards' rows concatenated:

int8, symmetric, per output channel or per group of G consecutive input columns::

    w[o, i] ~= q[o, i] * s[o]                q int8 in [-127, 127], s float32 (out,)
    w[o, i] ~= q[o, i] * s[o, i // G]        grouped: s float32 (out, in / G) (GGUF Q8_0, G = 32)

int4, groups of G consecutive input columns, asymmetric, in one of two forms::

    w[o, i] ~= (q[o, i] - z[o, g]) * s[o, g]  g = i // G, q in [0, 15]   ("zeros")
    w[o, i] ~= q[o, i] * s[o, g] + m[o, g]                                ("mins", GGUF Q4_1)

`z` is the zero point in quantization steps. It is an integer for GPTQ / AWQ
checkpoints (so they convert exactly) and fractional for kvmesh's own min/max
quantizer (`z = -min / s`, which puts the group's min and max exactly on the grid
ends 0 and 15). `m` is the group's additive minimum, stored as is by GGUF Q4_1
(`-z * s` is not a float16 in general, so Q4_1 keeps its own form to load exactly).
`s`, `z` and `m` are stored as float16, as GPTQ / AWQ / GGUF do.

Packed int4 on disk and at run time: uint8 (out, in / 2), the low nibble holds the
even column, the high nibble the odd one.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)
# Smallest scale: a constant group (max == min) still gets a finite, nonzero step.
_MIN_SCALE = 1e-8


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (q int8 (out, in), scales float32 (out,))."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=_MIN_SCALE)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (out, in) int8 + scales (out,) or (out, in / G) -> (out, in) float."""
    if scales.dim() == 1:
        return (q.to(torch.float32) * scales.float()[:, None]).to(dtype)
    out_f, in_f = q.shape
    g = q.reshape(out_f, scales.shape[1], -1).to(torch.float32) * scales.float()[..., None]
    return g.reshape(out_f, in_f).to(dtype)


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size: {group_size} is not supported; use one of {list(INT4_GROUP_SIZES)}")
    if in_features % group_size:
        raise ValueError(
            f"group_size: {group_size} does not divide in_features={in_features}; pick a group size "
            f"that does ({[g for g in INT4_GROUP_SIZES if in_features % g == 0] or 'none fits'})"
        )


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float -> (q uint8 (out, in) in [0, 15], scales fp16 (out, G), zeros fp16 (out, G)).

    Min/max asymmetric per group. q is computed from the float16-rounded scale and
    zero that are stored, so dequantize(quantize(w)) is what the kernels compute.
    """
    out_f, in_f = w.shape
    check_group_size(in_f, group_size)
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = ((hi - lo) / 15.0).clamp(min=_MIN_SCALE).to(torch.float16)
    s = scales.float()
    zeros = (-lo / s).to(torch.float16)
    q = torch.round(g / s[..., None] + zeros.float()[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).reshape(out_f, in_f), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    dtype: torch.dtype = torch.float32, mins: bool = False) -> torch.Tensor:
    """Unpacked q (out, in) uint8 + per-group params -> (out, in) float.

    `offsets` are zero points z (w = (q - z) * s), or with `mins` the minima m of
    GGUF Q4_1 (w = q * s + m).
    """
    out_f, in_f = q.shape
    groups = scales.shape[1]
    g = q.reshape(out_f, groups, in_f // groups).float()
    s, o = scales.float()[..., None], offsets.float()[..., None]
    w = g * s + o if mins else (g - o) * s
    return w.reshape(out_f, in_f).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values in [0, 15] -> uint8 (out, in / 2): column 2j low nibble, 2j+1 high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 (out, in / 2) -> uint8 (out, in)."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def tinygemm_scale_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Our (s, z) as the (G, out, 2) tensor of PyTorch's int4 mm kernels.

    Those kernels compute w = (q - 8) * s + zf, so zf = (8 - z) * s. Computed in
    float32: for integer z (GPTQ / AWQ) both products are exact, hence so is w.
    """
    s = scales.float()
    zf = (8.0 - zeros.float()) * s
    return torch.stack((s, zf), dim=-1).transpose(0, 1).contiguous().to(dtype)
