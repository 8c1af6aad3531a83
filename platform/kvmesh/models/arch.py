"""The architecture description kvmesh needs from an HF `config.json`.

Parsed from the raw JSON (not through transformers' config classes) so that
transformers 4.x and 5.x layouts both work: 5.x keeps RoPE settings under
`rope_parameters`, 4.x under `rope_theta` / `rope_scaling`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.errors import ModelNotFoundError

SLIDING, FULL = "sliding_attention", "full_attention"


def _rope_settings(params: dict[str, Any], theta_default: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from a 4.x `rope_scaling` dict or a 5.x `rope_parameters` one."""
    theta = float(params.get("rope_theta", theta_default))
    scaling = dict(params) if params.get("rope_type", params.get("type", "default")) != "default" else None
    if scaling is not None:
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return theta, scaling


@dataclass(frozen=True)
class ArchConfig:
    """One decoder-only architecture as kvmesh's models build it.

    The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) differs only in flags here
    (`qkv_bias`, `qk_norm`, ...); Gemma 3 adds its norm / scaling conventions; Mixtral and
    Qwen3-MoE add the `num_experts` block. Per-layer attention (`layer_types`) carries the
    sliding windows: `layer_windows[i]` is the number of most recent keys (the query's own
    included) layer i attends to, None for full attention.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # RoPE of the sliding layers where it differs (Gemma 3: base 10k local, 1M global).
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    qk_norm: bool = False  # Qwen3 / Gemma 3: RMSNorm over each head's q and k before RoPE
    norm_offset: float = 0.0  # Gemma: norms scale by (offset + weight)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    sandwich_norms: bool = False  # Gemma 3: norms after attention and around the MLP too
    hidden_act: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    # Mixture of experts (Mixtral, Qwen3-MoE): `moe_layers` are sparse, the rest dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ArchConfig":
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelNotFoundError(
                f"model: architecture {arch!r} is not supported; kvmesh serves "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                raise ModelNotFoundError(f"model: {arch} with {key}={cfg[key]} is not supported (no soft-capping)")
        rope = dict(cfg.get("rope_parameters") or {})
        factor = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
        if factor != 1.0:
            raise ModelNotFoundError(f"model: partial_rotary_factor={factor} is not supported (full RoPE only)")
        gemma = arch in ("Gemma3ForCausalLM", "Gemma3TextModel")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        n_layers = cfg["num_hidden_layers"]
        # transformers 5.x: rope_parameters, keyed by layer type where they differ (Gemma 3);
        # 4.x: rope_theta / rope_scaling (+ Gemma 3's rope_local_base_freq).
        if FULL in rope or SLIDING in rope:
            theta, scaling = _rope_settings(rope.get(FULL, {}), 10000.0)
            local_theta, local_scaling = _rope_settings(rope.get(SLIDING, rope.get(FULL, {})), 10000.0)
        else:
            legacy = dict(cfg.get("rope_scaling") or {})
            theta, scaling = _rope_settings({**rope, **legacy, "rope_theta": cfg.get("rope_theta", rope.get(
                "rope_theta", 10000.0))}, 10000.0)
            if not legacy and not rope:
                scaling = None
            local_theta, local_scaling = (float(cfg["rope_local_base_freq"]), None) if gemma else (None, None)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            if gemma:  # 4.x Gemma 3 configs: every `sliding_window_pattern`-th layer global
                pattern = cfg.get("sliding_window_pattern", 6)
                layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)]
            elif window and arch == "Qwen2ForCausalLM":  # sliding from max_window_layers up
                start = cfg.get("max_window_layers", n_layers)
                layer_types = [SLIDING if i >= start else FULL for i in range(n_layers)]
            else:
                layer_types = [SLIDING if window else FULL] * n_layers
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers or not set(layer_types) <= {SLIDING, FULL}:
            raise ModelNotFoundError(f"model: layer_types {list(layer_types)} is not {n_layers} of "
                                     f"{FULL!r} / {SLIDING!r}")
        if SLIDING not in layer_types:
            window = None
        elif not window:
            raise ModelNotFoundError("model: sliding-attention layers but no sliding_window size")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        moe_layers: tuple[int, ...] = ()
        if experts:
            step = cfg.get("decoder_sparse_step", 1) or 1
            dense = set(cfg.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ModelNotFoundError(f"model: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or 0,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            # Qwen2 has biases on q/k/v only; Llama's attention_bias covers q/k/v/o.
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=window,
            layer_types=layer_types,
            rope_local_theta=local_theta if gemma else None,
            rope_local_scaling=local_scaling if gemma else None,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=hidden**0.5 if gemma else None,
            sandwich_norms=gemma,
            hidden_act=act,
            attn_scale=cfg["query_pre_attn_scalar"] ** -0.5 if gemma else None,
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_layers=moe_layers,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: its sliding window (keys a query sees, itself included), None for full attention."""
        types = self.layer_types or (FULL,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING else None for t in types)

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides (Mistral): KV blocks wholly before it can be freed.
        None when any layer attends to the whole context (Gemma 3's global layers)."""
        windows = self.layer_windows
        return windows[0] if windows and None not in windows else None

    @property
    def head_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + 2 * h
        dense_mlp = 3 * h * self.intermediate_size
        sparse_mlp = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        n_moe = len(self.moe_layers)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * attn + (self.num_layers - n_moe) * dense_mlp + n_moe * sparse_mlp + emb + h


DENSE_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Phi3ForCausalLM", "Gemma3ForCausalLM"}
MOE_ARCHITECTURES = {"MixtralForCausalLM", "Qwen3MoeForCausalLM"}
QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES | MOE_ARCHITECTURES
