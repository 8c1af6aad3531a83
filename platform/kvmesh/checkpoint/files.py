"""Local checkpoint files: find the folder (the embedded model when none is given, a GGUF
converted into the cache, a packaged model by name), stream
its safetensors, fingerprint it, load its tokenizer.

Torch-free at import: the router and prompt compression load tokenizers through this
module without pulling in the model code.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvmesh.checkpoint.embedded import ensure_embedded_model
from kvmesh.checkpoint.gguf_convert import ensure_gguf_folder
from kvmesh.checkpoint.packaged import PACKAGED_MODELS, find_packaged
from kvmesh.errors import ModelNotFoundError

# Bytes sampled from each weight file for the fingerprint (see model_fingerprint).
_FP_CHUNKS, _FP_CHUNK_BYTES = 64, 1 << 16


def resolve_model_path(model: str | None, progress: bool = True) -> Path:
    """The checkpoint folder `model` names, converting a GGUF into the cache at first use.

    `model` is: None (the embedded model); an HF folder (config.json + *.safetensors); a
    `*.gguf` file, or a folder holding exactly one and no safetensors; or, when no such
    path exists, a packaged model's name (`gemma-3-270m`, `google/gemma-3-270m`: see
    checkpoint/packaged.py).
    """
    if model is None:
        return ensure_embedded_model(progress=progress)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_gguf_folder(path, progress=progress)
    if not path.exists():
        packaged = find_packaged(model)
        if packaged is not None:
            return packaged.resolve(progress=progress)
    if not path.is_dir():
        names = ", ".join(m.name for m in PACKAGED_MODELS)
        raise ModelNotFoundError(
            f"model: {model!r} is not a folder, a *.gguf file or a packaged model ({names}). Pass a local "
            "checkpoint folder holding config.json and *.safetensors, or a GGUF (kvmesh never downloads from "
            "a model hub), or omit --model to use the embedded SmolLM2-135M-Instruct."
        )
    weights = list(path.glob("*.safetensors"))
    ggufs = sorted(path.glob("*.gguf"))
    if not weights and len(ggufs) == 1:
        return ensure_gguf_folder(ggufs[0], progress=progress)
    if not (path / "config.json").is_file():
        hint = f" (and {len(ggufs)} *.gguf files: pass one of them)" if len(ggufs) > 1 else ""
        raise ModelNotFoundError(f"model: {model!r} has no config.json{hint}")
    if not weights:
        raise ModelNotFoundError(f"model: {model!r} has no *.safetensors weight files")
    return path


def iter_safetensors(path: Path):
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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
