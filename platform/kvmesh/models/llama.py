"""Llama-family decoder on kvmesh's paged attention: Llama, Mistral (sliding window),
Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm per head), Phi-3 (q/k/v and gate/up fused in the
checkpoint), and, with a sparse MLP block in some layers (models/moe.py), Mixtral and
Qwen3-MoE.

The model consumes a flat batch: `input_ids` (T,), `positions` (T,) for all scheduled
tokens of all sequences, no padding. Q/K/V and gate/up projections are fused into one
Linear each (one GEMM instead of three / two); checkpoint shards are copied into
their slice by per-parameter `weight_loader`s (a checkpoint that stores them fused, as
Phi-3's does, is split into the same shards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvmesh.layers.activation import ACTIVATIONS
from kvmesh.layers.attention import AttentionBackend, AttentionMetadata
from kvmesh.layers.decode_stack import DecodeStack, StackLayer
from kvmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding, gather_vocab
from kvmesh.layers.linear import Linear, MergedColumnLinear
from kvmesh.layers.moe import FusedMoE, expert_tensor
from kvmesh.layers.norm import RMSNorm
from kvmesh.layers.op import OpContext, fast_paths_changed
from kvmesh.layers.rotary import RotaryQKV
from kvmesh.models.arch import ArchConfig
from kvmesh.models.moe import SparseMoeBlock, expert_keys
from kvmesh.models.rope import RotaryEmbedding


def local_kv_heads(cfg: ArchConfig, tp: int) -> int:
    """KV heads per rank: num_kv_heads / tp, or 1 when there are fewer KV heads than ranks
    (each then replicated on tp / num_kv_heads ranks). See `check_tensor_parallel`."""
    return max(1, cfg.num_kv_heads // tp)


def check_tensor_parallel(cfg: ArchConfig, tp: int) -> None:
    """Raise ValueError naming the dimension that `tp` ranks cannot split evenly."""
    dims = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.moe_layers:
        dims["moe_intermediate_size"] = cfg.moe_intermediate_size
    for name, size in dims.items():
        if size % tp:
            raise ValueError(f"{name} ({size}) is not divisible by the tensor parallel size {tp}")
    kv = cfg.num_kv_heads
    if (kv % tp if kv >= tp else tp % kv):
        raise ValueError(f"num_key_value_heads ({kv}) and the tensor parallel size {tp} must divide one "
                         "another (KV heads are split over the ranks, or replicated when fewer)")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")
    param.data.copy_(loaded)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext, layer_idx: int = 0):
        super().__init__()
        tp = ctx.tp.size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp, local_kv_heads(cfg, tp), cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        reps = tp // (cfg.num_kv_heads // self.num_kv_heads)  # ranks sharing a KV head (1: split)
        self.qkv_proj = MergedColumnLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.qkv_bias, ctx=ctx,
                                           replicas={"k": reps, "v": reps})
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.o_bias, ctx=ctx, parallel="row")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if cfg.qk_norm:  # Qwen3 / Gemma 3: RMSNorm over each head of q and of k
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx, offset=cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.rope = RotaryQKV(self.num_heads, self.num_kv_heads, self.head_dim, ctx)
        self.scale = cfg.head_scale
        self.window = cfg.layer_windows[layer_idx]

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            qkv = self._norm_qk(qkv)
        q, k, v = self.rope(qkv, cos, sin)  # (T, H, D), (T, KVH, D), (T, KVH, D)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(t, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # (T * heads, D) rows: the norms' 2-D kernels
        q = self.q_norm(q.reshape(-1, d)).view(t, self.q_size)
        k = self.k_norm(k.reshape(-1, d)).view(t, self.kv_size)
        return torch.cat((q, k, v), dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, {"gate": i, "up": i}, bias=cfg.mlp_bias, ctx=ctx)
        self.act = ACTIVATIONS[cfg.hidden_act](ctx)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias, ctx=ctx, parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def build_mlp(cfg: ArchConfig, ctx: OpContext, layer_idx: int) -> nn.Module:
    """A layer's MLP: the sparse block in MoE layers, else the dense gated MLP."""
    if layer_idx in cfg.moe_layers:
        return SparseMoeBlock(cfg, ctx)
    return LlamaMLP(cfg, ctx)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: OpContext, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = LlamaAttention(cfg, ctx, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = build_mlp(cfg, ctx, layer_idx)

    def forward(self, h, cos, sin, kv_cache, meta, backend):
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, backend)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)

    def stack_layer(self) -> StackLayer:
        attn, mlp = self.self_attn, self.mlp
        return StackLayer(self.input_layernorm, attn.qkv_proj, attn.o_proj, self.post_attention_layernorm,
                          mlp.gate_up_proj, mlp.down_proj, attn.window)


