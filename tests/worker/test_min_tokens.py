"""min_tokens (vLLM's): until a request has min_tokens output tokens, EOS and its stop
tokens are never sampled and its stop strings are not looked for; then they end it as
usual. EOS is made the certain next token with a +100 logit_bias, so the tests are exact."""

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.errors import InvalidRequestError
from kvmesh.worker.sampler import ban_tokens

PROMPT = [5, 9, 14, 3, 77, 120, 8]


@pytest.fixture(scope="module")
def engine(model_factory):
    return build_engine(model=str(model_factory()), progress=False, block_size=4, num_blocks=128, num_threads=1)


def _run(engine, params: SamplingParams, rid: str):
    engine.add_request(rid, PROMPT, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.outputs[0]
    raise AssertionError("the request never finished")


def test_eos_is_banned_until_min_tokens(engine):
    eos = engine.model_info.eos_token_id
    forced = {eos: 100.0}
    plain = _run(engine, SamplingParams(max_tokens=10, temperature=0, logit_bias=forced), "plain")
    assert plain.token_ids == [eos] and plain.finish_reason == "stop"
    held = _run(engine, SamplingParams(max_tokens=10, min_tokens=4, temperature=0, logit_bias=forced), "held")
    assert len(held.token_ids) == 5 and eos not in held.token_ids[:4]
    assert held.token_ids[4] == eos and held.finish_reason == "stop"
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_stop_tokens_are_banned_until_min_tokens(engine):
    first = _run(engine, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), "first").token_ids[0]
    stopped = _run(engine, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[first],
                                          logit_bias={first: 100.0}), "stopped")
    assert stopped.token_ids == [first]
    held = _run(engine, SamplingParams(max_tokens=6, min_tokens=3, temperature=0, ignore_eos=True,
                                       stop_token_ids=[first], logit_bias={first: 100.0}), "held-stop")
    assert first not in held.token_ids[:3] and held.token_ids[3] == first and len(held.token_ids) == 4


def test_stop_strings_count_only_after_min_tokens():
    class Chars:  # one character per token id (ids are code points)
        def decode(self, ids, **_):
            return "".join(chr(i) for i in ids)

    params = SamplingParams(max_tokens=10, min_tokens=3, stop=["b"])
    detok = IncrementalDetokenizer(Chars(), [ord("x")], params)
    assert detok.update([ord("b")], False) == ("b", False)  # the 1st output token: not a stop yet
    assert detok.update([ord("a")], False)[1] is False
    _, hit = detok.update([ord("b")], False)  # the 3rd output token: stop strings count again
    assert hit and detok.text == "ba"


def test_min_tokens_is_validated_and_opts_out_of_speculation():
    for bad in (-1, 17, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(max_tokens=16, min_tokens=bad)
        assert e.value.field == "min_tokens"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    assert e.value.field == "min_tokens"
    assert not SamplingParams(min_tokens=2).can_speculate and SamplingParams().can_speculate


def test_ban_tokens_masks_only_the_given_rows():
    logits = torch.zeros(3, 6)
    ban_tokens(logits, [(1, 5), (), (0, 99)])  # ids past the vocabulary are skipped
    assert logits[0, 1] == logits[0, 5] == logits[2, 0] == float("-inf")
    assert torch.isfinite(logits).sum() == 18 - 3
