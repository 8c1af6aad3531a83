"""Tiny random checkpoints of every architecture kvmesh serves (transformers' own
save_pretrained) plus a small byte-level BPE tokenizer trained on the fly, for the tests."""

from __future__ import annotations

from pathlib import Path


_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests at every step.",
    "Prefix caching reuses blocks whose tokens were computed before.",
    "Émigré café naïve coöperate — multi-byte characters: 日本語, 🙂, ünïcödé.",
] * 4


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _randomize_parameters(model, seed: int, zero_centred_norms: bool = False) -> None:
    """Overwrite EVERY parameter, deterministically from `seed`, so that a loader which drops
    or misplaces any tensor changes the output (transformers' init leaves biases at 0 and
    RMSNorm scales at 1, which a dropped tensor would silently reproduce):
    - 2-D weights (embeddings, projections, lm_head): normal(0, 0.08), larger than the default
      init so logits are spread out and greedy ties are unlikely;
    - biases (Llama attention_bias q/k/v/o, Qwen2 q/k/v): normal(0, 0.15);
    - 1-D scales (RMSNorm weights): 1 + normal(0, 0.2), clamped to [0.5, 1.5]; Gemma's
      zero-centred ones (the norm scales by 1 + w): normal(0, 0.2);
    - MoE router gates: normal(0, 0.3), so routing is decisive and a dropped gate shows;
      experts fused into 3-D tensors (transformers 5.x in memory): normal(0, 0.08).
    A generator of its own, in `named_parameters` order, so the values depend on the seed
    and the architecture only, not on how much global RNG the constructor consumed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is listed once
            if name.endswith("gate.weight") and p.dim() == 2:  # router (mlp.gate / block_sparse_moe.gate)
                p.copy_(torch.empty(p.shape).normal_(0, 0.3, generator=g))
            elif p.dim() in (2, 3):
                p.copy_(torch.empty(p.shape).normal_(0, 0.08, generator=g))
            elif name.endswith(".bias"):
                p.copy_(torch.empty(p.shape).normal_(0, 0.15, generator=g))
            elif p.dim() == 1 and name.endswith(".weight") and zero_centred_norms:
                p.copy_(torch.empty(p.shape).normal_(0, 0.2, generator=g))
            elif p.dim() == 1 and name.endswith(".weight"):  # RMSNorm scales
                p.copy_((1 + torch.empty(p.shape).normal_(0, 0.2, generator=g)).clamp_(0.5, 1.5))
            else:
                raise ValueError(f"tiny model: no randomization rule for parameter {name} {tuple(p.shape)}")


# architecture -> (transformers config class, model class) names
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def build_tiny_model(
    path: Path,
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    qkv_bias: bool = False,
    architecture: str = "llama",
    max_position_embeddings: int = 512,
    rope_scaling: dict | None = None,
    sliding_window: int | None = None,
    head_dim: int | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 48,
    extra: dict | None = None,
    seed: int = 0,
) -> Path:
    """`extra`: more config keys (e.g. Gemma 3's `layer_types`, Qwen3-MoE's `norm_topk_prob`)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common["head_dim"] = head_dim or hidden_size // num_heads  # Qwen3 / Gemma 3 default to 128 / 256
    if rope_scaling:
        common["rope_scaling"] = rope_scaling
    if architecture == "llama":
        common["attention_bias"] = qkv_bias
    elif qkv_bias:
        raise ValueError(f"tiny model: qkv_bias is a Llama option, not {architecture}'s")
    if architecture in ("mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma3"):
        common["sliding_window"] = sliding_window
    elif sliding_window is not None:
        raise ValueError(f"tiny model: {architecture} has no sliding window")
    if architecture in ("qwen2", "qwen3", "qwen3_moe"):
        common["use_sliding_window"] = sliding_window is not None
        common["max_window_layers"] = 0  # every layer slides when a window is set
    if architecture == "mixtral":
        common.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    if architecture == "qwen3_moe":
        common.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                      moe_intermediate_size=moe_intermediate_size)
    if architecture == "gemma3":
        common.update(query_pre_attn_scalar=common["head_dim"] * 2, rope_local_base_freq=100.0,
                      sliding_window=sliding_window or 4096)
    common.update(extra or {})
    config_name, model_name = ARCHITECTURES[architecture]
    cfg = getattr(transformers, config_name)(**common)
    if architecture in ("qwen2", "qwen3", "qwen3_moe") and sliding_window is not None \
            and "layer_types" not in (extra or {}):
        cfg.layer_types = ["sliding_attention"] * num_layers  # 5.x computes them at init
    model = getattr(transformers, model_name)(cfg)
    _randomize_parameters(model, seed, zero_centred_norms=architecture == "gemma3")
    model.save_pretrained(path)
    build_tokenizer(vocab_size).save_pretrained(path)
    return path
