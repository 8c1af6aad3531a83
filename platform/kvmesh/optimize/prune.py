"""Structured pruning of Llama-family checkpoints with calibration text.

Three granularities, all scored in one calibration pass over the unpruned model:

* whole decoder layers, by block influence (ShortGPT, Men et al. 2024):
  BI_l = 1 - mean_t cos(h_in[t], h_out[t]); the lowest BI changes the residual stream
  least and is dropped first;
* attention heads, as whole GQA groups (one KV head with the query heads that read
  it), by activation-weighted magnitude (Wanda, Sun et al. 2023) of the group's
  o_proj columns: sum_i |W_o[i, c]| * ||o_c|| over the group's head-output features c;
* MLP channels (rows of gate/up, column of down) by the same score of their down_proj
  column, sum_i |W_down[i, j]| * ||a_j||.

||x_c|| is the L2 norm of input feature c over all calibration tokens. The output
projection's input already carries each unit's input-side weights (q/k/v, gate/up),
so its score is the unit's whole contribution: exactly 0 for a unit that never writes. head_dim and
hidden_size never change, so the result is an ordinary HF Llama config; HF configs
cannot vary head counts or MLP widths per layer, so every kept layer keeps the same
number of KV groups and channels (which ones may differ per layer).

The output folder is a plain HF checkpoint (config.json, model.safetensors, the
tokenizer files) plus ``kvmesh_optimize.json`` recording what was kept.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvmesh.errors import ConfigError
from kvmesh.models.arch import ArchConfig
from kvmesh.models.loader import iter_safetensors

META_FILE = "kvmesh_optimize.json"
_WEIGHT_FILES = re.compile(r".*\.safetensors(\.index\.json)?$")
_NOT_COPIED = {"config.json", META_FILE, ".complete"}


# ---------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class PruneShape:
    """The target shape: layers / query heads / MLP width kept (None = unchanged)."""

    num_layers: int
    num_heads: int
    intermediate_size: int


def count_params(cfg: ArchConfig, shape: PruneShape | None = None) -> int:
    """Parameters of `cfg`, or of `cfg` pruned to `shape` (weights + norms, no biases)."""
    if shape is None:
        return cfg.num_params
    kv = shape.num_heads * cfg.num_kv_heads // cfg.num_heads
    return _replace(cfg, shape.num_layers, shape.num_heads, kv, shape.intermediate_size).num_params


def _replace(cfg: ArchConfig, layers: int, heads: int, kv: int, inter: int) -> ArchConfig:
    from dataclasses import replace

    return replace(cfg, num_layers=layers, num_heads=heads, num_kv_heads=kv, intermediate_size=inter)


def parse_param_count(text: str, current: int) -> int:
    """'100M', '1.2B', '75000', or '75%' (of `current`) -> a parameter count."""
    s = text.strip().upper().replace("_", "")
    try:
        if s.endswith("%"):
            return int(current * float(s[:-1]) / 100)
        mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(s[-1:], 1)
        return int(float(s[:-1] if mult != 1 else s) * mult)
    except ValueError:
        raise ConfigError(f"--target-params: cannot read {text!r}; write e.g. 100M, 1.2B, 75000 or 75%") from None


def _channel_multiple(intermediate: int) -> int:
    return 8 if intermediate % 8 == 0 and intermediate >= 64 else 1


def shape_for_target(cfg: ArchConfig, target: int, depth_share: float = 0.5,
                     min_mlp_ratio: float = 0.25) -> PruneShape:
    """The mix of depth and width pruning that lands on (just under) `target` parameters.

    1. Depth: drop floor(depth_share * (N - target) / params_per_layer) whole layers
       (ShortGPT: the least influential layers are nearly free to drop; depth also
       speeds up batch-1 decoding most).
    2. Width: the rest of the budget comes from MLP channels, the width unit that is
       ~2/3 of a Llama layer and finely divisible: the largest width (a multiple of 8)
       that keeps the total <= target.
    3. If that width falls below min_mlp_ratio of the original, drop one KV group
       (with its query heads) per layer and retry; if even one KV group per layer
       cannot fit, drop one more layer and start step 2 again.
    The result is <= target and within one rounding unit (8 channels x layers) of it.
    """
    total = cfg.num_params
    if not 0.0 <= depth_share <= 1.0:
        raise ConfigError(f"--depth-share: {depth_share} is outside [0, 1]")
    if target >= total:
        raise ConfigError(f"--target-params: {target:,} is not below the model's {total:,} parameters")
    per_layer = (total - count_params(cfg, PruneShape(0, cfg.num_heads, cfg.intermediate_size))) // cfg.num_layers
    layers = cfg.num_layers - min(int(depth_share * (total - target) // per_layer), cfg.num_layers - 1)
    group = cfg.num_heads // cfg.num_kv_heads
    mult = _channel_multiple(cfg.intermediate_size)
    while layers >= 1:
        for kv in range(cfg.num_kv_heads, 0, -1):
            heads = kv * group
            zero_mlp = count_params(cfg, PruneShape(layers, heads, 0))
            per_channel = 3 * cfg.hidden_size * layers
            inter = min((target - zero_mlp) // per_channel // mult * mult, cfg.intermediate_size)
            if inter >= max(mult, math.ceil(min_mlp_ratio * cfg.intermediate_size)) or (kv == 1 and inter >= mult):
                return PruneShape(layers, heads, int(inter))
        layers -= 1
    smallest = count_params(cfg, PruneShape(1, group, mult))
    raise ConfigError(f"--target-params: {target:,} is below the smallest prunable shape ({smallest:,}: one layer, "
                      f"one KV group, {mult} MLP channels); ask for more parameters")


# ---------------------------------------------------------------------- calibration


@dataclass
class CalibrationStats:
    """What one calibration pass measures, per decoder layer.

    block_influence[l]: 1 - mean cos(h_in, h_out) of layer l.
    *_norm[l]: (features,) L2 norm over all tokens of the input to that projection:
    o_in = o_proj input (the heads' outputs), down_in = down_proj input (the MLP channels).
    """

    block_influence: list[float]
    o_in_norm: list[torch.Tensor]
    down_in_norm: list[torch.Tensor]
    num_tokens: int = 0


def _decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


@torch.inference_mode()
def calibrate(model, windows: list[list[int]], progress: bool = True) -> CalibrationStats:
    """Run `windows` (token id lists) through an HF causal LM and collect CalibrationStats."""
    from tqdm.auto import tqdm

    layers = _decoder_layers(model)
    n = len(layers)
    cos_sum = [0.0] * n
    sq: dict[tuple[str, int], torch.Tensor] = {}
    hooks = []

    def add_sq(key, x):
        s = x.detach().float().reshape(-1, x.shape[-1]).pow(2).sum(0)
        sq[key] = sq[key] + s if key in sq else s

    for i, layer in enumerate(layers):
        def layer_hook(mod, args, kwargs, out, i=i):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = out[0] if isinstance(out, tuple) else out
            cos = torch.nn.functional.cosine_similarity(h_in.float(), h_out.float(), dim=-1)
            cos_sum[i] += float(cos.sum())

        hooks.append(layer.register_forward_hook(layer_hook, with_kwargs=True))
        for key, mod in (("o_in", layer.self_attn.o_proj), ("down_in", layer.mlp.down_proj)):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, key=key, i=i: add_sq((key, i), a[0])))
    tokens = 0
    try:
        for w in tqdm(windows, desc="calibrating", unit="window", disable=not progress):
            model(torch.tensor([w]), use_cache=False)
            tokens += len(w)
    finally:
        for h in hooks:
            h.remove()
    norms = {k: [sq[(k, i)].sqrt() for i in range(n)] for k in ("o_in", "down_in")}
    return CalibrationStats([1.0 - c / tokens for c in cos_sum], norms["o_in"], norms["down_in"], tokens)


# ---------------------------------------------------------------------------- scores


def layer_order(stats: CalibrationStats) -> list[int]:
    """Layer indices, least influential (first to drop) first."""
    return sorted(range(len(stats.block_influence)), key=lambda i: stats.block_influence[i])


def mlp_channel_scores(sd: dict[str, torch.Tensor], prefix: str, down_in: torch.Tensor) -> torch.Tensor:
    """(I,) Wanda score of each MLP channel: sum_i |W_down[i, j]| * ||a_j||.

    a_j = silu(gate_j(x)) * up_j(x) already carries the channel's gate/up weights, so
    the down column's score is the channel's whole contribution (0 for a dead channel).
    """
    d = sd[f"{prefix}.mlp.down_proj.weight"].float()
    return (d.abs() * down_in[None, :]).sum(0)


def kv_group_scores(sd: dict[str, torch.Tensor], prefix: str, cfg: ArchConfig, o_in: torch.Tensor) -> torch.Tensor:
    """(KV,) Wanda score of each GQA group: its query heads' o_proj columns, sum |W_o[i, c]| * ||o_c||.

    o_c (the attention output) already carries the group's q/k/v weights.
    """
    r = cfg.num_heads // cfg.num_kv_heads
    o = sd[f"{prefix}.self_attn.o_proj.weight"].float()
    return (o.abs() * o_in[None, :]).sum(0).view(cfg.num_kv_heads, r * cfg.head_dim).sum(1)


# ------------------------------------------------------------------------------ plan


@dataclass
class PrunePlan:
    """Which layers (original indices, in order), KV groups and MLP channels are kept."""

    kept_layers: list[int]
    kept_kv_groups: list[list[int]] = field(default_factory=list)  # per kept layer, sorted
    kept_channels: list[list[int]] = field(default_factory=list)  # per kept layer, sorted


def _top(scores: torch.Tensor, k: int) -> list[int]:
    return sorted(torch.topk(scores, k).indices.tolist())


def make_plan(sd: dict[str, torch.Tensor], cfg: ArchConfig, stats: CalibrationStats, shape: PruneShape) -> PrunePlan:
    """Choose what to keep for `shape` from the calibration statistics."""
    drop = set(layer_order(stats)[: cfg.num_layers - shape.num_layers])
    kept = [i for i in range(cfg.num_layers) if i not in drop]
    n_kv = shape.num_heads * cfg.num_kv_heads // cfg.num_heads
    plan = PrunePlan(kept)
    for i in kept:
        p = f"model.layers.{i}"
        plan.kept_kv_groups.append(list(range(cfg.num_kv_heads)) if n_kv == cfg.num_kv_heads else
                                   _top(kv_group_scores(sd, p, cfg, stats.o_in_norm[i]), n_kv))
        plan.kept_channels.append(
            list(range(cfg.intermediate_size)) if shape.intermediate_size == cfg.intermediate_size else
            _top(mlp_channel_scores(sd, p, stats.down_in_norm[i]), shape.intermediate_size))
    return plan


def apply_plan(sd: dict[str, torch.Tensor], cfg: ArchConfig, plan: PrunePlan) -> dict[str, torch.Tensor]:
    """A new state dict (HF names) holding only the kept layers, groups and channels."""
    d, r = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    out = {k: v for k, v in sd.items() if not k.startswith("model.layers.") and "rotary_emb" not in k}
    for new, (old, groups, chans) in enumerate(zip(plan.kept_layers, plan.kept_kv_groups, plan.kept_channels)):
        q_idx = torch.tensor([g * r * d + j for g in groups for j in range(r * d)])
        kv_idx = torch.tensor([g * d + j for g in groups for j in range(d)])
        ch = torch.tensor(chans)
        rows = {"q_proj": q_idx, "k_proj": kv_idx, "v_proj": kv_idx, "gate_proj": ch, "up_proj": ch}
        cols = {"o_proj": q_idx, "down_proj": ch}
        src, dst = f"model.layers.{old}.", f"model.layers.{new}."
        for name, t in sd.items():
            if not name.startswith(src) or "rotary_emb" in name:
                continue
            module = name[len(src):].split(".")[-2]
            if module in rows:
                t = t.index_select(0, rows[module])
            elif module in cols and name.endswith(".weight"):
                t = t.index_select(1, cols[module])
            out[dst + name[len(src):]] = t.contiguous()
    return out


# ------------------------------------------------------------------------------- I/O


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(path))


def pruned_config(src: dict, cfg: ArchConfig, plan: PrunePlan) -> dict:
    """The source config.json with the pruned sizes (and explicit head_dim / rope_theta)."""
    out = dict(src)
    groups = len(plan.kept_kv_groups[0]) if plan.kept_kv_groups else cfg.num_kv_heads
    out.update(num_hidden_layers=len(plan.kept_layers), num_key_value_heads=groups,
               num_attention_heads=groups * cfg.num_heads // cfg.num_kv_heads,
               intermediate_size=len(plan.kept_channels[0]) if plan.kept_channels else cfg.intermediate_size,
               head_dim=cfg.head_dim, rope_theta=cfg.rope_theta)  # head_dim no longer = hidden / heads
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = [out["layer_types"][i] for i in plan.kept_layers]
    return out


def write_checkpoint(out: Path, config: dict, state_dict: dict[str, torch.Tensor], tokenizer_src: Path,
                     meta: dict) -> Path:
    """Write an HF folder: config.json, model.safetensors, tokenizer files from `tokenizer_src`, META_FILE."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in state_dict.items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = {**config, "torch_dtype": dtype}
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in sorted(tokenizer_src.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED and not _WEIGHT_FILES.match(f.name):
            shutil.copy2(f, out / f.name)
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def check_output_folder(out: Path) -> None:
    """Refuse to overwrite a folder that holds anything but a previous kvmesh output."""
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / META_FILE).is_file()):
        raise ConfigError(f"OUT: {str(out)!r} exists and is not empty; pass a new or empty folder")


