"""Tiny random Llama-family checkpoints (transformers' own save_pretrained) plus a small
byte-level BPE tokenizer trained on the fly, for the tests."""

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


def _randomize_parameters(model, seed: int) -> None:
    """Overwrite EVERY parameter, deterministically from `seed`, so that a loader which drops
    or misplaces any tensor changes the output (transformers' init leaves biases at 0 and
    RMSNorm scales at 1, which a dropped tensor would silently reproduce):
    - 2-D weights (embeddings, projections, lm_head): normal(0, 0.08), larger than the default
      init so logits are spread out and greedy ties are unlikely;
    - biases (Llama attention_bias q/k/v/o, Qwen2 q/k/v): normal(0, 0.15);
    - 1-D scales (RMSNorm weights): 1 + normal(0, 0.2), clamped to [0.5, 1.5].
    A generator of its own, in `named_parameters` order, so the values depend on the seed
    and the architecture only, not on how much global RNG the constructor consumed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is listed once
            if p.dim() == 2:
                p.copy_(torch.empty(p.shape).normal_(0, 0.08, generator=g))
            elif name.endswith(".bias"):
                p.copy_(torch.empty(p.shape).normal_(0, 0.15, generator=g))
            elif p.dim() == 1 and name.endswith(".weight"):  # RMSNorm scales
                p.copy_((1 + torch.empty(p.shape).normal_(0, 0.2, generator=g)).clamp_(0.5, 1.5))
            else:
                raise ValueError(f"tiny model: no randomization rule for parameter {name} {tuple(p.shape)}")


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
    seed: int = 0,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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
    if architecture == "qwen2":
        cfg = Qwen2Config(**common)
        model = Qwen2ForCausalLM(cfg)
    else:
        if rope_scaling:
            common["rope_scaling"] = rope_scaling
        cfg = LlamaConfig(attention_bias=qkv_bias, **common)
        model = LlamaForCausalLM(cfg)
    _randomize_parameters(model, seed)
    model.save_pretrained(path)
    build_tokenizer(vocab_size).save_pretrained(path)
    return path
