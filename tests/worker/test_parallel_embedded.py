"""Tensor and pipeline parallelism on the embedded SmolLM2-135M (30 layers, 9 query / 3 KV
heads: TP=3 is the size its heads split over; PP=2 puts 15 layers on each stage): the same
greedy tokens as one rank, with chunked prefill and prefix hits, logits within fp32
all-reduce tolerance."""

from __future__ import annotations

import pytest
import torch
from helpers import run_collecting_logits

from kvmesh import SamplingParams
from kvmesh.build import build_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(2)
    engine = build_engine(**_KW)
    ids = [engine.tokenizer.encode(p) for p in _PROMPTS]
    return ids, run_collecting_logits(engine, ids, _PARAMS)


_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "The capital of France is"]
_PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# a 16-token budget: the prompts prefill in chunks; the repeated prompt hits the prefix cache
_KW = dict(progress=False, num_blocks=64, max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=True)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}],
                         ids=["tp3", "pp2"])
def test_embedded_model_split_equals_one_rank(reference, parallel):
    ids, (ref, ref_logits) = reference
    engine = build_engine(**_KW, **parallel)
    try:
        got, logits = run_collecting_logits(engine, ids, _PARAMS)
        assert got == ref
        for rid in ref:
            torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(ref_logits[rid]), rtol=1e-3, atol=1e-3)
        assert engine.num_free_blocks == engine.num_usable_blocks
    finally:
        engine.close()
