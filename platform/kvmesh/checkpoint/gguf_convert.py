"""GGUF file -> Hugging Face checkpoint folder (float32 safetensors, config, tokenizer).

kvmesh serves HF folders; a GGUF (llama.cpp's single-file format) is dequantized once into
one, in the kvmesh cache, so every later load is a plain safetensors read with no GGUF code
in the hot path. Per architecture (gguf_archs.py): tensor names, llama.cpp's transforms
undone (llama's q/k permutation, Gemma's norm + 1), the config builder.

Weights are those the GGUF holds (e.g. Q4_K-rounded), dequantized with
`gguf.quants.dequantize` to float32: exactly what transformers' own GGUF loader produces.
The tokenizer is rebuilt by transformers from the GGUF metadata and saved so 4.x and 5.x
both read it. Torch-free at import; the heavy imports happen inside the functions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvmesh.checkpoint.cache import build_once, cache_dir, is_complete
from kvmesh.checkpoint.gguf_archs import GGUFArch, gguf_arch, hf_tensor_name, unpermute_rows
from kvmesh.checkpoint.gguf_header import GGUFHeader
from kvmesh.errors import ModelNotFoundError

# Bump when the folder layout or conversion changes: old folders then get rebuilt.
FORMAT_VERSION = 1
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 16


def _dequantized(header: GGUFHeader, ttype: int, shape: tuple[int, ...], offset: int):
    """One tensor as float32 in HF (row-major) order."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(ttype)
    raw = header.data(qtype.name, shape, offset)
    if qtype.name in ("F32", "F16", "BF16"):
        return np.asarray(raw, dtype=np.float32).reshape(shape)
    rows = int(np.prod(shape[:-1]))
    return dequantize(np.asarray(raw).reshape(rows, -1), qtype).reshape(shape)


def convert_weights(src: Path, progress: bool = True, desc: str | None = None) -> dict[str, Any]:
    """Every GGUF tensor dequantized to float32 numpy, HF-named, llama.cpp's transforms undone."""
    import numpy as np
    from tqdm.auto import tqdm

    header = GGUFHeader(src)
    arch_name = header.meta["general.architecture"]
    arch = gguf_arch(arch_name, src)
    heads = {"attn_q": header.meta.get(f"{arch_name}.attention.head_count"),
             "attn_k": header.meta.get(f"{arch_name}.attention.head_count_kv")}
    heads["attn_k"] = heads["attn_k"] or heads["attn_q"]
    tensors = {}
    bar = tqdm(header.tensors, desc=desc or f"Converting {src.name}", unit="tensor", disable=not progress)
    for gguf_name, ttype, shape, offset in bar:
        w = _dequantized(header, ttype, shape, offset)
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
        if arch.permute_qk and kind in heads and gguf_name.endswith(".weight"):
            w = unpermute_rows(w, int(heads[kind]))
        if arch.norm_shift and gguf_name.endswith("norm.weight"):
            w = w - np.float32(arch.norm_shift)  # float32, as transformers' loader does
        tensors[hf_tensor_name(gguf_name, arch_name)] = np.ascontiguousarray(w, dtype=np.float32)
    return tensors


def _save_tokenizer(src: Path, out: Path, arch: GGUFArch, meta: dict[str, Any], require_template: bool):
    """Rebuild the tokenizer from GGUF metadata (transformers) and save it readable by 4.x and 5.x."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tok.save_pretrained(out)
    # 5.x writes tokenizer_class "TokenizersBackend", which 4.x cannot load; the class the
    # upstream repos name reads the same tokenizer.json identically in both. Inline the chat
    # template (as upstream does) so older readers see it too.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    for key in ("is_local", "local_files_only"):  # load-time artefacts, not settings
        tok_cfg.pop(key, None)
    byte_level = meta.get("tokenizer.ggml.model") == "gpt2"
    tok_cfg["tokenizer_class"] = "GPT2Tokenizer" if byte_level else arch.sentencepiece_class
    tok_cfg["model_max_length"] = None  # the context length, once config.json is built
    if not byte_level:  # the sentencepiece classes' own defaults differ between 4.x and 5.x
        tok_cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        tok_cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = out / "chat_template.jinja"
    if template.exists():
        tok_cfg["chat_template"] = template.read_text()
        template.unlink()
    if not tok_cfg.get("chat_template") and arch.default_chat_template:
        tok_cfg["chat_template"] = arch.default_chat_template
    if require_template and not tok_cfg.get("chat_template"):
        raise ValueError(f"{src}: no chat template survived tokenizer conversion")
    return tok, tok_cfg, tok_cfg_path


def convert_gguf(src: Path, out: Path, progress: bool = True, desc: str | None = None,
                 require_chat_template: bool = False) -> None:
    """Write the HF folder of GGUF `src` into the existing folder `out`."""
    from safetensors.numpy import save_file

    meta = GGUFHeader(src).meta
    arch = gguf_arch(meta.get("general.architecture"), src)
    tensors = convert_weights(src, progress, desc)
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    tok, tok_cfg, tok_cfg_path = _save_tokenizer(src, out, arch, meta, require_chat_template)
    config = arch.build_config(meta, tied, tok)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": config["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok_cfg["model_max_length"] = config["max_position_embeddings"]
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")


def source_key(src: Path) -> str:
    """A content id of a GGUF file (size + sampled chunks, as model_fingerprint samples weights):
    the same file anywhere shares one converted folder; a changed file gets a new one."""
    size = src.stat().st_size
    h = hashlib.sha256(f"{size}".encode())
    with open(src, "rb") as f:
        for off in range(0, size, max(size // _SAMPLES, 1)):
            f.seek(off)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:12]


_SOURCE = ".source"  # the path the folder was converted from (not part of its identity)


def _marker(src: Path, key: str) -> dict[str, Any]:
    # Content, not path: the same file at another path reuses the folder.
    return {"source": src.name, "source_size": src.stat().st_size, "source_key": key,
            "format_version": FORMAT_VERSION}


def converted_dir(src: Path, key: str | None = None) -> Path:
    """Where GGUF `src` converts to in the cache."""
    return cache_dir() / "models" / "gguf" / f"{src.stem}-{key or source_key(src)}-f32"


def ensure_gguf_folder(src: Path, progress: bool = True) -> Path:
    """The converted HF folder of GGUF file `src`, converting it first if needed (once, locked)."""
    src = Path(src).expanduser()
    if not src.is_file():
        raise ModelNotFoundError(f"model: GGUF file {src} not found")
    key = source_key(src)
    target = converted_dir(src, key)

    def build(tmp: Path) -> None:
        convert_gguf(src, tmp, progress)
        (tmp / _SOURCE).write_text(json.dumps({"path": str(src.resolve())}) + "\n")

    return build_once(target, _marker(src, key), build, target.parent / f".{target.name}.lock")


def converted_source(folder: Path) -> Path | None:
    """The GGUF a cache folder made by ensure_gguf_folder came from (if still there), else None."""
    try:
        src = Path(json.loads((folder / _SOURCE).read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return src if src.is_file() and is_complete(folder, _marker(src, source_key(src))) else None
