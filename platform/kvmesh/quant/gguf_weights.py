"""GGUF weights kept quantized: `--quantization gguf`.

A Llama GGUF's 4- and 8-bit block types map exactly onto kvmesh's canonical quantized
tensors (primitives.py), so they are loaded as stored instead of dequantized to float:

- Q4_1, blocks of 32: fp16 `d`, fp16 `m`, 16 bytes `qs`; w = d * q + m. -> int4 g32
  with `mins` (scales = d, mins = m). Exact: d and m are copied, not recomputed.
- Q4_0, blocks of 32: fp16 `d`, 16 bytes `qs`; w = d * (q - 8). -> int4 g32 with
  `mins` = -8 d (exact).
- Q8_0, blocks of 32: fp16 `d`, 32 int8 `qs`; w = d * q. -> int8 with per-32 group
  scales (d as float32, exact).
- F32 / F16 / BF16: float tensors (norms), as usual.

In a Q4 block, byte j holds column j in its low nibble and column j + 16 in its high
one (ggml's `block_q4_0` / `block_q4_1`); we repack to kvmesh's even / odd nibbles.
Q/K rows are un-permuted exactly as the float conversion does (embedded.unpermute_rows):
a row permutation moves every per-row tensor alike.

Which GGUF: the one a checkpoint folder was converted from. For the embedded
SmolLM2-135M-Instruct that is the packaged `SmolLM2-135M-Instruct.Q4_1.gguf` (so
`kvmesh generate --quantization gguf` serves its 4-bit weights as shipped), for a folder
converted from `--model file.gguf` the file it came from; any other
folder must hold exactly one `*.gguf` beside its config.json (tokenizer and config come
from the folder, weights from the GGUF). Other GGUF types (K-quants, IQ*) are refused
with the list of supported ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvmesh.checkpoint.embedded import gguf_source, hf_tensor_name, unpermute_rows
from kvmesh.checkpoint.gguf_convert import converted_source
from kvmesh.checkpoint.gguf_header import GGUFHeader as _Header
from kvmesh.errors import ConfigError
from kvmesh.quant.primitives import pack_int4

METHOD = "gguf"
_BLOCK = 32
# GGML type name -> (kvmesh scheme or "float", bytes per block of 32)
_TYPES = {"Q4_0": ("int4", 18), "Q4_1": ("int4", 20), "Q8_0": ("int8", 34),
          "F32": ("float", None), "F16": ("float", None), "BF16": ("float", None)}


def find_gguf(path: Path) -> Path:
    """The GGUF file that `path` (a checkpoint folder) was converted from."""
    src = gguf_source(path) or converted_source(path)
    if src is not None:
        return src
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ConfigError(
            f"model.quantization: 'gguf' loads the GGUF file a checkpoint was converted from; {path} holds "
            f"{len(files)} *.gguf files (need exactly one beside config.json), and it is not the embedded model"
        )
    return files[0]


def fingerprint(path: Path) -> dict[str, Any]:
    """The model fingerprint's "quantization" entry for GGUF weights kept quantized."""
    src = find_gguf(path)
    return {"method": METHOD, "file": src.name, "size": src.stat().st_size}


def _blocks(data: np.ndarray, rows: int, nbytes: int) -> np.ndarray:
    """(rows, row bytes) uint8 -> (rows, blocks, nbytes)."""
    return np.asarray(data, dtype=np.uint8).reshape(rows, -1, nbytes)


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block: (rows, blocks) float16."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0])


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """ggml Q4 `qs` (rows, blocks, 16) -> q (rows, blocks * 32) uint8: column j low nibble, j + 16 high."""
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # (rows, blocks, 32) in column order
    return torch.from_numpy(np.ascontiguousarray(q).reshape(qs.shape[0], -1))