class MissingLayer(nn.Module):
    """A module another pipeline stage holds (no parameters; never called): the model keeps
    every layer's index, so checkpoint names match on every stage (vLLM's PPMissingLayer)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


def stage_layers(cfg: ArchConfig, ctx: OpContext, make: Callable[[int], nn.Module]) -> nn.ModuleList:
    """The decoder layers, built for this pipeline stage's range and MissingLayer elsewhere."""
    held = ctx.pp.layer_range(cfg.num_layers)
    return nn.ModuleList(make(i) if i in held else MissingLayer() for i in range(cfg.num_layers))


def first_stage(ctx: OpContext, make: Callable[[], nn.Module]) -> nn.Module:
    """A module of pipeline stage 0 only (embedding, final norm, LM head)."""
    return make() if ctx.pp.first else MissingLayer()


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, ctx: OpContext):
        super().__init__()
        self.embed_tokens = first_stage(ctx, lambda: VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx))
        self.layers = stage_layers(cfg, ctx, lambda i: LlamaDecoderLayer(cfg, ctx, i))
        self.norm = first_stage(ctx, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx))
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def held_layers(self) -> list[nn.Module]:
        """This pipeline stage's decoder layers, in order (all of them with one stage): the
        ones its KV caches (one per held layer) belong to."""
        return [layer for layer in self.layers if not isinstance(layer, MissingLayer)]


def runs_decode_stack(cfg: ArchConfig) -> bool:
    """Whether the layers have the shape csrc/decode_stack.cpp runs: Llama's (no q/k norm,
    SiLU, dense MLPs; sliding windows per layer are fine)."""
    return (not cfg.qk_norm and not cfg.moe_layers and cfg.hidden_act == "silu" and not cfg.sandwich_norms
            and not cfg.norm_offset and not cfg.embed_scale)


# Architectures whose checkpoints store q/k/v and gate/up already fused (`qkv_proj`, `gate_up_proj`).
FUSED_CHECKPOINTS = {"Phi3ForCausalLM"}


