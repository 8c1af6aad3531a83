"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on kvmesh's paged attention.

The model consumes a flat batch: `input_ids` (T,), `positions` (T,) for all scheduled
tokens of all sequences, no padding. Q/K/V and gate/up projections are fused into one
Linear each (one GEMM instead of three / two); checkpoint shards are copied into
their slice by per-parameter `weight_loader`s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvmesh.layers.activation import SiluAndMul
from kvmesh.layers.attention import AttentionBackend, AttentionMetadata
from kvmesh.layers.decode_stack import DecodeStack, StackLayer
from kvmesh.layers.linear import Linear, MergedColumnLinear
from kvmesh.layers.norm import RMSNorm
from kvmesh.layers.op import OpContext, fast_paths_changed
from kvmesh.layers.rotary import RotaryQKV
from kvmesh.models.arch import ArchConfig
from kvmesh.models.rope import RotaryEmbedding


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")
    param.data.copy_(loaded)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext, layer_idx: int = 0):
        super().__init__()
        tp = ctx.tp.size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedColumnLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.qkv_bias, ctx=ctx)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.o_bias, ctx=ctx, parallel="row")
        self.rope = RotaryQKV(self.num_heads, self.num_kv_heads, self.head_dim, ctx)
        self.q_size = self.num_heads * self.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.layer_windows[layer_idx]  # None: full attention

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]
        q, k, v = self.rope(self.qkv_proj(x), cos, sin)  # (T, H, D), (T, KVH, D), (T, KVH, D)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, {"gate": i, "up": i}, bias=cfg.mlp_bias, ctx=ctx)
        self.act = SiluAndMul(ctx)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias, ctx=ctx, parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = LlamaAttention(cfg, ctx, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = LlamaMLP(cfg, ctx)

    def forward(self, h, cos, sin, kv_cache, meta, backend):
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, backend)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)

    def stack_layer(self) -> StackLayer:
        attn, mlp = self.self_attn, self.mlp
        return StackLayer(self.input_layernorm, attn.qkv_proj, attn.o_proj, self.post_attention_layernorm,
                          mlp.gate_up_proj, mlp.down_proj, attn.window)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, ctx: OpContext):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, ctx, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.rotary = RotaryEmbedding(cfg, max_positions)


class LlamaForCausalLM(nn.Module):
    # checkpoint shard name -> (fused parameter name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ArchConfig, max_positions: int, ctx: OpContext | None = None):
        super().__init__()
        ctx = ctx or OpContext()
        if ctx.tp.size > 1:
            raise ValueError("tensor parallelism: the model layers shard, but the embedding and lm_head are "
                             "not vocab-parallel yet; run with tensor parallel size 1")
        self.cfg = cfg
        self.model = LlamaModel(cfg, max_positions, ctx)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, ctx=ctx)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.decode_stack = DecodeStack(lambda: [layer.stack_layer() for layer in self.model.layers],
                                        attn.num_heads, attn.num_kv_heads, cfg.rms_norm_eps, attn.scale, ctx)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final hidden states before the last norm, (T, hidden)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.cos_sin(positions, h.dtype)
        out = self.decode_stack(h, cos, sin, kv_caches, meta, backend)
        if out is not None:
            return out
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta, backend)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into parameters; every parameter must be set.
        Linear layers copy their tensor-parallel slice (their `weight_loader`)."""
        fast_paths_changed()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for ckpt, (merged, shard_id) in self.packed_modules.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(f".{ckpt}.", f".{merged}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            if shard is not None:
                owner.weight_loader(param, tensor, shard)
                loaded.add(f"{target}:{shard}")
            else:
                loader = getattr(owner, "weight_loader", None)  # layers' loaders copy their TP slice
                (loader or default_weight_loader)(param, tensor)
                loaded.add(target)
        expected = set()
        for pname, param in params.items():
            owner = pname.rsplit(".", 1)[0]
            module = self.get_submodule(owner)
            if isinstance(module, MergedColumnLinear):
                expected.update(f"{pname}:{s}" for s in module.offsets)
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
