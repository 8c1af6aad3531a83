"""Train a LoRA adapter instead of a whole student, and write it as `peft` does.

`kvmesh optimize distill TEACHER BASE OUT --lora-rank R` distils the teacher into a
low-rank adapter on a frozen BASE: the output is a PEFT folder (adapter_config.json +
adapter_model.safetensors) that `kvmesh serve --enable-lora --lora-modules name=OUT`
serves next to other adapters of the same BASE, instead of another full copy of the
model. It fits where the student keeps the base's architecture and weights (a fine-tune
re-created on the base, or a family of teachers distilled onto one serving base); a
pruned student that changes shapes is a new base, so it stays a full checkpoint.

The wrapper is our own (a frozen `nn.Linear` plus A (r, in) and B (out, r), B zero at the
start so training starts from the base), kept in the layout peft writes, so `peft` and
the kvmesh engine read the adapter alike: tensor names
`base_model.model.<module path>.lora_{A,B}.weight`, scaling lora_alpha / r.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from kvmesh.errors import ConfigError

# The attention and MLP projections of the Llama-family decoders kvmesh serves.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRALinear(nn.Module):
    """y = base(x) + (x A^T) B^T * alpha / r, with `base` frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # peft's default for A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * self.scaling


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[str]:
    """Wrap every nn.Linear of `model` whose attribute name is in `targets`; freeze all the rest.
    Returns the wrapped modules' paths."""
    if rank < 1:
        raise ConfigError(f"--lora-rank: {rank} must be >= 1")
    model.requires_grad_(False)
    wrapped = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
                wrapped.append(f"{path}.{name}" if path else name)
    if not wrapped:
        raise ConfigError(f"--lora-rank: the student has no linear layers named {', '.join(targets)}")
    return wrapped


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's names."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[f"base_model.model.{path}.lora_A.weight"] = module.lora_A.detach().contiguous().clone()
            out[f"base_model.model.{path}.lora_B.weight"] = module.lora_B.detach().contiguous().clone()
    return out


def save_adapter(model: nn.Module, out: Path, base_path: Path, rank: int, alpha: float) -> Path:
    """Write `out` as a peft LoRA folder for the base model at `base_path`."""
    from safetensors.torch import save_file

    tensors = lora_state_dict(model)
    targets = sorted({k.split(".")[-3] for k in tensors})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_path),
              "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": targets, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "init_lora_weights": True,
              "inference_mode": True}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
