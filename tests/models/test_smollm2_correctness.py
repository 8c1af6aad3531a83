"""The embedded SmolLM2-135M-Instruct through kvmesh vs transformers, same fp32 weights."""

import pytest
import torch

from helpers import assert_logits_close, hf_greedy, hf_step_logits, run_collecting_logits
from kvmesh.build import build_engine
from kvmesh import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Paged attention splits the KV cache into blocks so that",
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def engine_and_hf():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    engine = build_engine(progress=False, block_size=16, num_blocks=64, max_num_batched_tokens=8)
    hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    return engine, hf


def test_greedy_tokens_and_logits_match(engine_and_hf):
    engine, hf = engine_and_hf
    prompts = [engine.encode(p) for p in PROMPTS]
    tokens, logits = run_collecting_logits(
        engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    )
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(hf, p, MAX_NEW), PROMPTS[i]
        assert_logits_close(torch.stack(logits[f"r{i}"]), hf_step_logits(hf, p, tokens[f"r{i}"]))
    assert engine.tokenizer.decode(tokens["r0"]).startswith(" Paris.")
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_chat_template_answer(engine_and_hf):
    engine, _ = engine_and_hf
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine.add_request("chat", ids, SamplingParams(max_tokens=24, temperature=0))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert "Paris" in final.outputs[0].text
    assert final.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn
