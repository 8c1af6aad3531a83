"""Tensor parallelism (worker/parallel.py): TP=2 over real gloo between two real processes
gives TP=1's greedy tokens, token for token, with logits within fp32 all-reduce tolerance;
a dead rank fails fast and takes the group out of service; no rank process outlives its engine."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch
from helpers import run_collecting_logits

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.errors import ConfigError, StepFailedError
from kvmesh.layers import native

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12, 13]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

CASES = {
    "llama": ({}, {}),
    "qwen2-biases": ({"architecture": "qwen2"}, {}),
    "qwen3-qk-norm": ({"architecture": "qwen3"}, {}),
    "qwen3-moe": ({"architecture": "qwen3_moe"}, {}),
    "kv-heads-replicated": ({"num_kv_heads": 1, "tie_word_embeddings": True}, {}),
    "int8": ({}, {"quantization": "int8"}),
}


def _pair(path, **kwargs):
    common = {"model": str(path), "progress": False, "block_size": 4, "num_blocks": 64, **kwargs}
    return build_engine(**common), build_engine(tensor_parallel_size=2, **common)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1(model_factory, case):
    model_kw, engine_kw = CASES[case]
    one, two = _pair(model_factory(**model_kw), **engine_kw)
    try:
        ref, ref_logits = run_collecting_logits(one, PROMPTS, GREEDY)
        got, logits = run_collecting_logits(two, PROMPTS, GREEDY)
        assert got == ref
        # int8: the row-parallel layers' rows are quantized per rank (their halves' own scales)
        tol = 0.1 if engine_kw.get("quantization") else 1e-4
        for rid in ref:
            torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(ref_logits[rid]), rtol=tol, atol=tol)
        # KV leaves the group unsharded: the same blocks as TP=1's
        torch.testing.assert_close(two.executor.read_blocks([1, 2]), one.executor.read_blocks([1, 2]),
                                   rtol=tol, atol=tol)
    finally:
        two.close()


@pytest.mark.skipif(not native.load(), reason="the decode stack needs the native CPU kernels (a C++ compiler)")
@pytest.mark.parametrize("case", ["llama", "qwen2-biases", "kv-heads-replicated", "int8"])
def test_tp2_decode_stack_equals_its_layer_loop(model_factory, stack_calls, case):
    """At TP=2 each rank's decode steps run as one decode_stack call that all-reduces the
    row-parallel outputs (and adds their biases after) from C++: the same collectives in the
    same order as the layer loop, so the same bits as TP=2 with the stack off; and the ranks'
    groups are released when the engine closes."""
    from torch._C._distributed_c10d import _resolve_process_group

    model_kw, engine_kw = CASES[case]
    common = {"model": str(model_factory(**model_kw)), "progress": False, "block_size": 4, "num_blocks": 64,
              "tensor_parallel_size": 2, **engine_kw}
    stack = build_engine(**common)
    name = stack.executor.runner.groups.tp.name
    try:
        assert name, "the TP group must be registered for the C++ all-reduces"
        assert stack.executor.runner.local.model.tp.shm is not None, "ranks on one machine sum over shared memory"
        stack_calls.clear()
        got, logits = run_collecting_logits(stack, PROMPTS, GREEDY)
        assert sum(stack_calls) == GREEDY.max_tokens - 1, "every two-row decode step should run the stack"
    finally:
        stack.close()
    with pytest.raises(RuntimeError):
        _resolve_process_group(name)
    loop = build_engine(**common, decode_stack=False)
    try:
        stack_calls.clear()
        ref, ref_logits = run_collecting_logits(loop, PROMPTS, GREEDY)
        assert not any(stack_calls)
    finally:
        loop.close()
    assert got == ref
    for rid in ref:
        assert torch.equal(torch.stack(logits[rid]), torch.stack(ref_logits[rid])), rid


@pytest.mark.skipif(not native.load(), reason="the shm all-reduce needs the native CPU kernels (a C++ compiler)")
@pytest.mark.parametrize("case", ["llama", "qwen2-biases"])
def test_shm_all_reduce_gives_gloos_bits(model_factory, stack_calls, case):
    """The ranks' sums over shared memory (layers/shm_allreduce.py) against gloo's
    (`shm_all_reduce=False`), both with the decode stack (which then all-reduces by group
    name): two ranks' sums a + b are the same bits either way, so the whole run is."""
    model_kw, engine_kw = CASES[case]
    common = {"model": str(model_factory(**model_kw)), "progress": False, "block_size": 4, "num_blocks": 64,
              "tensor_parallel_size": 2, **engine_kw}
    runs = {}
    for shm in (True, False):
        engine = build_engine(**common, shm_all_reduce=shm)
        try:
            assert (engine.executor.runner.local.model.tp.shm is not None) == shm
            assert not glob.glob("/dev/shm/kvmesh-tp-*"), "the segment file goes once every rank mapped it"
            stack_calls.clear()
            runs[shm] = run_collecting_logits(engine, PROMPTS, GREEDY)
            assert sum(stack_calls) == GREEDY.max_tokens - 1
        finally:
            engine.close()
    (got, logits), (ref, ref_logits) = runs[True], runs[False]
    assert got == ref
    for rid in ref:
        assert torch.equal(torch.stack(logits[rid]), torch.stack(ref_logits[rid])), rid


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_draft_model_speculation_on_a_parallel_target(model_factory, parallel):
    """A draft model runs whole beside rank 0 (vLLM's draft TP of 1) and proposes for a TP=2
    or PP=2 target, which verifies over its ranks: lossless (TP=1 without speculation's
    tokens), and a "self" draft (the whole target, loaded unsharded here) is always accepted."""
    path = model_factory()
    common = {"model": str(path), "progress": False, "block_size": 4, "num_blocks": 64}
    prompts = [[5, 6, 7, 8, 9, 10, 11], [11, 12, 13]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref, _ = run_collecting_logits(build_engine(**common), prompts, params)
    engine = build_engine(**common, **parallel, speculative={"method": "draft", "model": "self",
                                                             "num_speculative_tokens": 3})
    try:
        draft = engine.executor.proposer.runner
        assert draft.model is not engine.executor.runner.local.model  # its own, unsharded copy
        outs = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.outputs[0].delta_token_ids)
        assert [outs[f"r{i}"] for i in range(2)] == [ref[f"r{i}"] for i in range(2)]
        c = engine.spec_counters
        assert c["proposed"] > 0 and c["accepted"] == c["proposed"]
        assert engine.num_free_blocks == engine.num_usable_blocks
    finally:
        engine.close()


