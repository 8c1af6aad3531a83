"""LLMEngine behaviour on a tiny random model: prefix caching, seeded sampling, bad
input, aborts, block accounting."""

import pytest
import torch

from kvmesh import InvalidRequestError, LLM, SamplingParams
from kvmesh.errors import ConfigError, ModelNotFoundError


@pytest.fixture(scope="module")
def llm(tiny_llama):
    torch.set_num_threads(1)
    return LLM(str(tiny_llama), progress=False, block_size=4, num_blocks=200, max_model_len=256)


def _prompt(n, seed=0):
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_caching_same_outputs_and_computes_only_tail(tiny_llama, llm):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    shared = _prompt(64)
    a, b = shared + _prompt(5, 1), shared + _prompt(7, 2)
    no_cache = LLM(str(tiny_llama), progress=False, block_size=4, num_blocks=200, max_model_len=256,
                   enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in no_cache.generate([a, b], greedy)]

    first = llm.generate(a, greedy)[0]
    eng = llm.engine
    computed_before = eng.kv_manager.hit_tokens
    second = llm.generate(b, greedy)[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == ref
    # the second request reused all 16 shared blocks and computed only its tail
    assert second.num_cached_tokens == 64
    assert eng.kv_manager.hit_tokens - computed_before == 64
    assert eng.num_free_blocks == eng.num_usable_blocks


def test_prefix_hit_counts_computed_tokens(llm):
    eng = llm.engine
    p = _prompt(40, 5)
    llm.generate(p, SamplingParams(max_tokens=1, temperature=0))
    rid = eng.add_request("tail", p + [5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
    sched = eng.scheduler.schedule()
    (seq,) = sched.seqs
    assert (seq.start_pos, seq.num_tokens) == (40, 3)  # 10 cached blocks, 3-token tail
    eng.executor.execute(sched)
    eng.abort(rid)
    assert eng.num_free_blocks == eng.num_usable_blocks


def test_reset_prefix_cache_forgets_prefixes_only_when_idle(llm):
    eng = llm.engine
    p = _prompt(32, 7)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate(p, greedy)
    assert llm.generate(p, greedy)[0].num_cached_tokens > 0
    rid = eng.add_request("holder", _prompt(9, 8), greedy)
    eng.step()
    assert llm.reset_prefix_cache() is False  # a running request holds blocks
    eng.abort(rid)
    assert llm.reset_prefix_cache() is True
    assert llm.generate(p, greedy)[0].num_cached_tokens == 0
    assert eng.num_free_blocks == eng.num_usable_blocks


def test_seeded_sampling_independent_of_batch(llm):
    p = _prompt(12, 3)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate(p, params)[0].outputs[0].token_ids
    others = [_prompt(n, 10 + n) for n in (5, 30, 17)]
    mixed = llm.generate(
        others[:2] + [p] + others[2:],
        [SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True)] * 2 + [params]
        + [SamplingParams(max_tokens=20, temperature=1.2, seed=7, ignore_eos=True)],
    )
    assert mixed[2].outputs[0].token_ids == alone
    # and a different seed gives a different sample
    other = llm.generate(p, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99,
                                           ignore_eos=True))[0].outputs[0].token_ids
    assert other != alone


def test_logprobs_and_penalties(llm):
    p = _prompt(10, 4)
    out = llm.generate(p, SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the argmax
        assert lp.logprob == pytest.approx(lp.top[0][1])
    # a strong repetition penalty changes a repetitive greedy continuation
    plain = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    pen = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                         frequency_penalty=2.0, presence_penalty=2.0))[0].outputs[0].token_ids
    assert len(set(pen)) >= len(set(plain))


@pytest.mark.parametrize(
    "prompt, kwargs, field",
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1] * 300, {}, "prompt"),  # longer than max_model_len 256
        ([1, 2, 10_000], {}, "prompt_token_ids"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(llm, prompt, kwargs, field):
    eng = llm.engine
    good = eng.add_request(None, _prompt(8), SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(None, prompt, SamplingParams(**kwargs))
    assert err.value.field == field
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == [good]
    assert eng.num_free_blocks == eng.num_usable_blocks


def test_bad_sampling_params_name_field():
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model"):
        LLM(str(tmp_path / "nope"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"), progress=False)


def test_cache_too_small_for_max_model_len(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(tiny_llama), progress=False, block_size=4, num_blocks=10, max_model_len=256)


def test_abort_mid_generation_frees_blocks(llm):
    eng = llm.engine
    rids = [eng.add_request(None, _prompt(30 + i, i), SamplingParams(max_tokens=50, ignore_eos=True))
            for i in range(3)]
    for _ in range(3):
        eng.step()
    assert eng.num_free_blocks < eng.num_usable_blocks
    eng.abort(rids[1])
    eng.abort(rids)
    assert not eng.has_unfinished()
    eng.step()
    assert eng.num_free_blocks == eng.num_usable_blocks


def test_stop_string_finishes_with_reason(llm):
    p = _prompt(10, 8)
    full = llm.generate(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    if len(full.text) < 4:
        pytest.fail("random model produced too little text for the stop-string test")
    stop = full.text[2:4]
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks


def test_prefill_first_steps_match_transformers(tiny_llama):
    """Prefill-first scheduling (decodes deferred while prompts are chunked in) changes
    which rows share a step, never the tokens: greedy outputs equal transformers'."""
    from helpers import hf_greedy
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama), progress=False, block_size=4, num_blocks=200, max_model_len=256,
              max_num_batched_tokens=16, max_deferred_decode_steps=2)
    prompts = [_prompt(n, seed) for seed, n in enumerate((9, 40, 23, 61))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
    eng = llm.engine
    assert eng.num_free_blocks == eng.num_usable_blocks
