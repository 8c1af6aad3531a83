"""Local checkpoint files: find the folder (the embedded model when none is given), stream
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
from kvmesh.errors import ModelNotFoundError

# Bytes sampled from each weight file for the fingerprint (see model_fingerprint).
_FP_CHUNKS, _FP_CHUNK_BYTES = 64, 1 << 16


def resolve_model_path(model: str | None, progress: bool = True) -> Path:
    """The checkpoint folder: the embedded model when `model` is None."""
    if model is None:
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
