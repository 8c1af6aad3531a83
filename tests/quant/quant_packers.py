"""Reference packers for GPTQ / AWQ 4-bit checkpoints, written after the published
loops (AutoGPTQ `QuantLinear.pack` in qlinear_cuda_old.py, AutoAWQ
`WQLinear_GEMM.from_linear`), deliberately loop-based and independent of
kvmesh.quant.formats' vectorized unpackers, so tests check one against the other.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def random_int4_layer(out_f: int, in_f: int, group: int, seed: int, desc_act: bool = False):
    """Integer weights q (out, in) in [0, 15], zeros z (groups, out) in [0, 15], fp16 scales
    (groups, out), and g_idx (in,) (a random permutation of the groups when desc_act)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_f // group
    q = torch.randint(0, 16, (out_f, in_f), generator=g)
    z = torch.randint(0, 16, (groups, out_f), generator=g)
    s = (torch.rand(groups, out_f, generator=g) * 0.02 + 0.005).half()
    g_idx = torch.arange(in_f) // group
    if desc_act:
        g_idx = g_idx[torch.randperm(in_f, generator=g)]
    return q, z, s, g_idx


def dequant_reference(q, z, s, g_idx) -> torch.Tensor:
    """w[o, i] = s[g_idx[i], o] * (q[o, i] - z[g_idx[i], o]) in float32: (out, in)."""
    return (s.float()[g_idx].t() * (q.float() - z.float()[g_idx].t()))


def pack_gptq(q, z, s, g_idx, v1: bool = True) -> dict[str, torch.Tensor]:
    intweight = q.t().contiguous().numpy().astype(np.uint32)  # (in, out)
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    zeros = (z - 1 if v1 else z).numpy().astype(np.uint32) & 0xF  # v1 stores zero - 1 (0 wraps to 15)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return {"qweight": torch.from_numpy(qweight.astype(np.int32)), "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
            "scales": s.clone(), "g_idx": g_idx.to(torch.int32)}


def pack_awq(q, z, s) -> dict[str, torch.Tensor]:
    intweight = q.t().contiguous().to(torch.int32)  # (in, out)
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    zeros = z.to(torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=torch.int32)
    for col in range(zeros.shape[1] // 8):
        for i in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": s.clone()}


def write_quantized_checkpoint(src: Path, out: Path, kind: str, group: int, desc_act: bool = False) -> Path:
    """Quantize every projection of the float checkpoint `src` with random integer weights
    (GPTQ or AWQ layout) into `out`; also writes `out/dequantized/`, the float32 checkpoint
    with exactly the weights those integers stand for."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    quant, ref = {}, {}
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for i, (name, t) in enumerate(sorted(tensors.items())):
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight" and prefix.rsplit(".", 1)[-1] in projections:
            out_f, in_f = t.shape
            q, z, s, g_idx = random_int4_layer(out_f, in_f, group, seed=i)
            if desc_act:
                # q/k/v (and gate/up) share one input, hence one act order, as in GPTQ.
                parent, proj = prefix.rsplit(".", 1)
                shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
                seed = zlib.crc32(f"{parent}.{shared.get(proj, proj)}".encode())
                perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(seed))
                g_idx = (torch.arange(in_f) // group)[perm]
            if kind == "gptq":
                z = z.clamp(min=1)  # v1 cannot store a zero of 0 (it reads back as 16, see the unpack test)
            w = dequant_reference(q, z, s, g_idx)
            packed = pack_gptq(q, z, s, g_idx) if kind == "gptq" else pack_awq(q, z, s)
            quant.update({f"{prefix}.{k}": v for k, v in packed.items()})
            ref[name] = w.contiguous()
        else:
            quant[name] = t.half() if t.is_floating_point() else t
            ref[name] = quant[name].float()
    out.mkdir(parents=True)
    save_file(quant, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    for folder, qc in ((out, {"quant_method": kind, "bits": 4, "group_size": group, "desc_act": desc_act,
                              "sym": False, **({"version": "gemm", "zero_point": True} if kind == "awq" else {})}),
                       (out / "dequantized", None)):
        folder.mkdir(exist_ok=True)
        c = dict(cfg)
        if qc:
            c["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(c))
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
                (folder / f.name).write_bytes(f.read_bytes())
    save_file(ref, str(out / "dequantized" / "model.safetensors"))
    return out
