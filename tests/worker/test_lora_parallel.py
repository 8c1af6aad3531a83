"""Multi-LoRA on tensor / pipeline parallel workers (worker/parallel.py ParallelLoRA,
worker/lora.py): over real gloo between real processes, TP=2, PP=2 and TP=2 with replicated
KV heads and with an int8 base give peft's greedy tokens on tiny random models with random
adapters (the oracle), and TP=1's logits within fp32 all-reduce tolerance, for batches that
mix three adapters and the base model through two device slots (slots refilled alike on
every rank) with chunked prefill; adapters loaded and unloaded at run time reach every rank;
a bad adapter is refused on rank 0 and the group serves on; idle engines are back at their
full free-block count."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, make_adapter, peft_reference, run_collecting_logits

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.errors import InvalidRequestError

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]),
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    alpha_pattern={"v_proj": 2}),
    "mlp-r16-rslora": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                           use_rslora=True),
}
NAMES = [None, *ADAPTERS]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12, 13], list(range(20, 47)), [40, 41, 42, 43, 44],
           list(range(100, 118)), [7, 7, 8]]
LORAS = [NAMES[i % len(NAMES)] for i in range(len(PROMPTS))]

CASES = {
    "tp2": ({"qkv_bias": True}, {"tensor_parallel_size": 2}),
    "pp2": ({"qkv_bias": True}, {"pipeline_parallel_size": 2}),
    "tp2-kv-heads-replicated": ({"num_kv_heads": 1, "tie_word_embeddings": True}, {"tensor_parallel_size": 2}),
    "tp2-int8": ({"qkv_bias": True}, {"tensor_parallel_size": 2, "quantization": "int8"}),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{model kwargs key: (base checkpoint, {adapter name: folder})}, built once per base."""
    from tiny_models import build_tiny_model

    made: dict = {}

    def get(model_kw: dict):
        key = tuple(sorted(model_kw.items()))
        if key not in made:
            base = build_tiny_model(tmp_path_factory.mktemp("base"), **model_kw)
            made[key] = base, {name: make_adapter(base, tmp_path_factory.mktemp(name), seed=i + 1, **kw)
                               for i, (name, kw) in enumerate(ADAPTERS.items())}
        return made[key]

    return get


def _engine(base, adapters, **kw):
    modules = [{"name": n, "path": str(p)} for n, p in adapters.items()]
    return build_engine(model=str(base), progress=False, block_size=4, num_blocks=128, max_num_batched_tokens=16,
                        lora={"modules": modules, "max_loras": 2, "max_lora_rank": 16}, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_adapters_equal_peft_and_one_rank(bases, case):
    model_kw, engine_kw = CASES[case]
    base, adapters = bases(model_kw)
    one = _engine(base, adapters, **{k: v for k, v in engine_kw.items() if k == "quantization"})
    many = _engine(base, adapters, **engine_kw)
    try:
        ref, ref_logits = run_collecting_logits(one, PROMPTS, GREEDY, LORAS)
        got, logits = run_collecting_logits(many, PROMPTS, GREEDY, LORAS)
        assert got == ref
        tol = 0.1 if "quantization" in engine_kw else 1e-4  # int8: each rank's rows quantized apart
        for rid in ref:
            torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(ref_logits[rid]), rtol=tol, atol=tol)
        if "quantization" not in engine_kw:  # the oracle: peft on the float weights
            refs = {name: peft_reference(base, None if name is None else adapters[name]) for name in NAMES}
            for i, (prompt, name) in enumerate(zip(PROMPTS, LORAS)):
                assert got[f"r{i}"] == hf_greedy(refs[name], prompt, MAX_NEW), f"prompt {i} under {name}"
        assert many.executor.lora.loads > 2, "three adapters through two slots: refilled"
        # the adapters change the output (else the test would pass with them dropped on a rank)
        base_only, _ = run_collecting_logits(many, PROMPTS, GREEDY)
        assert any(base_only[f"r{i}"] != got[f"r{i}"] for i, name in enumerate(LORAS) if name is not None)
        assert many.num_free_blocks == many.num_usable_blocks
    finally:
        many.close()


def test_run_time_load_unload_and_a_bad_adapter_at_tp2(bases, tmp_path):
    base, adapters = bases(CASES["tp2"][0])
    other_base, _ = bases({"hidden_size": 32, "intermediate_size": 64})
    engine = build_engine(model=str(base), progress=False, block_size=4, num_blocks=64, tensor_parallel_size=2,
                          lora={"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": 2})
    try:
        alien = make_adapter(other_base, tmp_path / "alien", seed=9, r=4, target_modules=["o_proj"])
        with pytest.raises(InvalidRequestError, match="another base"):
            engine.load_lora("alien", str(alien))
        one = _engine(base, {})  # TP=1, the same adapters loaded the same way
        engine.load_lora("all-r8", str(adapters["all-r8"]))
        one.load_lora("all-r8", str(adapters["all-r8"]))
        got, _ = run_collecting_logits(engine, PROMPTS[:2], GREEDY, ["all-r8", None])
        ref, _ = run_collecting_logits(one, PROMPTS[:2], GREEDY, ["all-r8", None])
        assert got == ref
        # a third adapter in two host slots evicts the least recently used on every rank
        engine.load_lora("attn-r4", str(adapters["attn-r4"]))
        engine.load_lora("mlp-r16-rslora", str(adapters["mlp-r16-rslora"]))
        assert sorted(i.name for i in engine.list_loras()) == ["attn-r4", "mlp-r16-rslora"]
        assert engine.unload_lora("attn-r4") and not engine.unload_lora("attn-r4")
        one.load_lora("mlp-r16-rslora", str(adapters["mlp-r16-rslora"]))
        ref, _ = run_collecting_logits(one, PROMPTS[2:4], GREEDY, ["mlp-r16-rslora", None])
        got, _ = run_collecting_logits(engine, PROMPTS[2:4], GREEDY, ["mlp-r16-rslora", None])
        assert got == ref
        healthy, why = engine.executor.runner.health()
        assert healthy, why
        assert engine.num_free_blocks == engine.num_usable_blocks
    finally:
        engine.close()
