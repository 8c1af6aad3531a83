"""Checkpoint formats of quantized weights, converted to kvmesh's own per-module tensors.

A quantized linear layer `P` (an HF module path such as
`model.layers.0.self_attn.q_proj`) is stored as `P.<suffix>` tensors. Each format
turns one module's tensors into kvmesh's canonical ones (see primitives.py):

- int8: `qweight` int8 (out, in), `scales` (out,) or (out, in / G)
- int4: `qweight` uint8 (out, in / 2) packed nibbles, `scales` and `zeros` (or
  `mins`, GGUF Q4_1's form) fp16 (out, in / G), and `perm` int64 (in,) when the checkpoint's groups are not
  consecutive input columns (GPTQ act-order, `desc_act`): the module then reads
  its input as `x[:, perm]`.

Formats:

- `kvmesh` (written by `kvmesh quantize`, and the tensor stream of the GGUF reader,
  gguf.py): already canonical.
- `gptq` (AutoGPTQ / GPTQModel / optimum, 4 bit): `qweight` int32 (in / 8, out),
  eight inputs per int32, input 8r+k in bits 4k..4k+3 of row r; `qzeros` int32
  (groups, out / 8) packed the same way along the output dim; `scales` fp16
  (groups, out); `g_idx` int32 (in,) the group of each input. The v1 format
  (checkpoint_format "gptq", the default) stores `zero - 1`; AutoGPTQ adds the 1
  back at load, and so do we (a zero of 0 thus reads back as 16, as in AutoGPTQ).
  w[o, i] = scales[g_idx[i], o] * (q[i, o] - z[g_idx[i], o]).
- `awq` (AutoAWQ GEMM, 4 bit): `qweight` int32 (in, out / 8) packed along the
  output dim in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble k holds
  column 8c + order[k]); `qzeros` int32 (groups, out / 8) same packing, no offset;
  `scales` fp16 (groups, out). w[o, i] = scales[g, o] * (q[i, o] - z[g, o]).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvmesh.quant.primitives import pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# AWQ_REVERSE[j] = the nibble that holds column 8c + j.
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 (r, c) holding 8 nibbles each -> uint8 (r * 8, c): nibble k of row r -> row 8r + k."""
    nib = (packed.to(torch.int32)[:, None, :] >> _SHIFTS[None, :, None]) & 0xF  # (r, 8, c)
    return nib.reshape(packed.shape[0] * 8, packed.shape[1]).to(torch.uint8)


