"""logit_bias against transformers: greedy decoding with a bias added to the raw logits is
HF's greedy with the same bias added, token for token (batched with unbiased and
differently biased requests); ids outside the vocabulary and out-of-range biases are
refused naming the field; biased requests opt out of speculation."""

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.errors import InvalidRequestError
from kvmesh.worker.sampler import apply_logit_bias


def _hf_biased_greedy(hf, prompt: list[int], bias: dict[int, float], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq])).logits[0, -1].float()
            for t, b in bias.items():
                logits[t] += b
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def test_biased_greedy_matches_transformers(model_factory):
    from transformers import AutoModelForCausalLM

    path = model_factory()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 19, 12)]
    unbiased = _hf_biased_greedy(hf, prompts[0], {}, 8)
    # push the unbiased path's 2nd token down hard and two random ids up moderately
    biases = [{unbiased[1]: -100.0, 17: 3.5, 250: 2.0}, {}, {"42": 100.0}]
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128, num_threads=1)
    for i, (p, b) in enumerate(zip(prompts, biases)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias=b))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    for i, (p, b) in enumerate(zip(prompts, biases)):
        ref = _hf_biased_greedy(hf, p, {int(k): v for k, v in b.items()}, 8)
        assert got[f"r{i}"] == ref, f"request {i}"
    assert got["r0"] != unbiased
    assert got["r2"] == [42] * 8  # +100 dominates every step
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_one_scatter_adds_every_rows_bias():
    logits = torch.zeros(3, 10)
    params = [SamplingParams(logit_bias={1: 2.0, 9: -1.5}), SamplingParams(), SamplingParams(logit_bias={1: 0.5})]
    apply_logit_bias(logits, params)
    expected = torch.zeros(3, 10)
    expected[0, 1], expected[0, 9], expected[2, 1] = 2.0, -1.5, 0.5
    assert torch.equal(logits, expected)


def test_bad_logit_bias_is_refused_naming_the_field(model_factory):
    engine = build_engine(model=str(model_factory()), progress=False, block_size=4, num_blocks=64, num_threads=1)
    vocab = engine.model_info.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.field == "logit_bias" and str(vocab) in str(e.value)
    for bad in ({5: 100.5}, {5: float("nan")}, {-1: 1.0}, {"five": 1.0}, [1, 2]):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.field == "logit_bias"
    assert not engine.has_unfinished()
    assert not SamplingParams(logit_bias={5: 1.0}).can_speculate
