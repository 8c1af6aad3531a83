"""Property tests (hypothesis) on request validation, the sampler and the engine: no
input crashes them, a failing step fails only its own requests, and every KV block
comes back once the engine is idle. Plus the step watchdog and the pin quota."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh import SamplingParams
from kvmesh._proto import llm_pb2
from kvmesh.build import build_engine
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.errors import InvalidRequestError, ResourceExhaustedError, StepFailedError
from kvmesh.rpc import params_from_proto, params_to_proto
from kvmesh.worker.sampler import sample

VOCAB = 384  # the tiny model's
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)

# Anything a JSON body or a Python caller could put in a numeric field.
any_number = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3))
sane = {
    "max_tokens": st.integers(1, 24), "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    "top_k": st.sampled_from([-1, 0, 1, 2, 50, VOCAB, VOCAB + 1, 10**6, 2**31 - 1]),
    "top_p": st.floats(0.05, 1.0), "min_p": st.floats(0.0, 1.0), "seed": st.none() | st.integers(0, 2**63 - 1),
    "repetition_penalty": st.floats(0.5, 2.0), "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0), "logprobs": st.none() | st.integers(0, 20),
    "ignore_eos": st.booleans(),
}


def _kwargs(fields):
    return st.fixed_dictionaries({}, optional=fields)


@SETTINGS
@given(_kwargs({name: any_number for name in sane} | {
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(-(2**40), 2**40), max_size=3)}))
def test_sampling_params_are_valid_or_refused_by_name(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        assert exc.field in {*kwargs, "top_k"}, exc
        return
    except TypeError:  # a non-number compared with a number: only for str / None inputs
        assert any(isinstance(v, str) or v is None for v in kwargs.values())
        return
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert math.isfinite(getattr(p, name))
    # Whatever is accepted fits the protobuf types and survives the trip to a worker.
    assert params_from_proto(params_to_proto(p)) == p


@SETTINGS
@given(_kwargs({"max_tokens": st.integers(-(2**31), 2**31 - 1), "top_k": st.integers(-(2**31), 2**31 - 1),
                "temperature": st.floats(), "top_p": st.floats(), "min_p": st.floats(),
                "seed": st.integers(-(2**63), 2**63 - 1), "logprobs": st.integers(-(2**31), 2**31 - 1),
                "repetition_penalty": st.floats(), "presence_penalty": st.floats(),
                "frequency_penalty": st.floats()}))
def test_any_grpc_sampling_params_convert_or_are_invalid_argument(kwargs):
    try:
        params_from_proto(llm_pb2.SamplingParams(**kwargs))
    except InvalidRequestError:
        pass


@SETTINGS
@given(st.lists(st.fixed_dictionaries(sane), min_size=1, max_size=6), st.integers(0, 2**31))
def test_sampler_never_fails_on_any_batch(rows, seed):
    params = [SamplingParams(**r) for r in rows]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed))
    gens = [torch.Generator().manual_seed(p.seed % 2**63) if p.seed is not None else None for p in params]
    penalty_inputs = [([1, 2, 3], [4, 5]) for _ in params]
    tokens, lps, _ = sample(logits, params, gens, torch.Generator().manual_seed(0), penalty_inputs)
    assert len(tokens) == len(params) and all(0 <= t < VOCAB for t in tokens)


def test_poison_pair_top_k_over_vocab_with_small_top_k():
    """Issue 19's crash: the batch max top_k above the vocabulary broke every row's topk."""
    logits = torch.randn(2, VOCAB)
    tokens, _, _ = sample(logits, [SamplingParams(top_k=10**6), SamplingParams(top_k=2, temperature=0.5)],
                          [None, None], torch.Generator().manual_seed(0))
    assert tokens[1] in logits[1].topk(2).indices.tolist()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    torch.set_num_threads(1)
    return build_engine(model=str(tiny_llama), progress=False, block_size=4, num_blocks=64, max_model_len=64,
                        max_num_seqs=4, max_num_batched_tokens=48)


prompt_st = st.one_of(st.lists(st.integers(-3, VOCAB + 3), min_size=0, max_size=70),
                      st.text(max_size=40))


@settings(SETTINGS, max_examples=25)
@given(st.lists(st.tuples(prompt_st, st.fixed_dictionaries({}, optional=sane), st.integers(0, 6)),
                min_size=1, max_size=6))
def test_engine_survives_any_requests_and_returns_every_block(engine, requests):
    """Random prompts (invalid ones included), parameters and aborts after n steps."""
    abort_at = {}
    for i, (prompt, kwargs, abort_after) in enumerate(requests):
        try:
            rid = engine.add_request(f"h{i}", prompt, SamplingParams(**kwargs))
        except InvalidRequestError:
            continue
        if abort_after:
            abort_at[rid] = abort_after
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        engine.abort([rid for rid, n in abort_at.items() if n == steps])
        assert steps < 2000
    assert engine.num_free_blocks == engine.num_usable_blocks


def _poison_on(engine, marker: str):
    """Make the executor raise whenever a request whose id contains `marker` is in the step."""
    real = engine.executor.execute

    def execute(sched):
        if any(marker in s.request_id for s in sched.seqs):
            raise RuntimeError("selected index k out of range")  # what the sampler used to raise
        return real(sched)

    engine.executor.execute = execute
    return lambda: setattr(engine.executor, "execute", real)


def test_failed_step_fails_its_requests_only_and_the_engine_serves_on(engine):
    restore = _poison_on(engine, "poison")
    try:
        engine.add_request("poison", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
        engine.add_request("innocent", [10, 11, 12], SamplingParams(max_tokens=4))
        with pytest.raises(StepFailedError) as info:
            engine.step()
        assert set(info.value.request_ids) == {"poison", "innocent"}  # batched together: both failed
        assert not engine.has_unfinished() and engine.num_free_blocks == engine.num_usable_blocks
        engine.add_request("after", [10, 11, 12], SamplingParams(max_tokens=3, ignore_eos=True))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    finally:
        restore()


def test_async_engine_fails_the_request_not_the_loop(engine):
    restore = _poison_on(engine, "poison")

    async def main():
        aeng = AsyncLLMEngine(engine)
        with pytest.raises(StepFailedError):
            async for _ in aeng.generate([5, 6, 7], SamplingParams(max_tokens=4), request_id="poison-1"):
                pass
        assert aeng.health() == (True, "")
        outs = [o async for o in aeng.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        await aeng.shutdown()
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        restore()
    assert outs[-1].finished and engine.num_free_blocks == engine.num_usable_blocks


def test_step_watchdog_reports_a_wedged_step(engine):
    real = engine.executor.execute
    engine.executor.execute = lambda sched: (time.sleep(1.0), real(sched))[1]
    aeng = AsyncLLMEngine(engine)
    aeng.step_timeout_s = 0.3

    async def main():
        task = asyncio.create_task(anext(aeng.generate([5, 6, 7], SamplingParams(max_tokens=1))))
        await asyncio.sleep(0.6)
        during = aeng.health()
        await task
        after = aeng.health()
        await aeng.shutdown()
        return during, after

    try:
        during, after = asyncio.run(main())
    finally:
        engine.executor.execute = real
    assert not during[0] and "watchdog" in during[1]
    assert after == (True, "")


def test_pin_quota_refuses_at_once_and_normal_requests_still_run(engine, monkeypatch):
    # 63 usable blocks of 4 tokens: quota 31 blocks (max_pinned_fraction 0.5), floor 16 (max_model_len 64).
    usable = engine.num_usable_blocks
    assert engine.cache_prompt("big", list(range(3, 63))) == 60  # 15 blocks
    assert engine.cache_prompt("second", list(range(100, 160))) == 60  # 30 blocks in all
    free_before = engine.num_free_blocks
    steps, added = [], []
    real_step, real_add = engine._step_once, engine.add_request
    monkeypatch.setattr(engine, "_step_once", lambda: (steps.append(1), real_step())[1])
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: (added.append(a[0]), real_add(*a, **k))[1])
    with pytest.raises(ResourceExhaustedError) as info:
        engine.cache_prompt("third", list(range(200, 240)))  # 10 more: over the quota
    # Refused at once: by the quota check, before the pin became a request or any step ran.
    assert info.value.field == "max_pinned_fraction"
    assert steps == [] and added == [] and not engine.has_unfinished()
    assert engine.num_free_blocks == free_before
    monkeypatch.undo()
    assert engine.pinned_prompts == ["big", "second"]
    engine.add_request("normal", list(range(300, 340)), SamplingParams(max_tokens=20, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert out.finished and len(out.outputs[0].token_ids) == 20
    assert engine.uncache_prompt("big") and engine.uncache_prompt("second")
    assert engine.num_free_blocks == usable


def test_async_pin_over_quota_fails_fast_without_blocking_the_loop(engine):
    async def main():
        aeng = AsyncLLMEngine(engine)
        await aeng.cache_prompt("a", list(range(3, 63)))
        await aeng.cache_prompt("a2", list(range(100, 160)))  # 30 of the 31 blocks the quota allows
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        with pytest.raises(ResourceExhaustedError):
            await aeng.cache_prompt("b", list(range(200, 240)))
        await asyncio.sleep(0.05)
        t.cancel()
        for name in ("a", "a2"):
            await aeng.run_between_steps(lambda name=name: engine.uncache_prompt(name))
        await aeng.shutdown()
        return ticks

    assert asyncio.run(main()) > 0
    assert engine.num_free_blocks == engine.num_usable_blocks and engine.pinned_prompts == []
