"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on kvmesh's paged attention.

The model consumes a flat batch: `input_ids` (T,), `positions` (T,) for all scheduled
tokens of all sequences, no padding. Q/K/V and gate/up projections are fused into one
Linear each (one GEMM instead of three / two); checkpoint shards are copied into
their slice by per-parameter `weight_loader`s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.layers import ops as layer_ops
from kvmesh.layers import triton_ops
from kvmesh.layers.attention import AttentionBackend, AttentionMetadata
from kvmesh.layers.cpu_kernels import fused
from kvmesh.layers.ops import SKINNY_KERNEL_ROWS, STACK_DENSE, Linear
from kvmesh.models.arch import ArchConfig
from kvmesh.models.rope import RotaryEmbedding, apply_rope


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")
    param.data.copy_(loaded)


class MergedLinear(Linear):
    """Several projections of the same input stacked on the output dim."""

    def __init__(self, in_features: int, out_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(out_sizes.values()), bias=bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in out_sizes.items():
            self.offsets[name] = (start, size)
            start += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        """Copy one checkpoint projection (e.g. "k") into its rows of the fused param."""
        start, size = self.offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard}: checkpoint has {loaded.shape[0]} rows, expected {size}")
        param.data.narrow(0, start, size).copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and triton_ops.enabled(x):
            return triton_ops.rms_norm(x, self.weight, self.eps)
        if fused(x) and x.dim() == 2:
            return torch.ops.kvmesh.rms_norm(x, self.weight, self.eps)
        # Normalize in float32 like the reference; the weight multiplies in model dtype.
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)

    def add_forward(self, residual: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + update, norm(residual + update)): one op (C++ on CPU, Triton on CUDA)."""
        if residual.dim() == 2 and triton_ops.enabled(residual):
            return triton_ops.add_rms_norm(residual, update, self.weight, self.eps)
        if fused(residual) and residual.dim() == 2:
            return torch.ops.kvmesh.add_rms_norm(residual, update, self.weight, self.eps)
        h = residual + update
        return h, self(h)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.qkv_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.q_size, self.kv_size = q, kv
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if triton_ops.enabled(qkv):
            q, k, v = triton_ops.rope_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        elif fused(qkv):
            q, k, v = torch.ops.kvmesh.rope_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)  # (T, H, D)
            k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)  # (T, KVH, D)
            v = v.view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": i, "up": i}, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias)
        self.intermediate_size = i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if triton_ops.enabled(gate_up):
            return self.down_proj(triton_ops.silu_and_mul(gate_up))
        if fused(gate_up):
            return self.down_proj(torch.ops.kvmesh.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h, cos, sin, kv_cache, meta, backend):
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, backend)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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

    def __init__(self, cfg: ArchConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
        stack = self._decode_stack_params(h, meta, backend)
        if stack is not None:
            attn = self.model.layers[0].self_attn
            return torch.ops.kvmesh.decode_stack(
                h, cos, sin, *stack, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], meta.slot_mapping,
                meta.decode_block_table, meta.decode_context_lens, attn.num_heads, attn.num_kv_heads,
                self.cfg.rms_norm_eps, attn.scale, SKINNY_KERNEL_ROWS)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta, backend)
        return h

    def _decode_stack_params(self, h: torch.Tensor, meta, backend) -> tuple | None:
        """The per-model arguments of `torch.ops.kvmesh.decode_stack` when this step can
        run the whole layer stack as that one C++ call (csrc/decode_stack.cpp), else None.

        It can when the step is all decodes on the CPU paged-attention backend and either
        - it has at most SKINNY_KERNEL_ROWS tokens and every projection says how the op runs
          it (`stack_linear`: a float32 / bf16 `Linear`, or, in a float32 model, an int8 /
          int4 `QuantLinear` on kvmesh's CPU kernel), or
        - it has a number of tokens in the small-batch GEMM's window (layers/ops.py
          SMALL_GEMM_ROWS), the model is float32 and every projection a dense `Linear`:
        exactly the steps whose layer-by-layer path runs the same C++ kernels one Python call
        at a time, so both paths give the same bits (at 8-64 rows the loop's Python and
        dispatch cost the issue16 workload ~8%: 229-231 -> 250-251 tok/s with the stack).
        Anything else (prefill, other backends) takes the loop."""
        t = h.shape[0]
        if (not getattr(backend, "runs_decode_stack", False) or meta.prefills or meta.num_decodes != t
                or not fused(h)):
            return None
        small = t > SKINNY_KERNEL_ROWS
        lo, hi = layer_ops.SMALL_GEMM_ROWS
        if small and not (layer_ops.SMALL_GEMM and lo <= t <= hi and h.dtype == torch.float32):
            return None
        if self._stack_params is None:  # gathered once: ~800 module attribute reads, 1 ms a step
            self._stack_params = self._gather_stack_params() or False
        if not self._stack_params or (small and any(k != STACK_DENSE for k in self._stack_params[2])):
            return None
        return self._stack_params

    _stack_params: tuple | bool | None = None

    def _gather_stack_params(self) -> tuple | None:
        """decode_stack's per-model arguments: norms, linear tensors, kinds, kernels, biases;
        None when a projection has no `stack_linear` form (e.g. act-order int4, or a
        quantized layer in a bf16 model)."""
        norms: list[torch.Tensor] = []
        tensors: list[torch.Tensor] = []
        kinds: list[int] = []
        kernels: list[int] = []
        biases: list[torch.Tensor | None] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                form = module.stack_linear() if hasattr(module, "stack_linear") else None
                if form is None:
                    return None
                kind, ts, kernel = form
                if kind != STACK_DENSE and layer.input_layernorm.weight.dtype != torch.float32:
                    return None  # the quantized kernels take float32 activations only
                kinds.append(kind)
                tensors += ts
                kernels.append(kernel)
                biases.append(module.bias)
        return norms, tensors, kinds, kernels, biases

    def invalidate_decode_stack(self) -> None:
        """Forget the gathered decode_stack parameters: call after replacing a layer's module
        (moving or casting the model, and loading weights, do it themselves)."""
        self._stack_params = None

    def _apply(self, fn, recurse: bool = True):
        self.invalidate_decode_stack()
        return super()._apply(fn, recurse)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into parameters; every parameter must be set."""
        self.invalidate_decode_stack()
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
            if shard is not None:
                self.get_submodule(target.rsplit(".", 1)[0]).weight_loader(param, tensor, shard)
                loaded.add(f"{target}:{shard}")
            else:
                default_weight_loader(param, tensor)
                loaded.add(target)
        expected = set()
        for pname, param in params.items():
            owner = pname.rsplit(".", 1)[0]
            module = self.get_submodule(owner)
            if isinstance(module, MergedLinear):
                expected.update(f"{pname}:{s}" for s in module.offsets)
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
