"""Parallel sampling (n > 1) in the engine on a tiny random checkpoint: the prompt is
computed once and its full blocks forked by reference; every choice equals the single
request it stands for (greedy: the same text; seeded: seed + i, as vLLM), with prefix
caching on and off, chunked prefill, preemption, speculation and aborts; the pool always
returns to all free."""

import pytest
import torch
from helpers import hf_greedy

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.errors import InvalidRequestError
from kvmesh.llm import LLM

BS = 4


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path, **kw):
    kw = {"block_size": BS, "num_blocks": 128, "max_model_len": 96, "num_threads": 1, **kw}
    return build_engine(model=str(path), progress=False, **kw)


def _run(engine, prompt, params, rid="g"):
    """Drive one request; returns ({index: token ids}, {index: finish}, tokens scheduled)."""
    engine.add_request(rid, prompt, params)
    tokens, finish, scheduled = {}, {}, 0
    orig = engine.scheduler.schedule

    def counting():
        nonlocal scheduled
        out = orig()
        scheduled += out.total_num_tokens
        return out

    engine.scheduler.schedule = counting
    try:
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id == rid and out.outputs[0].index == out.index
                tokens.setdefault(out.index, []).extend(out.outputs[0].delta_token_ids)
                if out.finished:
                    assert out.index not in finish, "a choice finished twice"
                    finish[out.index] = out.outputs[0].finish_reason
    finally:
        engine.scheduler.schedule = orig
    assert engine.num_free_blocks == engine.num_usable_blocks
    return tokens, finish, scheduled


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_choices_equal_the_single_greedy_and_compute_the_prompt_once(model_factory, prefix_caching):
    from transformers import AutoModelForCausalLM

    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = _engine(path, enable_prefix_caching=prefix_caching)
    prompt = _prompt(hf.config.vocab_size, 41)
    params = SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True)
    tokens, finish, scheduled = _run(engine, prompt, params)
    ref = hf_greedy(hf, prompt, 8)
    assert tokens == {0: ref, 1: ref, 2: ref}
    assert finish == {0: "length", 1: "length", 2: "length"}
    # The prompt once (41), each other choice only its last partial block (41 - 40 = 1 token),
    # then 7 decode steps of 3 choices.
    shared = (len(prompt) - 1) // BS * BS
    assert scheduled == len(prompt) + 2 * (len(prompt) - shared) + 3 * 7
    assert scheduled < 3 * len(prompt)


def test_forked_blocks_are_shared_by_reference(model_factory):
    engine = _engine(model_factory(), enable_prefix_caching=False)
    prompt = _prompt(384, 18)
    engine.add_request("g", prompt, SamplingParams(n=3, max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # choice 0 computes the prompt; choices 1, 2 fork it
    kv = engine.kv_manager
    tables = [kv.req_blocks[r] for r in ("g", "g#1", "g#2")]
    shared = (len(prompt) - 1) // BS  # 4 full blocks
    assert [b.block_id for b in tables[1]] == [b.block_id for b in tables[0][:shared]]
    assert all(b.ref_cnt == 3 for b in tables[0][:shared])
    assert kv.num_free_blocks == kv.num_usable_blocks - len(tables[0])
    engine.step()  # the forks compute their last prompt token into blocks of their own
    own = {t[shared].block_id for t in tables}
    assert len(own) == 3 and all(t[shared].ref_cnt == 1 for t in tables)
    engine.abort("g")  # aborting the request aborts every choice
    assert not engine.has_unfinished()
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_seeded_choices_equal_single_requests_with_seed_plus_index(model_factory):
    path = model_factory()
    prompt = _prompt(384, 23, seed=1)
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    tokens, _, _ = _run(_engine(path), prompt, params)
    singles = {}
    for i in range(3):
        single = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234 + i, ignore_eos=True)
        singles[i] = _run(_engine(path), prompt, single, rid=f"s{i}")[0][0]
    assert tokens == singles
    assert len({tuple(t) for t in tokens.values()}) == 3, "seeded choices should differ"


def test_chunked_prefill_and_preemption_keep_every_choice_exact(model_factory):
    from transformers import AutoModelForCausalLM

    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _prompt(hf.config.vocab_size, 30, seed=2)
    ref = hf_greedy(hf, prompt, 24)
    # 17 blocks of 4: the prompt (8 blocks) plus 3 choices growing to 54 tokens cannot all fit.
    engine = _engine(path, num_blocks=18, max_model_len=64, max_num_batched_tokens=7)
    params = SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True)
    tokens, finish, _ = _run(engine, prompt, params)
    assert engine.stats()["num_preemptions"] > 0
    assert tokens == {0: ref, 1: ref, 2: ref}
    assert set(finish.values()) == {"length"}


def test_short_prompt_choices_without_a_block_to_share(model_factory):
    engine = _engine(model_factory())
    tokens, finish, scheduled = _run(engine, [5, 6, 7], SamplingParams(n=2, max_tokens=3, temperature=0,
                                                                       ignore_eos=True))
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3
    assert scheduled == 2 * 3 + 2 * 2


def test_choices_speculate_with_ngram(model_factory):
    from transformers import AutoModelForCausalLM

    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _prompt(hf.config.vocab_size, 12, seed=3) * 3
    engine = _engine(path, speculative={"method": "ngram", "num_speculative_tokens": 3})
    tokens, _, _ = _run(engine, prompt, SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True))
    ref = hf_greedy(hf, prompt, 12)
    assert tokens == {0: ref, 1: ref}
    assert engine.stats()["spec_proposed_tokens"] > 0


def test_stop_and_abort_per_choice_and_bad_n(model_factory):
    engine = _engine(model_factory(), max_num_seqs=4)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", [1, 2, 3], SamplingParams(n=5))
    assert e.value.field == "n"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(n=2, best_of=3)
    assert e.value.field == "best_of"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", [1, 2, 3], SamplingParams(n=2), hold_kv=True)
    assert e.value.field == "n"
    assert SamplingParams(n=2, best_of=2).n == 2
    # choices finish on their own: one aborted alone, the others run to their length
    engine.add_request("a", _prompt(384, 9), SamplingParams(n=3, max_tokens=50, ignore_eos=True, seed=7))
    for _ in range(3):
        engine.step()
    engine.abort("a#1")  # one choice alone
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.index] = out.outputs[0].finish_reason
    assert done == {0: "length", 2: "length"}
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_offline_llm_returns_n_completions_per_prompt(model_factory):
    path = model_factory()
    llm = LLM(str(path), progress=False, block_size=BS, num_blocks=128, max_model_len=96, num_threads=1)
    prompts = [_prompt(384, 13, seed=4), _prompt(384, 6, seed=5)]
    outs = llm.generate(prompts, [SamplingParams(n=3, max_tokens=5, seed=9, ignore_eos=True),
                                  SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in outs[0].outputs)
    assert len(outs[1].outputs) == 1 and len(outs[1].outputs[0].token_ids) == 4
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks
