"""Pipeline parallelism (worker/pipeline.py, worker/parallel.py ParallelRunner): PP=2 over real gloo
between two real processes gives PP=1's greedy tokens, token for token, with logits within
fp32 tolerance; micro-batches cut prefill chunks where they must; KV blocks leave the group
with every layer; a dead stage fails fast and takes the group out of service."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from helpers import run_collecting_logits

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.errors import ConfigError, StepFailedError
from kvmesh.layers.attention import SeqSpan
from kvmesh.worker.pipeline import split_microbatches

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12, 13], list(range(20, 33))]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

CASES = {
    "llama": ({}, {}),
    "five-layers": ({"num_layers": 5}, {}),
    "qwen2-biases": ({"architecture": "qwen2"}, {}),
    "qwen3-moe": ({"architecture": "qwen3_moe"}, {}),
    "gemma3": ({"architecture": "gemma3"}, {}),
    "tied": ({"tie_word_embeddings": True}, {}),
    "int8": ({}, {"quantization": "int8"}),
    "int8-kv": ({}, {"kv_cache_dtype": "int8"}),
}


def _pair(path, **kwargs):
    common = {"model": str(path), "progress": False, "block_size": 4, "num_blocks": 64, **kwargs}
    return build_engine(**common), build_engine(pipeline_parallel_size=2, **common)


def test_microbatches_cut_by_tokens_and_keep_decodes_first():
    spans = [SeqSpan(0, 1, 9, [1]), SeqSpan(1, 1, 4, [2]), SeqSpan(2, 10, 0, [3, 4, 5]), SeqSpan(12, 2, 6, [6, 7])]
    a, b = split_microbatches(spans, 2, 2)
    assert (a.tokens, b.tokens) == (slice(0, 7), slice(7, 14))
    assert a.num_decodes == 2 and b.num_decodes == 0
    # the prefill is cut at its 5th token: the second part continues at position 5
    assert a.spans[2] == SeqSpan(2, 5, 0, [3, 4, 5]) and b.spans[0] == SeqSpan(0, 5, 5, [3, 4, 5])
    assert b.spans[1] == SeqSpan(5, 2, 6, [6, 7])
    assert sum(mb.num_tokens for mb in split_microbatches(spans, 2, 3)) == 14
    assert len(split_microbatches(spans[:1], 1, 2)) == 1  # one token: one micro-batch


@pytest.mark.parametrize("case", list(CASES))
def test_pp2_equals_pp1(model_factory, case):
    model_kw, engine_kw = CASES[case]
    one, two = _pair(model_factory(**model_kw), **engine_kw)
    try:
        ref, ref_logits = run_collecting_logits(one, PROMPTS, GREEDY)
        got, logits = run_collecting_logits(two, PROMPTS, GREEDY)
        assert got == ref
        for rid in ref:
            torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(ref_logits[rid]), rtol=1e-4, atol=1e-4)
        # KV leaves the group with every layer: the same blocks as PP=1's
        torch.testing.assert_close(two.executor.read_blocks([1, 2, 3]), one.executor.read_blocks([1, 2, 3]),
                                   rtol=1e-4, atol=1e-4)
        assert two.num_free_blocks == two.num_usable_blocks
    finally:
        two.close()


def test_three_stages_and_the_stage_layers(model_factory):
    path = model_factory(num_layers=5)
    one = build_engine(model=str(path), progress=False, block_size=4, num_blocks=64)
    three = build_engine(model=str(path), progress=False, block_size=4, num_blocks=64, pipeline_parallel_size=3)
    try:
        runner = three.executor.runner
        assert [(r.start, r.stop) for r in runner.stages] == [(0, 1), (1, 3), (3, 5)]
        assert runner.local.spec.num_layers == 1 and runner.spec.num_layers == 5
        assert len(runner.ranks.procs) == 2
        ref, _ = run_collecting_logits(one, PROMPTS, GREEDY)
        got, _ = run_collecting_logits(three, PROMPTS, GREEDY)
        assert got == ref
    finally:
        three.close()


def test_chunked_prefill_prefix_hits_and_preemption(model_factory):
    """Small token budget (chunked prefill), repeated prompts (prefix hits) and too few blocks
    for the batch (preemption): the same greedy text as PP=1, every block free again after."""
    kw = dict(max_num_batched_tokens=8, num_blocks=14, enable_prefix_caching=True)
    one, two = _pair(model_factory(), **kw)
    prompts = [list(range(3, 20)), list(range(3, 20)), list(range(30, 41)), [7, 8, 9, 10, 11, 12]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        ref, _ = run_collecting_logits(one, prompts, params)
        got, _ = run_collecting_logits(two, prompts, params)
        assert got == ref
        assert two.num_free_blocks == two.num_usable_blocks
    finally:
        two.close()


def test_ngram_speculation_prompt_logprobs_and_the_decode_stack(model_factory, stack_calls):
    """Verification rows (k + 1 per request) and prompt logprobs (every prompt row) cross the
    stages like any other; stage 0 runs its layers' decode steps as one decode_stack call."""
    path = model_factory()
    kw = dict(speculative={"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1})
    one, two = _pair(path, **kw)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9, 9]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2)
    try:
        ref, _ = run_collecting_logits(one, prompts, params)
        stack_calls.clear()
        got, _ = run_collecting_logits(two, prompts, params)
        assert got == ref
        plain = _pair(path)
        try:
            stack_calls.clear()
            run_collecting_logits(plain[1], [[5, 6, 7]], GREEDY)
            assert any(stack_calls)
        finally:
            plain[1].close()
    finally:
        two.close()


