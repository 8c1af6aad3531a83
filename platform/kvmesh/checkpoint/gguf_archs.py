"""What converting each llama.cpp architecture takes: GGUF tensor names -> HF names, the
transforms llama.cpp applied (undone by gguf_convert.py), and the config.json to write.

- llama: q/k rows were permuted from HF's half-split RoPE layout to llama.cpp's
  interleaved pairs (`unpermute_rows` undoes it).
- gemma3: no permutation (llama.cpp runs Gemma's RoPE in NEOX, i.e. HF, layout); every
  `*norm.weight` was stored as 1 + w (Gemma's RMSNorm scales by 1 + w, llama.cpp's by w),
  so 1 is subtracted back. The sliding-window pattern (every 6th layer global), the local
  RoPE base (10k) and the query scale are not in the file: llama.cpp hard-codes them, and
  so do we. Nor is a chat template in the base models' files: Gemma 3's standard one is
  written.

Torch-free; numpy only inside functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import ModelNotFoundError

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
