"""Greedy output and per-step logits of the kvmesh engine vs transformers, on tiny random
Llama-family checkpoints: mixed-length batches, forced chunked prefill, forced
preemption, tied / untied embeddings, qkv bias, Qwen2, RoPE scaling."""

import pytest
import torch

from helpers import assert_logits_close, hf_greedy, hf_step_logits, run_collecting_logits
from kvmesh.build import build_engine
from kvmesh import SamplingParams
from kvmesh.layers.linear import Linear
from kvmesh.layers.op import CustomOp

MAX_NEW = 10


def _prompts(vocab: int, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _check(path, engine_kwargs, lengths=(1, 5, 17, 33, 64, 9), rtol=1e-3):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = build_engine(model=str(path), progress=False, **engine_kwargs)
    prompts = _prompts(hf.config.vocab_size, lengths)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    tokens, logits = run_collecting_logits(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        assert tokens[rid] == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i} (len {len(prompt)})"
        ours = torch.stack(logits[rid])
        assert_logits_close(ours, hf_step_logits(hf, prompt, tokens[rid]), rtol)
    assert engine.num_free_blocks == engine.num_usable_blocks
    return engine


CONFIGS = {
    "llama-gqa-untied": dict(),
    "llama-tied-qkv-bias": dict(tie_word_embeddings=True, qkv_bias=True),
    "llama-mha-4-layers": dict(num_kv_heads=4, num_layers=4),
    "qwen2": dict(architecture="qwen2", num_kv_heads=1),
    "llama3-rope-scaling": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear-rope-scaling": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(model_factory, name):
    _check(model_factory(**CONFIGS[name]), dict(block_size=4, num_blocks=256))


def test_tiny_token_budget_chunks_every_prompt(model_factory):
    engine = _check(model_factory(), dict(block_size=4, num_blocks=256, max_num_batched_tokens=7))
    assert engine.stats()["num_preemptions"] == 0


def test_few_blocks_force_preemption(model_factory):
    # 30 usable blocks x 4 tokens: the batch needs far more, so requests are preempted
    # and recomputed; outputs must not change.
    engine = _check(
        model_factory(), dict(block_size=4, num_blocks=31, max_model_len=120, max_num_batched_tokens=32),
        lengths=(40, 33, 50, 21, 64, 9),
    )
    assert engine.stats()["num_preemptions"] > 0


def test_reference_torch_backend(model_factory):
    _check(model_factory(), dict(block_size=4, num_blocks=256, attention_backend="torch",
                                 max_num_batched_tokens=7))


def test_block_size_one_and_large(model_factory):
    _check(model_factory(), dict(block_size=1, num_blocks=1024))
    _check(model_factory(), dict(block_size=64, num_blocks=16))


def test_pytorch_reference_ops(model_factory):
    # The layers' PyTorch references (RMSNorm, RoPE, SiLU-and-mul, GEMMs without kvmesh's
    # kernels), not csrc/: the path every non-CPU device without triton takes.
    engine = _check(model_factory(tie_word_embeddings=True),
                    dict(block_size=4, num_blocks=256, attention_backend="torch", cpu_kernels=False))
    model = engine.executor.runner.model
    assert {m.backend for m in model.modules() if isinstance(m, CustomOp) and not isinstance(m, Linear)} == {"torch"}


def test_bf16_engine_within_bf16_tolerance_of_fp32(model_factory):
    """bf16 weights, activations and KV cache (oneDNN's native-bf16 GEMMs where the CPU has
    them, the bf16 attention kernels): per-step logits stay within bf16 rounding of
    transformers in fp32, teacher-forced along the bf16 engine's own greedy tokens."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = build_engine(model=str(path), progress=False, dtype="bfloat16", block_size=4, num_blocks=256)
    prompts = _prompts(hf.config.vocab_size, (1, 5, 17, 33, 64, 9))
    tokens, logits = run_collecting_logits(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0,
                                                                           ignore_eos=True))
    for i, prompt in enumerate(prompts):
        ours = torch.stack(logits[f"r{i}"]).float()
        assert_logits_close(ours, hf_step_logits(hf, prompt, tokens[f"r{i}"]), rtol=3e-2)
    assert engine.num_free_blocks == engine.num_usable_blocks