def test_blocks_written_into_the_stages_read_back(model_factory):
    """The shared store / P/D path: TP=1-layout blocks written into a PP=2 group land in the
    right stages and read back unchanged, and decode from them matches PP=1."""
    one, two = _pair(model_factory())
    try:
        run_collecting_logits(one, PROMPTS, GREEDY)
        data = one.executor.read_blocks([1, 2, 3, 4])
        two.executor.write_blocks([5, 6, 7, 8], data)
        torch.testing.assert_close(two.executor.read_blocks([5, 6, 7, 8]), data)
    finally:
        two.close()


def test_dead_stage_fails_fast_and_marks_the_group_down(model_factory):
    engine = build_engine(model=str(model_factory()), progress=False, block_size=4, num_blocks=32,
                          pipeline_parallel_size=2)
    proc = engine.executor.runner.ranks.procs[0]
    try:
        assert engine.executor_health() == (True, "")
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        engine.add_request("r", [5, 6, 7], GREEDY)
        t0 = time.monotonic()
        with pytest.raises(StepFailedError) as err:
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 10
        assert "pipeline parallel" in str(err.value.cause)
        ok, why = engine.executor_health()
        assert not ok and "rank 1" in why
        assert engine.num_free_blocks == engine.num_usable_blocks
    finally:
        engine.close()
    assert not proc.is_alive()


def test_refusals_are_config_errors(model_factory):
    path = str(model_factory())
    with pytest.raises(ConfigError, match="pipeline_parallel_size: 4 stages for 3 layers"):
        build_engine(model=path, progress=False, num_blocks=16, pipeline_parallel_size=4)


@pytest.mark.parametrize("engine_kw", [{}, {"kv_cache_dtype": "int8", "enable_prefix_caching": True}],
                         ids=["fp32", "int8-kv"])
def test_tp2_x_pp2_equals_one_rank(model_factory, engine_kw):
    """Four ranks: two stages of two tensor-parallel ranks each; KV blocks out and in with
    every layer and head."""
    path = model_factory(num_layers=4)
    one, four = _pair(path, tensor_parallel_size=1, **engine_kw)[0], build_engine(
        model=str(path), progress=False, block_size=4, num_blocks=64, tensor_parallel_size=2,
        pipeline_parallel_size=2, **engine_kw)
    try:
        runner = four.executor.runner
        assert len(runner.ranks.procs) == 3 and runner.local.spec.num_layers == 2
        assert runner.local.spec.num_kv_heads == 1 and runner.spec.num_kv_heads == 2
        ref, ref_logits = run_collecting_logits(one, PROMPTS, GREEDY)
        got, logits = run_collecting_logits(four, PROMPTS, GREEDY)
        assert got == ref
        for rid in ref:
            torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(ref_logits[rid]), rtol=1e-4, atol=1e-4)
        data = one.executor.read_blocks([1, 2, 3])
        if "kv_cache_dtype" not in engine_kw:  # int8: packed bytes, a scale's last bit flips them
            torch.testing.assert_close(four.executor.read_blocks([1, 2, 3]), data, rtol=1e-4, atol=1e-4)
        else:
            assert four.executor.read_blocks([1, 2, 3]).shape == data.shape
        four.executor.write_blocks([9, 10, 11], data)
        torch.testing.assert_close(four.executor.read_blocks([9, 10, 11]), data)
        assert four.num_free_blocks == four.num_usable_blocks
    finally:
        four.close()