def test_chunked_prefill_prefix_hits_and_preemption(model_factory):
    """Small token budget (chunked prefill), repeated prompts (prefix hits) and too few blocks
    for the batch (preemption): the same greedy text as TP=1, every block free again after."""
    path = model_factory()
    kw = dict(max_num_batched_tokens=8, num_blocks=14, enable_prefix_caching=True)
    one, two = _pair(path, **kw)
    prompts = [list(range(3, 20)), list(range(3, 20)), list(range(30, 41)), [7, 8, 9, 10, 11, 12]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        ref, _ = run_collecting_logits(one, prompts, params)
        got, _ = run_collecting_logits(two, prompts, params)
        assert got == ref
        assert two.num_free_blocks == two.num_usable_blocks
    finally:
        two.close()


def test_dead_rank_fails_fast_and_marks_the_group_down(model_factory):
    engine = build_engine(model=str(model_factory()), progress=False, block_size=4, num_blocks=32,
                          tensor_parallel_size=2)
    runner = engine.executor.runner
    proc = runner.ranks.procs[0]
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
        assert "tensor parallel" in str(err.value.cause)
        ok, why = engine.executor_health()
        assert not ok and "rank 1" in why
        assert engine.num_free_blocks == engine.num_usable_blocks
    finally:
        engine.close()


def test_close_stops_the_rank_processes(model_factory):
    engine = build_engine(model=str(model_factory()), progress=False, block_size=4, num_blocks=32,
                          tensor_parallel_size=2)
    procs = list(engine.executor.runner.ranks.procs)
    engine.close()
    assert all(not p.is_alive() for p in procs)


def test_unshardable_shapes_are_config_errors(model_factory):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        build_engine(model=str(model_factory(num_heads=4, num_kv_heads=2)), progress=False, num_blocks=16,
                     tensor_parallel_size=3)