def convert_tensor(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> dict[str, torch.Tensor] | torch.Tensor:
    """One GGUF tensor of (row-major, HF order) `shape` -> canonical quantized tensors by
    suffix, or a float32 tensor."""
    kind, nbytes = _TYPES[type_name]
    if kind == "float":
        return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
    rows = int(np.prod(shape[:-1]))
    if len(shape) != 2 or shape[-1] % _BLOCK:
        raise ConfigError(f"model.quantization: a {type_name} tensor of shape {shape} is not a matrix of "
                          f"{_BLOCK}-column blocks")
    b = _blocks(data, rows, nbytes)
    d = _f16(b, 0)
    if type_name == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1))
        return {"qweight": q, "scales": d.float()}
    if type_name == "Q4_0":
        # As mins (m = -8 d, exact in fp16: a power-of-two multiple) so Q4_0 and Q4_1 shards of
        # one fused projection (q/k/v, gate/up) share a form.
        m = d * -8.0
        if not bool(torch.isfinite(m).all()):
            return {"qweight": pack_int4(_nibbles(b[..., 2:])), "scales": d, "zeros": torch.full_like(d, 8.0)}
        return {"qweight": pack_int4(_nibbles(b[..., 2:])), "scales": d, "mins": m}
    return {"qweight": pack_int4(_nibbles(b[..., 4:])), "scales": d, "mins": _f16(b, 2)}  # Q4_1


def _permute_rows(t: dict[str, torch.Tensor] | torch.Tensor, n_head: int):
    if isinstance(t, dict):
        return {k: torch.from_numpy(np.ascontiguousarray(unpermute_rows(v.numpy(), n_head))) for k, v in t.items()}
    return torch.from_numpy(np.ascontiguousarray(unpermute_rows(t.numpy(), n_head)))


def read_gguf(src: Path, cfg) -> tuple[dict[str, str], Iterator[tuple[str, torch.Tensor]]]:
    """(plan {HF module path: scheme} of the quantized modules, stream of HF-named tensors).

    Quantized modules stream as `P.qweight`, `P.scales`, `P.zeros` / `P.mins` (kvmesh
    format); float tensors as `P.weight`. Raises ConfigError for a GGUF that does not
    fit `cfg` or holds types kvmesh cannot keep quantized.
    """
    from gguf import GGMLQuantizationType

    header = _Header(src)
    meta = header.meta
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"model.quantization: {src.name} is a {arch!r} GGUF; 'gguf' loads llama GGUFs")
    n_head, n_kv = meta.get("llama.attention.head_count"), meta.get("llama.attention.head_count_kv")
    got = (meta.get("llama.block_count"), meta.get("llama.embedding_length"), n_head, n_kv)
    want = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads)
    if got != want:
        raise ConfigError(f"model.quantization: {src.name} (layers, hidden, heads, kv heads) = {got} does not "
                          f"match the folder's config.json {want}")
    tensors = []
    plan: dict[str, str] = {}
    for name, ttype, shape, offset in header.tensors:
        try:
            type_name = GGMLQuantizationType(ttype).name
        except ValueError:
            type_name = f"type {ttype}"
        if type_name not in _TYPES:
            raise ConfigError(f"model.quantization: {src.name} tensor {name} is {type_name}; "
                              f"'gguf' keeps {sorted(_TYPES)} (re-export the GGUF with those types)")
        hf = hf_tensor_name(name)
        if _TYPES[type_name][0] != "float":
            plan[hf.rpartition(".")[0]] = _TYPES[type_name][0]
        tensors.append((hf, type_name, shape, offset))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, type_name, shape, offset in tensors:
            out = convert_tensor(type_name, header.data(type_name, shape, offset), shape)
            if name.endswith("self_attn.q_proj.weight"):
                out = _permute_rows(out, n_head)
            elif name.endswith("self_attn.k_proj.weight"):
                out = _permute_rows(out, n_kv)
            if isinstance(out, dict):
                prefix = name.rpartition(".")[0]
                for suffix, value in out.items():
                    yield f"{prefix}.{suffix}", value
            else:
                yield name, out

    return plan, stream()