# ---------------------------------------------------------------------------- driver


@dataclass
class PruneResult:
    out: Path
    params_before: int
    params_after: int
    shape: PruneShape
    plan: PrunePlan


# The layouts the pruning plan (and the first-layers student) knows: the dense Llama family.
PRUNABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def require_prunable(cfg: ArchConfig) -> None:
    """A clear refusal for layouts the plan would silently get wrong (q/k norms, experts,
    Gemma's norms and per-layer RoPE)."""
    if cfg.architecture not in PRUNABLE_ARCHITECTURES:
        raise ConfigError(f"optimize: pruning and distillation handle the dense Llama layout "
                          f"({', '.join(PRUNABLE_ARCHITECTURES)}); {cfg.architecture} is served but not prunable yet")


def resolve_shape(cfg: ArchConfig, target_params: str | None = None, drop_layers: int | None = None,
                  heads: int | None = None, mlp_ratio: float | None = None, depth_share: float = 0.5) -> PruneShape:
    """Turn the CLI's choices into a PruneShape, with errors that name the flag to change."""
    require_prunable(cfg)
    if target_params is not None:
        if drop_layers is not None or heads is not None or mlp_ratio is not None:
            raise ConfigError("--target-params chooses the mix itself: drop --drop-layers / --heads / --mlp-ratio")
        return shape_for_target(cfg, parse_param_count(target_params, cfg.num_params), depth_share)
    if drop_layers is None and heads is None and mlp_ratio is None:
        raise ConfigError("nothing to prune: give --target-params, or any of --drop-layers / --heads / --mlp-ratio")
    layers = cfg.num_layers - (drop_layers or 0)
    if drop_layers is not None and not 0 <= drop_layers < cfg.num_layers:
        raise ConfigError(f"--drop-layers: {drop_layers} must be in [0, {cfg.num_layers - 1}] "
                          f"(the model has {cfg.num_layers} layers)")
    group = cfg.num_heads // cfg.num_kv_heads
    if heads is not None and (heads < group or heads > cfg.num_heads or heads % group):
        valid = list(range(group, cfg.num_heads + 1, group))
        raise ConfigError(f"--heads: {heads} query heads cannot be kept; heads go in GQA groups of {group} "
                          f"(one KV head each), so pass one of {valid}")
    if mlp_ratio is not None and not 0.0 < mlp_ratio <= 1.0:
        raise ConfigError(f"--mlp-ratio: {mlp_ratio} must be in (0, 1]")
    mult = _channel_multiple(cfg.intermediate_size)
    inter = cfg.intermediate_size if mlp_ratio is None else max(mult, round(mlp_ratio * cfg.intermediate_size / mult) * mult)
    return PruneShape(layers, heads or cfg.num_heads, min(inter, cfg.intermediate_size))


