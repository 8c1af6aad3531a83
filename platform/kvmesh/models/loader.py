"""Build a float model on the right device and dtype and load its weights.

Quantized checkpoints and `--quantization` go through `kvmesh.quant.loader.load_model`,
which calls `load_float_model` for float weights (models never imports quant).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvmesh.checkpoint.files import iter_safetensors, load_tokenizer, model_fingerprint, resolve_model_path
from kvmesh.config import KernelConfig
from kvmesh.layers.op import OpContext, PipelineStage, TPGroup
from kvmesh.models.arch import ArchConfig
from kvmesh.models.registry import model_class

__all__ = ["build_meta_model", "iter_safetensors", "load_arch_config", "load_float_model", "load_tokenizer", "model_fingerprint",
           "op_context", "resolve_model_path", "stage_weights"]


def load_arch_config(path: Path) -> ArchConfig:
    with open(path / "config.json") as f:
        return ArchConfig.from_hf(json.load(f))


def op_context(device, dtype: torch.dtype, kernels: KernelConfig | None, tp: TPGroup | None = None,
               pp: PipelineStage | None = None) -> OpContext:
    """The context every layer of a model built for `device` / `dtype` picks its backend from;
    `tp`: this rank's tensor-parallel group (None: one rank); `pp`: its pipeline stage (None:
    every layer)."""
    return OpContext(torch.device(device), dtype, kernels or KernelConfig(), tp or TPGroup(), pp or PipelineStage())


def build_meta_model(cfg: ArchConfig, max_positions: int, dtype: torch.dtype, kernels: KernelConfig | None = None):
    """The whole model (every layer, one rank's shapes) on the meta device: no memory; what
    names and shapes are checked against on a rank that holds only a shard or a stage."""
    with torch.device("meta"):
        return model_class(cfg)(cfg, max_positions, op_context("meta", dtype, kernels))


def stage_weights(model, weights):
    """The checkpoint tensors this pipeline stage's model holds (all of them with one stage)."""
    return ((name, tensor) for name, tensor in weights if model.holds(name))


def load_float_model(path: Path, dtype, device, max_positions: int, kernels: KernelConfig | None = None,
                     tp: TPGroup | None = None, pp: PipelineStage | None = None):
    """Build the float model for `path` and load its weights (this rank's shard of them, for
    a `tp` group of several ranks; this stage's layers, for a `pp` stage); returns (model,
    ArchConfig)."""
    cfg = load_arch_config(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions, op_context(device, dtype, kernels, tp, pp))
    # Materialize uninitialized storage: every parameter is overwritten by the load.
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings and (pp is None or pp.first):  # to_empty gives each module its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(stage_weights(model, iter_safetensors(path)))
    model = model.to(dtype=dtype)
    model.init_rotary(device)
    model.eval()
    return model, cfg


