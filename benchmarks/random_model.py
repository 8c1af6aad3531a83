"""Random-weight checkpoints at realistic shapes, as throughput workloads kvmesh and its
peers load from the same folder (no hub here: real MoE weights do not install offline).

Each preset is a transformers config scaled to fit 2 cores and 24 GiB; every parameter is
drawn at random (seeded: the same folder on every machine), the embedded model's tokenizer
is copied beside it (its vocabulary sets ``vocab_size``), so the text workloads of
``engine_throughput.py`` tokenize as they do for SmolLM2. Greedy outputs of random weights
are gibberish, but they are still deterministic: kvmesh's and vLLM's must agree.

    python benchmarks/random_model.py qwen3-moe-small          # prints the folder
    python benchmarks/engine_throughput.py --model "$(python benchmarks/random_model.py qwen3-moe-small)" ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HIDDEN = 512
# name -> (transformers config class, model class, config keys)
PRESETS = {
    # Qwen3-30B-A3B's layout scaled down: 32 experts, 4 active, q/k norm, no shared experts.
    "qwen3-moe-small": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6)),
    # Mixtral's layout scaled down: 8 experts, 2 active.
    "mixtral-small": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=768, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        rope_theta=1e6, sliding_window=None)),
    # qwen3-dense-small without q/k norm: Llama's layer, the one the CPU decode stack runs.
    "llama-small": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, max_position_embeddings=4096, rope_theta=1e6)),
    # The dense model of the same active parameters as qwen3-moe-small (4 x 256 = 1024 wide MLP).
    "qwen3-dense-small": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, max_position_embeddings=4096, rope_theta=1e6)),
}


def folder_for(name: str) -> Path:
    from kvmesh.checkpoint.embedded import cache_dir

    return cache_dir() / "random-models" / name


def build(name: str, seed: int = 0) -> Path:
    """The preset's folder, written on first use (a complete folder is reused)."""
    import torch
    import transformers
    from tqdm.auto import tqdm

    from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path

    out = folder_for(name)
    if (out / ".complete").exists():
        return out
    config_cls, model_cls, keys = PRESETS[name]
    embedded = resolve_model_path(None)
    tokenizer = load_tokenizer(embedded)
    cfg = getattr(transformers, config_cls)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                            eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **keys)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in tqdm(list(model.named_parameters()), desc=f"randomizing {name}", unit="tensor"):
            if p.dim() == 1:  # norm scales
                p.copy_(1 + torch.empty(p.shape).normal_(0, 0.1, generator=g))
            else:  # fan-in scaled, so activations stay O(1) through the layers
                std = 0.5 if pname.endswith("mlp.gate.weight") or "block_sparse_moe.gate" in pname else p.shape[-1] ** -0.5
                p.copy_(torch.empty(p.shape).normal_(0, std, generator=g))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["rope_theta"] = keys["rope_theta"]  # 4.x readers ignore 5.x's rope_parameters
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / ".complete").write_text(json.dumps({"preset": name, "seed": seed}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(build(args.preset, args.seed))


if __name__ == "__main__":
    sys.exit(main())
