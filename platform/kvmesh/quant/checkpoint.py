"""`kvmesh quantize`: write a quantized copy of a float checkpoint folder.

The output is an HF-layout folder: `model.safetensors` with kvmesh's canonical
quantized tensors under the original module names (`...q_proj.qweight`, `.scales`,
`.zeros`), config.json with `quantization_config` = {"quant_method": "kvmesh",
"method": ..., "group_size": ...}, and every other file of the source (tokenizer,
generation config) copied as is. `kvmesh generate --model OUT` loads it quantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvmesh.models.loader import iter_safetensors, load_arch_config
from kvmesh.quant.loader import read_quantization_config
from kvmesh.quant.methods import QuantMethod


def quantize_checkpoint(src: Path, out: Path, method: QuantMethod, progress: bool = True) -> Path:
    """Quantize `src` (a float HF folder) into `out` (created; must not exist or be empty)."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    if read_quantization_config(src) is not None:
        raise ValueError(f"model: {src} is already quantized; quantize a float checkpoint")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out: {out} exists and is not empty; pick a new folder")
    cfg = load_arch_config(src)
    out.mkdir(parents=True, exist_ok=True)
    weights = tqdm(iter_safetensors(src), desc=f"Quantizing ({method.name})", unit="tensor", disable=not progress)
    tensors = {name: t.contiguous() for name, t in method.quantize_state_dict(weights, cfg.tie_word_embeddings)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = method.config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json", ".complete"):
            shutil.copy2(file, out / file.name)
    return out
