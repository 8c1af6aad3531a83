"""Which model class builds which architecture (config.json `architectures[0]`)."""

from __future__ import annotations

from torch import nn

from kvmesh.models.arch import SUPPORTED_ARCHITECTURES, ArchConfig
from kvmesh.models.gemma3 import Gemma3ForCausalLM
from kvmesh.models.llama import LlamaForCausalLM

# Every architecture ArchConfig accepts; the Llama decoder covers the family's flags
# (q/k norm, fused checkpoint projections, sliding windows, sparse MoE layers).
MODEL_CLASSES: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
MODEL_CLASSES["Gemma3ForCausalLM"] = Gemma3ForCausalLM


def model_class(cfg: ArchConfig) -> type[nn.Module]:
    return MODEL_CLASSES[cfg.architecture]
