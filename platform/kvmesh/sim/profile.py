"""Step-time model: how long one engine step takes, from what the scheduler put in it.

    t(step) = step_overhead_s                         weights read, launches, sampling
            + per_token_s  * sum(n_i)                 linear layers, every scheduled token
            + attn_pair_s  * sum over prefill chunks of n_i * (start_i + (n_i + 1) / 2)
            + decode_ctx_s * sum over decodes of (start_i + 1)     KV read per decode

where n_i are the tokens scheduled for sequence i at positions start_i... (a prefill
chunk attends to its cached / earlier context plus a causal triangle of itself; a decode
reads its whole context). Cached prefix tokens are never scheduled, so they cost nothing
beyond the context they add. `kvmesh sim calibrate` fits the four coefficients to
measured steps of the local engine; GPU_PROFILES derives them from datasheet numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvmesh.engine.outputs import SchedulerOutput


class StepProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Profile name (hardware + model).")
    description: str = Field("", description="Where the numbers come from.")
    step_overhead_s: float = Field(ge=0, description="Fixed cost of a step, seconds.")
    per_token_s: float = Field(ge=0, description="Cost per scheduled token (linear layers), seconds.")
    attn_pair_s: float = Field(ge=0, description="Cost per (query, key) pair of prefill attention, seconds.")
    decode_ctx_s: float = Field(ge=0, description="Cost per context token of a decoding sequence, seconds.")
    kv_capacity_tokens: int = Field(gt=0, description="KV cache size of one worker, tokens.")

    def step_time(self, sched: SchedulerOutput) -> float:
        tokens, pairs, ctx = step_features(sched)
        return (self.step_overhead_s + self.per_token_s * tokens + self.attn_pair_s * pairs
                + self.decode_ctx_s * ctx)

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        """step_time of a decode-only step: `num_seqs` sequences reading `context_tokens` in all."""
        return self.step_overhead_s + self.per_token_s * num_seqs + self.decode_ctx_s * context_tokens

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")


def step_features(sched: SchedulerOutput) -> tuple[float, float, float]:
    """(scheduled tokens, prefill query-key pairs, decode context tokens) of a step."""
    tokens = pairs = ctx = 0.0
    for seq in sched.seqs:
        n = len(seq.token_ids)
        tokens += n
        if n == 1:
            ctx += seq.start_pos + 1
        else:
            pairs += n * (seq.start_pos + (n + 1) / 2)
    return tokens, pairs, ctx


def fit_profile(samples: list[tuple[float, float, float, float]], name: str, kv_capacity_tokens: int,
                description: str = "") -> StepProfile:
    """Least-squares fit of the four coefficients to measured steps
    (tokens, pairs, context, seconds); negative coefficients are clipped to 0."""
    if len(samples) < 4:
        raise ValueError(f"need at least 4 measured steps to fit 4 coefficients, got {len(samples)}")
    x = np.array([[1.0, t, p, c] for t, p, c, _ in samples])
    y = np.array([s for *_, s in samples])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.clip(coef, 0.0, None)
    return StepProfile(name=name, description=description, step_overhead_s=float(coef[0]),
                       per_token_s=float(coef[1]), attn_pair_s=float(coef[2]), decode_ctx_s=float(coef[3]),
                       kv_capacity_tokens=kv_capacity_tokens)


# -- GPU profiles from datasheets ------------------------------------------------------
#
# Assumptions (stated so they can be argued with):
# - bf16 weights and KV; dense peak FLOP/s from the datasheet at 50% MFU for prefill
#   math; HBM bandwidth at 80% for weight and KV reads;
# - step_overhead = weight bytes / effective bandwidth + 2 ms (launch, sampling, host);
# - per_token = 2 * params / effective FLOP/s;
# - attn_pair = 4 * layers * (heads * head_dim) / effective FLOP/s (QK^T and PV);
# - decode_ctx = KV bytes per token (2 * layers * kv_heads * head_dim * 2 B) / bandwidth;
# - KV capacity = (90% of memory - weights) / KV bytes per token;
# - tensor parallelism divides every cost by tp and multiplies memory by tp (ideal).

_GPUS = {  # name: (dense bf16 FLOP/s, HBM bytes/s, memory bytes)
    "a100-80g": (312e12, 2.04e12, 80e9),
    "h100-sxm": (989e12, 3.35e12, 80e9),
    "h200": (989e12, 4.8e12, 141e9),
    "l4": (121e12, 0.3e12, 24e9),
}
_MODELS = {  # name: (params, layers, heads * head_dim, kv_heads * head_dim)
    "llama3-8b": (8.03e9, 32, 4096, 1024),
    "llama3-70b": (70.6e9, 80, 8192, 1024),
}


def gpu_profile(gpu: str, model: str, tp: int = 1, mfu: float = 0.5, bw_eff: float = 0.8) -> StepProfile:
    flops, bw, mem = _GPUS[gpu]
    params, layers, hidden, kv_dim = _MODELS[model]
    flops, bw, mem = flops * mfu * tp, bw * bw_eff * tp, mem * tp
    weight_bytes = 2 * params
    kv_bytes = 2 * layers * kv_dim * 2
    capacity = int((0.9 * mem - weight_bytes) / kv_bytes)
    if capacity <= 0:
        raise ValueError(f"{model} does not fit on {tp} x {gpu}; raise tp")
    return StepProfile(
        name=f"{gpu}-{model}" + (f"-tp{tp}" if tp > 1 else ""),
        description=f"datasheet-derived: {tp} x {gpu}, {model} bf16, {mfu:.0%} MFU, {bw_eff:.0%} HBM bandwidth",
        step_overhead_s=weight_bytes / bw + 2e-3, per_token_s=2 * params / flops,
        attn_pair_s=4 * layers * hidden / flops, decode_ctx_s=kv_bytes / bw, kv_capacity_tokens=capacity)


GPU_PROFILES: dict[str, StepProfile] = {
    p.name: p for p in (
        gpu_profile("h100-sxm", "llama3-8b"), gpu_profile("a100-80g", "llama3-8b"),
        gpu_profile("h200", "llama3-8b"), gpu_profile("l4", "llama3-8b"),
        gpu_profile("h100-sxm", "llama3-70b", tp=4), gpu_profile("a100-80g", "llama3-70b", tp=8),
    )
}


def load_profile(name_or_path: str) -> StepProfile:
    """A GPU_PROFILES name or a JSON file written by `kvmesh sim calibrate`."""
    if name_or_path in GPU_PROFILES:
        return GPU_PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"profile {name_or_path!r} is neither a file nor one of {sorted(GPU_PROFILES)}")
    return StepProfile.model_validate(json.loads(path.read_text()))
