"""Rotary position embeddings, including the common `rope_scaling` variants.

Frequencies follow transformers' `_compute_*_parameters` so that cos/sin tables are
bit-identical to the reference implementation in float32.
"""

from __future__ import annotations

import math

import torch

from kvmesh.models.arch import ArchConfig


def inv_frequencies(cfg: ArchConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq (D/2,), attention_factor applied to cos/sin); `local`: the sliding
    layers' RoPE where the architecture gives them their own (Gemma 3)."""
    dim = cfg.head_dim
    base = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_local_scaling if local else cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor = scaling["factor"]
        old_ctx = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo = max(math.floor(corr_dim(beta_fast)), 0)
        hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrap = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrap) + inv_freq * extrap
        return inv, mscale
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (linear, llama3, yarn)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, local: bool = False):
        super().__init__()
        if torch.empty(()).is_meta:
            # A meta build (the loaders'): shapes only, the tables come with init_rotary once
            # the model is on its device (computing them on meta runs torch's Python
            # references, whose first call imports torch._dynamo: 1-1.5 s of a process start).
            self.register_buffer("cos", torch.empty(max_positions, cfg.head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, cfg.head_dim), persistent=False)
            return
        inv_freq, attn_factor = inv_frequencies(cfg, local)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # (T, 1, D): broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