def unpack_int32_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 (r, c) holding 8 nibbles each -> uint8 (r, c * 8): nibble k of col c -> col 8c + k."""
    nib = (packed.to(torch.int32)[:, :, None] >> _SHIFTS[None, None, :]) & 0xF  # (r, c, 8)
    return nib.reshape(packed.shape[0], packed.shape[1] * 8).to(torch.uint8)


class CheckpointFormat(ABC):
    """Reads one quantized module's tensors (by suffix) into canonical kvmesh tensors."""

    name: str
    #: Suffixes that mark a tensor as part of a quantized module.
    suffixes: frozenset[str]

    @abstractmethod
    def scheme(self, suffixes: set[str]) -> str:
        """"int8" or "int4" for a module whose checkpoint tensors have these suffixes."""

    @abstractmethod
    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical tensors for one module; raises ValueError naming what is wrong."""


class KVMeshFormat(CheckpointFormat):
    name = "kvmesh"
    suffixes = frozenset({"qweight", "scales", "zeros", "mins"})

    def scheme(self, suffixes: set[str]) -> str:
        return "int4" if suffixes & {"zeros", "mins"} else "int8"

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        need = {"qweight", "scales"} | ({"zeros", "mins"} & tensors.keys())
        _require(module, tensors, need)
        return {k: tensors[k] for k in need}


class GPTQFormat(CheckpointFormat):
    name = "gptq"
    suffixes = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, group_size: int, zero_offset: int = 1):
        self.group_size = group_size
        self.zero_offset = zero_offset

    def scheme(self, suffixes: set[str]) -> str:
        return "int4"

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _require(module, tensors, {"qweight", "qzeros", "scales"})
        q = unpack_int32_rows(tensors["qweight"]).t()  # (out, in)
        out_f, in_f = q.shape
        z = unpack_int32_cols(tensors["qzeros"]).to(torch.int16) + self.zero_offset  # (groups, out)
        scales = tensors["scales"]
        group = in_f if self.group_size == -1 else self.group_size
        groups = in_f // group
        if scales.shape != (groups, out_f) or z.shape[0] != groups or z.shape[1] < out_f:
            raise ValueError(
                f"{module}: GPTQ tensors disagree with quantization_config.group_size={self.group_size}: "
                f"qweight is {in_f}x{out_f}, scales {tuple(scales.shape)}, qzeros {tuple(tensors['qzeros'].shape)}"
            )
        out = {"scales": scales.t().to(torch.float16).contiguous(),
               "zeros": z[:, :out_f].t().to(torch.float16).contiguous()}
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int64)
            if not torch.equal(g_idx, torch.arange(in_f) // group):
                # Act-order: inputs of one group are scattered. Sort inputs by group so
                # groups become consecutive columns, and permute x the same way at run time.
                perm = torch.argsort(g_idx, stable=True)
                counts = torch.bincount(g_idx, minlength=groups)
                if counts.numel() != groups or not bool((counts == group).all()):
                    raise ValueError(f"{module}: g_idx does not assign {group} inputs to each of {groups} groups")
                q = q[:, perm]
                out["perm"] = perm
        out["qweight"] = pack_int4(q.contiguous())
        return out


class AWQFormat(CheckpointFormat):
    name = "awq"
    suffixes = frozenset({"qweight", "qzeros", "scales"})

    def __init__(self, group_size: int):
        self.group_size = group_size

    def scheme(self, suffixes: set[str]) -> str:
        return "int4"

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _require(module, tensors, {"qweight", "qzeros", "scales"})
        reverse = torch.tensor(AWQ_REVERSE)
        q = unpack_int32_cols(tensors["qweight"])  # (in, out), columns in AWQ order
        in_f, out_f = q.shape
        q = q.view(in_f, out_f // 8, 8)[:, :, reverse].reshape(in_f, out_f)
        z = unpack_int32_cols(tensors["qzeros"])
        z = z.view(z.shape[0], -1, 8)[:, :, reverse].reshape(z.shape[0], -1)
        scales = tensors["scales"]
        groups = in_f // self.group_size
        if scales.shape != (groups, out_f) or z.shape != (groups, out_f):
            raise ValueError(
                f"{module}: AWQ tensors disagree with quantization_config.group_size={self.group_size}: "
                f"qweight unpacks to {in_f}x{out_f}, scales {tuple(scales.shape)}, zeros {tuple(z.shape)}"
            )
        return {"qweight": pack_int4(q.t().contiguous()),
                "scales": scales.t().to(torch.float16).contiguous(),
                "zeros": z.t().to(torch.float16).contiguous()}


def _require(module: str, tensors: dict[str, torch.Tensor], names: set[str]) -> None:
    missing = sorted(names - tensors.keys())
    if missing:
        raise ValueError(f"checkpoint: quantized module {module} lacks tensors {missing}")


def format_from_config(qc: dict[str, Any]) -> CheckpointFormat:
    """The reader for a config.json `quantization_config`; errors name the field to change."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "kvmesh":
        return KVMeshFormat()
    if method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config.bits: {bits} is not supported; kvmesh loads 4-bit {method} checkpoints")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if method == "gptq":
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not supported; "
                                 "use 'gptq' (v1) or 'gptq_v2'")
            return GPTQFormat(group, zero_offset=1 if fmt == "gptq" else 0)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: AWQ {version!r} layout is not supported; use 'gemm'")
        if qc.get("zero_point", True) is False:
            raise ValueError("quantization_config.zero_point: AWQ without zero points is not supported")
        return AWQFormat(group)
    raise ValueError(
        f"quantization_config.quant_method: {method!r} is not supported; kvmesh loads 'kvmesh', 'gptq' and 'awq'"
    )