class CausalLMWeights(nn.Module):
    """Checkpoint loading shared by the decoders: HF tensor names to fused parameters."""

    # checkpoint shard name -> (fused parameter name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    # checkpoint module names renamed before matching (Mixtral's MoE block is `mlp` here)
    renamed_modules = {".block_sparse_moe.": ".mlp."}
    cfg: ArchConfig

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (HF naming) belongs to this pipeline stage: not to a
        MissingLayer (another stage's layer, or stage 0's embedding / norm / LM head)."""
        missing = self.__dict__.get("_missing")
        if missing is None:
            missing = self.__dict__["_missing"] = tuple(
                f"{n}." for n, m in self.named_modules() if isinstance(m, MissingLayer))
        return not missing or not name.startswith(missing)

    def _target(self, name: str) -> tuple[str, str | None, int | None]:
        """HF tensor name -> (parameter name, shard, expert id)."""
        for old, new in self.renamed_modules.items():
            name = name.replace(old, new)
        expert = expert_tensor(name)
        if expert is not None:  # `<layer>.mlp.experts.<e>.<proj>.weight`, or all experts in one tensor
            experts, expert_id, shard = expert
            return f"{experts}.{'w2' if shard == 'down' else 'w13'}", shard, expert_id
        for ckpt, (merged, shard_id) in self.packed_modules.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{merged}."), shard_id, None
        return name, None, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into parameters; every parameter must be set.
        Linear layers copy their tensor-parallel slice (their `weight_loader`)."""
        fast_paths_changed()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or not self.holds(name):
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard, expert = self._target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            if isinstance(owner, FusedMoE):
                owner.weight_loader(param, tensor, expert, shard)
                loaded.update(expert_keys(target, owner.num_experts, expert, shard))
            elif isinstance(owner, MergedColumnLinear):
                if shard is None:  # stored fused (Phi-3's qkv_proj / gate_up_proj): split it
                    sizes = list(owner.full_sizes.values())
                    if tensor.shape[0] != sum(sizes):
                        raise ValueError(f"checkpoint tensor {name!r}: {tensor.shape[0]} rows, expected {sum(sizes)}")
                    for shard_id, part in zip(owner.full_sizes, tensor.split(sizes, dim=0)):
                        owner.weight_loader(param, part, shard_id)
                        loaded.add(f"{target}:{shard_id}")
                else:
                    owner.weight_loader(param, tensor, shard)
                    loaded.add(f"{target}:{shard}")
            else:
                loader = getattr(owner, "weight_loader", None)  # layers' loaders copy their TP slice
                (loader or default_weight_loader)(param, tensor)
                loaded.add(target)
        expected = set()
        for pname, param in params.items():
            module = self.get_submodule(pname.rsplit(".", 1)[0])
            if isinstance(module, MergedColumnLinear):
                expected.update(f"{pname}:{s}" for s in module.offsets)
            elif isinstance(module, FusedMoE):
                expected.update(expert_keys(pname, module.num_experts, None, "down" if pname.endswith("w2") else "gate_up"))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


class LlamaForCausalLM(CausalLMWeights):
    def __init__(self, cfg: ArchConfig, max_positions: int, ctx: OpContext | None = None):
        super().__init__()
        ctx = ctx or OpContext()
        check_tensor_parallel(cfg, ctx.tp.size)
        self.cfg, self.max_positions, self.tp = cfg, max_positions, ctx.tp
        if cfg.architecture in FUSED_CHECKPOINTS:
            self.packed_modules = {}  # its checkpoint names are the fused modules' own
        self.model = LlamaModel(cfg, max_positions, ctx)
        self.lm_head = first_stage(ctx, lambda: ParallelLMHead(cfg.hidden_size, cfg.vocab_size, ctx))
        if cfg.tie_word_embeddings and ctx.pp.first:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.held_layers()[0].self_attn
        # Tensor parallel: each rank's stack runs its shards (its heads) and all-reduces the
        # row-parallel outputs itself. Pipeline parallel: the stage's own layers and KV caches.
        self.decode_stack = (DecodeStack(lambda: [layer.stack_layer() for layer in self.model.held_layers()],
                                         attn.num_heads, attn.num_kv_heads, cfg.rms_norm_eps, attn.scale, ctx)
                             if runs_decode_stack(cfg) else None)

    def init_rotary(self, device) -> None:
        """(Re)build the RoPE tables: non-persistent buffers that meta init leaves empty; they
        stay float32 (cast per step), as in the reference."""
        self.model.rotary = RotaryEmbedding(self.cfg, self.max_positions).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the hidden states after this stage's layers, before the last norm, (T,
        hidden): the final ones with one pipeline stage. A later stage gets the previous
        stage's `hidden` instead of embedding `input_ids`."""
        h = self.model.embed_tokens(input_ids) if hidden is None else hidden
        cos, sin = self.model.rotary.cos_sin(positions, h.dtype)
        if self.decode_stack is not None:
            out = self.decode_stack(h, cos, sin, kv_caches, meta, backend)
            if out is not None:
                return out
        for layer, kv_cache in zip(self.model.held_layers(), kv_caches):
            h = layer(h, cos, sin, kv_cache, meta, backend)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, vocab) float32 logits, whole on every rank (gather_vocab)."""
        return gather_vocab(self.lm_head(self.model.norm(hidden)), self.tp, self.cfg.vocab_size).float()
