"""prompt_logprobs against transformers: the logprob of every prompt token given its
prefix, and the top-k, equal HF's log_softmax of one full-prompt forward pass, with whole
and chunked prefill, never from the prefix cache, and delivered once per choice."""

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.errors import InvalidRequestError

K = 5


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # (P - 1, V)


def _check(entries, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for j, e in enumerate(entries[1:]):
        assert e.token_id == prompt[j + 1]
        assert e.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=2e-4)
        vals, ids = ref[j].topk(k)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=2e-4)


@pytest.mark.parametrize("budget", [2048, 7])
def test_prompt_logprobs_match_transformers(model_factory, budget):
    from transformers import AutoModelForCausalLM

    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (23, 1, 9)]
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128, num_threads=1,
                          max_num_batched_tokens=budget)
    # r2 without prompt logprobs, batched with the others; r0 twice: the second never hits the cache
    asks = {"r0": K, "r1": 0, "r2": None, "r3": K}
    for rid, p in zip(asks, prompts + [prompts[0]]):
        engine.add_request(rid, p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                  prompt_logprobs=asks[rid]))
    firsts, finals = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in firsts:
                firsts[out.request_id] = out
            else:
                assert out.prompt_logprobs is None, "prompt logprobs come on the first output only"
            if out.finished:
                finals[out.request_id] = out
    _check(firsts["r0"].prompt_logprobs, _hf_prompt_logprobs(hf, prompts[0]), prompts[0], K)
    _check(firsts["r3"].prompt_logprobs, _hf_prompt_logprobs(hf, prompts[0]), prompts[0], K)
    assert finals["r3"].num_cached_tokens == 0
    assert firsts["r1"].prompt_logprobs == [None]  # one token: nothing to score
    assert firsts["r2"].prompt_logprobs is None
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_every_choice_gets_the_prompt_logprobs_once(model_factory):
    from transformers import AutoModelForCausalLM

    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(3, hf.config.vocab_size, (17,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128, num_threads=1)
    engine.add_request("g", prompt, SamplingParams(n=3, max_tokens=4, seed=3, ignore_eos=True, prompt_logprobs=2))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.index not in got
                got[out.index] = out.prompt_logprobs
    assert sorted(got) == [0, 1, 2]
    ref = _hf_prompt_logprobs(hf, prompt)
    for entries in got.values():
        _check(entries, ref, prompt, 2)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.field == "prompt_logprobs"
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_preempted_request_delivers_its_prompt_logprobs_once(model_factory):
    from transformers import AutoModelForCausalLM

    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (26, 22)]
    # 15 blocks of 4 for two requests growing to ~50 tokens each: the newer one is preempted
    # and recomputes its prompt (5-token chunks), which must not repeat or lose an entry.
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=16, max_model_len=56,
                          num_threads=1, max_num_batched_tokens=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=26, temperature=0, ignore_eos=True,
                                                      prompt_logprobs=K))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in got
                got[out.request_id] = out.prompt_logprobs
    assert engine.stats()["num_preemptions"] > 0
    for i, p in enumerate(prompts):
        _check(got[f"r{i}"], _hf_prompt_logprobs(hf, p), p, K)
    assert engine.num_free_blocks == engine.num_usable_blocks
