"""Gemma 3 (text) on kvmesh's paged attention.

What it adds to the Llama layout (models/llama.py, whose attention and MLP it reuses):
- norms scale by (1 + w), their weights zero-centred (RMSNorm `offset=1`), q / k normed per head;
- "sandwich" norms: the attention output and the MLP output are normed before their
  residual add, and the MLP input has its own norm (pre_feedforward_layernorm);
- interleaved sliding-window and global layers (`layer_types`), each kind with its own
  RoPE base (10k local, 1M global) and the global one possibly scaled;
- queries scaled by query_pre_attn_scalar ** -0.5, embeddings by sqrt(hidden), GELU-tanh
  MLP, tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from kvmesh.layers.attention import AttentionBackend, AttentionMetadata
from kvmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding, gather_vocab
from kvmesh.layers.norm import RMSNorm
from kvmesh.layers.op import OpContext
from kvmesh.models.arch import ArchConfig
from kvmesh.models.llama import (CausalLMWeights, LlamaModel, LlamaAttention, LlamaMLP, check_tensor_parallel, first_stage,
                                 stage_layers)
from kvmesh.models.rope import RotaryEmbedding


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext, layer_idx: int):
        super().__init__()
        h, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(h, eps, ctx, offset=off)
        self.self_attn = LlamaAttention(cfg, ctx, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps, ctx, offset=off)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, ctx, offset=off)
        self.mlp = LlamaMLP(cfg, ctx)
        self.post_feedforward_layernorm = RMSNorm(h, eps, ctx, offset=off)
        self.sliding = self.self_attn.window is not None

    def forward(self, h, cos, sin, kv_cache, meta, backend):
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, backend)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, ctx: OpContext):
        super().__init__()
        self.embed_tokens = first_stage(ctx, lambda: VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx))
        self.layers = stage_layers(cfg, ctx, lambda i: Gemma3DecoderLayer(cfg, ctx, i))
        self.norm = first_stage(ctx, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx, offset=cfg.norm_offset))
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.rotary_local = RotaryEmbedding(cfg, max_positions, local=True)

    held_layers = LlamaModel.held_layers


class Gemma3ForCausalLM(CausalLMWeights):
    def __init__(self, cfg: ArchConfig, max_positions: int, ctx: OpContext | None = None):
        super().__init__()
        ctx = ctx or OpContext()
        check_tensor_parallel(cfg, ctx.tp.size)
        self.cfg, self.max_positions, self.tp = cfg, max_positions, ctx.tp
        self.model = Gemma3Model(cfg, max_positions, ctx)
        self.lm_head = first_stage(ctx, lambda: ParallelLMHead(cfg.hidden_size, cfg.vocab_size, ctx))
        if cfg.tie_word_embeddings and ctx.pp.first:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.decode_stack = None  # csrc/decode_stack.cpp runs Llama-shaped layers only

    def init_rotary(self, device) -> None:
        self.model.rotary = RotaryEmbedding(self.cfg, self.max_positions).to(device)
        self.model.rotary_local = RotaryEmbedding(self.cfg, self.max_positions, local=True).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend: AttentionBackend, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the hidden states after this stage's layers, before the last norm, (T,
        hidden); a later pipeline stage gets the previous stage's `hidden` (see LlamaForCausalLM)."""
        if hidden is None:
            h = self.model.embed_tokens(input_ids)
            # transformers casts the sqrt(hidden) scale to the weights' dtype first
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        else:
            h = hidden
        rope = {False: self.model.rotary.cos_sin(positions, h.dtype),
                True: self.model.rotary_local.cos_sin(positions, h.dtype)}
        for layer, kv_cache in zip(self.model.held_layers(), kv_caches):
            h = layer(h, *rope[layer.sliding], kv_cache, meta, backend)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab(self.lm_head(self.model.norm(hidden)), self.tp, self.cfg.vocab_size).float()
