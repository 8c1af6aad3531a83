"""GGUF file -> Hugging Face checkpoint folder (float32 safetensors, config, tokenizer).

kvmesh serves HF folders; a GGUF (llama.cpp's single-file format) is dequantized once into
one, so every later load is a plain safetensors read with no GGUF code in the hot path.
Per architecture (`GGUF_ARCHS`): the tensor names, what llama.cpp's convert_hf_to_gguf.py
did to the tensors (undone here), and the config.json to write:

- llama: q/k rows were permuted from HF's half-split RoPE layout to llama.cpp's
  interleaved pairs (`unpermute_rows` undoes it).
- gemma3: no permutation (llama.cpp runs Gemma's RoPE in NEOX, i.e. HF, layout); every
  `*norm.weight` was stored as 1 + w (Gemma's RMSNorm scales by 1 + w, llama.cpp's by w),
  so 1 is subtracted back. Sliding-window pattern (every 6th layer global) and the local
  RoPE base (10k) are not in the file: llama.cpp hard-codes them, and so do we.

Weights are those the GGUF holds (e.g. Q4_K-rounded), dequantized with
`gguf.quants.dequantize` to float32: exactly what transformers' own GGUF loader produces.
Torch-free at import; the heavy imports happen inside `convert_gguf`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.checkpoint.cache import build_once, cache_dir, is_complete
from kvmesh.checkpoint.gguf_header import GGUFHeader
from kvmesh.errors import ModelNotFoundError

# Bump when the folder layout or conversion changes: old folders then get rebuilt.
FORMAT_VERSION = 1
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 16

_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LLAMA_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_GEMMA3_BLOCK = {
    **_LLAMA_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",  # Gemma's ffn_norm sits before the MLP ...
    "post_ffw_norm": "post_feedforward_layernorm",  # ... and this one after it
}

# Gemma 3's standard chat template (the one its instruction-tuned releases ship). GGUFs of
# the base models carry none; the turn markers are in every Gemma 3 vocabulary.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    "{%- set role = \"model\" -%}"
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}"
    "{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}"
    "{%- endif -%}"
)


def _eps(value: float) -> float:
    """GGUF stores eps as float32 (9.99999975e-06); round back to the intended 1e-05."""
    import numpy as np

    return float(f"{np.float32(value):.6g}")


def _special_ids(meta: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return bos, eos, meta.get("tokenizer.ggml.padding_token_id", eos)


def _llama_config(meta: dict[str, Any], tied: bool, tokenizer) -> dict[str, Any]:
    bos, eos, pad = _special_ids(meta)
    theta = float(meta["llama.rope.freq_base"])
    n_head = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": int(meta.get("llama.vocab_size") or len(tokenizer)),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _eps(meta["llama.attention.layer_norm_rms_epsilon"]),
        # Explicit rope_theta: transformers 4.x ignores 5.x's rope_parameters and
        # would silently fall back to 10000.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def _gemma3_layer_types(meta: dict[str, Any], n_layers: int) -> list[str]:
    # llama.cpp: set_swa_pattern(6) for gemma3 (layers 6k-1 global); a file may carry the
    # per-layer flags (true = sliding) instead.
    flags = meta.get("gemma3.attention.sliding_window_pattern")
    if isinstance(flags, list) and len(flags) == n_layers:
        sliding = [bool(f) for f in flags]
    else:
        pattern = int(flags) if isinstance(flags, int) and flags > 0 else 6
        sliding = [(i + 1) % pattern != 0 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma3_config(meta: dict[str, Any], tied: bool, tokenizer) -> dict[str, Any]:
    bos, eos, pad = _special_ids(meta)
    n_layers = int(meta["gemma3.block_count"])
    hidden = int(meta["gemma3.embedding_length"])
    n_head = int(meta["gemma3.attention.head_count"])
    head_dim = int(meta.get("gemma3.attention.key_length", 256))
    theta = float(meta["gemma3.rope.freq_base"])
    local_theta = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
    full_rope = {"rope_type": "default", "rope_theta": theta}
    scaling = None
    if meta.get("gemma3.rope.scaling.type") == "linear" and meta.get("gemma3.rope.scaling.factor"):
        scaling = {"rope_type": "linear", "factor": float(meta["gemma3.rope.scaling.factor"])}
        full_rope.update(scaling)  # global layers only, as in Gemma 3 4B+
    # <end_of_turn> ends a chat turn: an end of generation like <eos> (generation_config upstream).
    eos_ids = [eos] + [i for i in (tokenizer.convert_tokens_to_ids("<end_of_turn>"),)
                       if isinstance(i, int) and i != tokenizer.unk_token_id and i != eos]
    layer_types = _gemma3_layer_types(meta, n_layers)
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "torch_dtype": "float32",
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": int(meta["gemma3.feed_forward_length"]),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("gemma3.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta["gemma3.context_length"]),
        "rms_norm_eps": _eps(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers): hidden / heads.
        "query_pre_attn_scalar": hidden // n_head if n_layers == 62 else head_dim,
        "sliding_window": int(meta["gemma3.attention.sliding_window"]),
        "layer_types": layer_types,
        # 5.x reads RoPE per layer type; 4.x reads rope_theta (+ rope_scaling) for the global
        # layers and rope_local_base_freq for the sliding ones.
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "rope_theta": theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": scaling,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos,
        "pad_token_id": pad,
    }
    if layer_types == _gemma3_layer_types({}, n_layers):
        config["sliding_window_pattern"] = 6  # what 4.x releases before layer_types read
    return config


@dataclass(frozen=True)
class GGUFArch:
    """What converting one llama.cpp architecture takes."""

    block_names: dict[str, str]  # GGUF per-block tensor suffix -> HF module path in model.layers.N
    build_config: Callable[[dict[str, Any], bool, Any], dict[str, Any]]  # (meta, tied, tokenizer)
    permute_qk: bool = False  # llama.cpp interleaved each head's q/k rows (undo with unpermute_rows)
    norm_shift: float = 0.0  # llama.cpp stored norm_shift + w for every `*norm.weight`
    sentencepiece_class: str = "LlamaTokenizer"  # tokenizer_class for a sentencepiece ("llama") vocab
    default_chat_template: str | None = None  # when the file carries none


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch(_LLAMA_BLOCK | {"ffn_norm": "post_attention_layernorm"}, _llama_config, permute_qk=True),
    "gemma3": GGUFArch(_GEMMA3_BLOCK, _gemma3_config, norm_shift=1.0, sentencepiece_class="GemmaTokenizer",
                       default_chat_template=GEMMA3_CHAT_TEMPLATE),
}


def gguf_arch(name: str, src: Path | str = "GGUF") -> GGUFArch:
    if name not in GGUF_ARCHS:
        raise ModelNotFoundError(f"model: {src} is a {name!r} GGUF; kvmesh converts {sorted(GGUF_ARCHS)} GGUFs")
    return GGUF_ARCHS[name]


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """GGUF tensor name (`blk.N.attn_q.weight`) -> HF name; ValueError if unknown."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    names = gguf_arch(arch).block_names
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no {arch} counterpart")
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (same as transformers' GGUF loader).

    convert_hf_to_gguf.py reorders each head's rows from HF's half-split rotary
    layout into llama.cpp's interleaved-pair layout; HF's Llama expects the former.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


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


def _marker(src: Path, key: str) -> dict[str, Any]:
    return {"source": src.name, "source_size": src.stat().st_size, "source_key": key,
            "source_path": str(src.resolve()), "format_version": FORMAT_VERSION}


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
    return build_once(target, _marker(src, key), lambda tmp: convert_gguf(src, tmp, progress),
                      target.parent / f".{target.name}.lock")


def converted_source(folder: Path) -> Path | None:
    """The GGUF a cache folder made by ensure_gguf_folder came from (if still there), else None."""
    try:
        marker = json.loads((folder / ".complete").read_text())
        src = Path(marker["source_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return src if src.is_file() and is_complete(folder, _marker(src, source_key(src))) else None
