"""Distillation into a LoRA adapter: the teacher's behaviour trained into a low-rank delta on
a frozen base, written as peft writes it (peft loads it with every tensor used and the same
logits as the trained wrapper), the base's weights untouched."""

import json

import pytest
import torch

from kvmesh.errors import ConfigError
from kvmesh.optimize.distill import DistillConfig, distill
from kvmesh.optimize.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRALinear, add_lora

SEQ = 24


def _windows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, 384, (SEQ - 1,), generator=g).tolist()] for _ in range(n)]


def _cfg(**kw):
    return DistillConfig(**{"steps": 8, "lr": 1e-2, "batch_size": 2, "seq_len": SEQ, "threads": 1, **kw})


@pytest.fixture(scope="module")
def teacher_and_base(model_factory):
    return model_factory(num_layers=3, seed=11), model_factory(num_layers=2, seed=12)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_lora_distillation_writes_a_peft_adapter_of_the_base(teacher_and_base, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    teacher, base = teacher_and_base
    out = tmp_path / "adapter"
    res = distill(teacher, str(base), out, _cfg(lora_rank=8), train_windows=_windows(), progress=False)
    assert res.losses[-1] < res.losses[0]
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "kvmesh_optimize.json"]
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    tensors = load_file(str(out / ADAPTER_WEIGHTS))
    assert len(tensors) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert all(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)  # trained away from zero

    ids = torch.tensor([_windows(1, seed=5)[0]])
    peft_model = PeftModel.from_pretrained(_hf(base), str(out)).eval()
    # Our wrapper with the written tensors: the same function as peft's reading of the folder.
    ours = _hf(base)
    add_lora(ours, 8, 16.0)
    prefix = "base_model.model."
    for path, module in ours.named_modules():
        if isinstance(module, LoRALinear):
            module.lora_A.data.copy_(tensors[f"{prefix}{path}.lora_A.weight"])
            module.lora_B.data.copy_(tensors[f"{prefix}{path}.lora_B.weight"])
    with torch.no_grad():
        want, got, plain = peft_model(ids).logits, ours(ids).logits, _hf(base)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the base's output

    # kvmesh serves the folder as written: greedy output under it equals peft's.
    from kvmesh import SamplingParams
    from kvmesh.build import build_engine

    engine = build_engine(model=str(base), progress=False, block_size=4, num_blocks=64,
                          lora={"modules": [{"name": "distilled", "path": str(out)}], "max_lora_rank": 8})
    prompt = ids[0].tolist()
    engine.add_request("d", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), lora="distilled")
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.outputs[0].delta_token_ids]
    ref = peft_model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
    assert tokens == ref


def test_lora_distillation_refuses_a_cut_student_and_bad_ranks(teacher_and_base, tmp_path):
    teacher, _ = teacher_and_base
    with pytest.raises(ConfigError, match="first-layers"):
        distill(teacher, "first-layers:1", tmp_path / "a", _cfg(lora_rank=4), train_windows=_windows(),
                progress=False)
    with pytest.raises(ConfigError, match="--lora-rank"):
        _cfg(lora_rank=-1)
    with pytest.raises(ConfigError, match="--lora-alpha"):
        _cfg(lora_rank=4, lora_alpha=0)