def prune_checkpoint(src: Path, out: Path, shape: PruneShape, windows: list[list[int]],
                     progress: bool = True) -> PruneResult:
    """Calibrate on `windows`, prune `src` to `shape` and write the HF folder `out`."""
    from transformers import AutoModelForCausalLM

    check_output_folder(out)
    raw = read_config(src)
    cfg = ArchConfig.from_hf(raw)
    require_prunable(cfg)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    stats = calibrate(model, windows, progress)
    del model
    sd = load_state_dict(src)
    plan = make_plan(sd, cfg, stats, shape)
    new_sd = apply_plan(sd, cfg, plan)
    new_cfg = pruned_config(raw, cfg, plan)
    meta = {"kind": "prune", "source": str(src), "teacher_layers": plan.kept_layers, "shape": asdict(shape),
            "params_before": cfg.num_params, "params_after": ArchConfig.from_hf(new_cfg).num_params,
            "calibration_tokens": stats.num_tokens, "block_influence": stats.block_influence,
            "kept_kv_groups": plan.kept_kv_groups}
    write_checkpoint(out, new_cfg, new_sd, src, meta)
    return PruneResult(out, cfg.num_params, meta["params_after"], shape, plan)


def first_layers_checkpoint(src: Path, out: Path, k: int) -> Path:
    """The teacher's first `k` decoder layers (plus embeddings, final norm, head) as a folder."""
    raw = read_config(src)
    cfg = ArchConfig.from_hf(raw)
    require_prunable(cfg)
    if not 1 <= k <= cfg.num_layers:
        raise ConfigError(f"--student first-layers:{k}: K must be in [1, {cfg.num_layers}]")
    check_output_folder(out)
    plan = PrunePlan(list(range(k)), [list(range(cfg.num_kv_heads))] * k, [list(range(cfg.intermediate_size))] * k)
    new_cfg = pruned_config(raw, cfg, plan)
    meta = {"kind": "first-layers", "source": str(src), "teacher_layers": plan.kept_layers,
            "params_after": ArchConfig.from_hf(new_cfg).num_params}
    return write_checkpoint(out, new_cfg, apply_plan(load_state_dict(src), cfg, plan), src, meta)
