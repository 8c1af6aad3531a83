"""Find a checkpoint folder, build the model on the right device and dtype, load weights,
and compute the model fingerprint that roots every KV block hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvmesh.errors import ModelNotFoundError
from kvmesh.models.arch import ArchConfig

# Bytes sampled from each weight file for the fingerprint (see model_fingerprint).
_FP_CHUNKS, _FP_CHUNK_BYTES = 64, 1 << 16


def resolve_model_path(model: str | None, progress: bool = True) -> Path:
    """The checkpoint folder: the embedded model when `model` is None."""
    if model is None:
        from kvmesh.models.embedded import ensure_embedded_model

        return ensure_embedded_model(progress=progress)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model: {model!r} is not a folder. Pass a local checkpoint folder holding "
            "config.json and *.safetensors (kvmesh never downloads from a model hub), "
            "or omit --model to use the embedded SmolLM2-135M-Instruct."
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model: {model!r} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"model: {model!r} has no *.safetensors weight files")
    return path


def load_arch_config(path: Path) -> ArchConfig:
    with open(path / "config.json") as f:
        return ArchConfig.from_hf(json.load(f))


def iter_safetensors(path: Path):
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path: Path, dtype, device, max_positions: int,
               quantization: str | None = None, group_size: int | None = None):
    """Build the model for `path` and load its weights; returns (model, ArchConfig).

    `quantization` ("int8" / "int4", see kvmesh.quant) quantizes a float checkpoint
    while loading, "gguf" loads the GGUF the folder came from kept quantized; a checkpoint whose config.json has a `quantization_config`
    (kvmesh, GPTQ, AWQ) is loaded quantized as stored.
    """
    import torch

    from kvmesh.models.llama import LlamaForCausalLM
    from kvmesh.models.rope import RotaryEmbedding
    from kvmesh.quant.loader import load_quantized_model, read_quantization_config

    cfg = load_arch_config(path)
    if quantization is not None or read_quantization_config(path) is not None:
        return load_quantized_model(path, cfg, dtype, device, max_positions, quantization, group_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    # Materialize uninitialized storage: every parameter is overwritten by the load.
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(iter_safetensors(path))
    model = model.to(dtype=dtype)
    # RoPE tables are non-persistent buffers that meta init left empty; they stay
    # float32 (cast per step), as in the reference.
    model.model.rotary = RotaryEmbedding(cfg, max_positions).to(device)
    model.eval()
    return model, cfg


def model_fingerprint(path: Path, extra: dict | None = None) -> str:
    """A stable id for "the KV this model produces".

    Covers config.json, the weight files (name, size, safetensors header and sampled
    content chunks: exact identity without reading multi-GB files at startup) and
    `extra` settings that change KV contents (dtype, block size, quantization).
    Identical on every machine for identical files and settings.
    """
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
            step = max(size // _FP_CHUNKS, 1)
            for off in range(0, size, step):
                f.seek(off)
                h.update(f.read(_FP_CHUNK_BYTES))
    h.update(json.dumps(extra or {}, sort_keys=True).encode())
    return h.hexdigest()[:32]


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(str(path))
