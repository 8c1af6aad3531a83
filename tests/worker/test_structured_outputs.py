"""Structured outputs on a tiny random model: constrained greedy decoding equals transformers'
greedy loop with the same grammar mask applied to its logits, token for token; every output
matches its spec; speculation, preemption and the P/D first-token path change nothing; a spec
the grammar engine refuses is an InvalidRequestError naming the field; no KV block leaks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.structured_outputs import StructuredOutputsParams as SO
from kvmesh.errors import InvalidRequestError
from kvmesh.worker.structured import GrammarCompiler, apply_bitmask, bitmask_words, pack_bits, unpack_bits

# Specs a random model must finish within max_tokens: every free-form part is bounded.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": ["fox", "dog", "cat"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"]},
    },
    "required": ["kind", "n", "inner"],
}
SPECS = {
    "json": SO(json=SCHEMA, disable_any_whitespace=True),
    "regex": SO(regex=r"[a-c]{2,5}-[0-9]{1,3}"),
    "choice": SO(choice=["quick brown", "lazy dog", "café"]),
    "grammar": SO(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [0-9] | "x"'),
}


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(SPECS["regex"].regex, text), text
    elif kind == "choice":
        assert text in SPECS["choice"].choice
    else:
        assert re.fullmatch(r"\((\d|x)(,(\d|x)){0,3}\)", text), text


def _llm(path, **kw) -> LLM:
    torch.set_num_threads(1)
    kw = {"block_size": 4, "num_blocks": 400, "max_model_len": 256, "max_num_batched_tokens": 32, **kw}
    return LLM(str(path), progress=False, **kw)


def _prompts(n: int, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(base * 3)  # repetitive: prompt lookup has drafts to offer
    return out


def _texts(llm: LLM, outs) -> list[str]:
    return [llm.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return _llm(tiny_llama)


def _hf_constrained_greedy(hf, compiler: GrammarCompiler, spec: SO, prompt: list[int], max_new: int,
                           eos: int) -> list[int]:
    """The oracle: transformers' logits, masked by a fresh matcher of the same grammar, argmax."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiler.compile(spec))
    vocab = compiler.vocab_size
    mask = torch.full((1, bitmask_words(vocab)), -1, dtype=torch.int32)
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()[None].contiguous()
        m.fill_next_token_bitmask(mask, 0)
        allowed = unpack_bits(mask, vocab)[0]
        logits[0, ~allowed] = float("-inf")
        t = int(logits.argmax())
        out.append(t)
        if t == eos:
            break
        assert m.accept_token(t)
    return out


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_equals_masked_transformers_loop(llm, tiny_llama, kind):
    from transformers import AutoModelForCausalLM

    spec = SPECS[kind]
    prompts = _prompts(3, seed=1)
    params = SamplingParams(max_tokens=80, temperature=0, structured_outputs=spec)
    outs = llm.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    compiler = llm.engine.executor.runner.grammar.compiler
    eos = llm.engine.eos_token_id
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert c.token_ids == _hf_constrained_greedy(hf, compiler, spec, p, 80, eos)
        assert c.finish_reason == "stop" and c.token_ids[-1] == eos  # the grammar closed, then EOS
    for text in _texts(llm, outs):
        _check(kind, text)
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks
    assert llm.engine.executor.runner.grammar.num_requests == 0  # matchers forgotten


def test_sampled_outputs_match_their_specs_in_one_mixed_batch(llm):
    """Constrained and free requests batched together, seeded and unseeded, with penalties and
    logprobs: every constrained output matches, a free one is unaffected by its neighbours."""
    prompts = _prompts(9, seed=2)
    kinds = list(SPECS) * 2
    params = [SamplingParams(max_tokens=80, temperature=1.0, top_p=0.95, seed=i if i % 2 else None,
                             repetition_penalty=1.1 if i == 3 else 1.0, logprobs=2 if i == 4 else None,
                             structured_outputs=SPECS[k]) for i, k in enumerate(kinds)]
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts[:8] + prompts[8:], params + [free])
    for kind, text, o in zip(kinds, _texts(llm, outs[:8]), outs):
        assert o.outputs[0].finish_reason == "stop"
        _check(kind, text)
    # logprobs are of the masked distribution: the sampled token's is finite, a refused
    # alternative's is -inf (a forced token has no finite runner-up)
    lps = outs[4].outputs[0].logprobs
    assert all(lp.logprob > float("-inf") and lp.top[0][1] > float("-inf") for lp in lps)
    assert any(lp.top[1][1] == float("-inf") for lp in lps)
    assert outs[8].outputs[0].token_ids == llm.generate(prompts[8:], free)[0].outputs[0].token_ids
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks


@pytest.mark.parametrize("spec_cfg", [
    {"method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1},
    {"method": "draft", "model": "self", "quantization": "int8", "num_speculative_tokens": 3},
])
def test_speculation_equals_no_speculation(llm, tiny_llama, spec_cfg):
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=SPECS[k]) for k in SPECS]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec_llm = _llm(tiny_llama, speculative=spec_cfg)
    got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    assert got == ref
    stats = spec_llm.engine.stats()
    assert stats["spec_proposed_tokens"] > 0
    assert spec_llm.engine.num_free_blocks == spec_llm.engine.num_usable_blocks


def test_preemption_keeps_the_grammar_state(llm, tiny_llama):
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=SPECS[k]) for k in list(SPECS) * 2][:6]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = _llm(tiny_llama, num_blocks=26, max_model_len=96)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == ref
    assert small.engine.num_free_blocks == small.engine.num_usable_blocks


def test_prefilled_first_token_continues_the_grammar(llm):
    """P/D: the decode worker runs prompt + [first token] with prefilled_output_ids=(first,) and
    must produce the rest of the unified output."""
    spec = SPECS["json"]
    prompt = _prompts(1, seed=5)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=80, temperature=0, structured_outputs=spec))[0]
    ids = full.outputs[0].token_ids
    cont = SO(json=SCHEMA, disable_any_whitespace=True, prefilled_output_ids=(ids[0],))
    rest = llm.generate([prompt + ids[:1]], SamplingParams(max_tokens=79, temperature=0, structured_outputs=cont))
    assert rest[0].outputs[0].token_ids == ids[1:]


@pytest.mark.parametrize("spec, field", [
    (SO(json={"type": "object", "properties": {"a": {"type": "wat"}}}), "structured_outputs.json"),
    (SO(regex="(ab"), "structured_outputs.regex"),
    (SO(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
])
def test_bad_spec_is_invalid_request_and_engine_keeps_serving(llm, spec, field):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, structured_outputs=spec))
    assert err.value.field == field and "cannot compile" in str(err.value)
    assert "/project/" not in str(err.value)  # the C++ source location is stripped
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0, structured_outputs=SPECS["choice"]))
    assert _texts(llm, out)[0] in SPECS["choice"].choice
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks


def test_compiled_grammars_are_cached_per_spec(tiny_llama):
    from transformers import AutoTokenizer

    c = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_llama), 384, (2,), cache_size=2)
    a = c.compile(SO(json=SCHEMA))
    assert c.compile(SO(json=json.dumps(SCHEMA))) is a  # same schema as text: same key
    c.compile(SO(regex="[ab]+"))
    c.compile(SO(choice=["x", "y"]))  # evicts the least recently used (the schema)
    assert len(c) == 2 and (c.hits, c.misses) == (1, 3)
    assert c.compile(SO(json=SCHEMA)) is not a


def test_bitmask_helpers_agree_with_xgrammar():
    g = torch.Generator().manual_seed(0)
    vocab = 70
    allowed = torch.rand(3, bitmask_words(vocab) * 32, generator=g) < 0.4
    mask = torch.stack([pack_bits(row) for row in allowed])
    assert torch.equal(unpack_bits(mask, vocab), allowed[:, :vocab])
    logits = torch.randn(4, vocab, generator=g)
    theirs = logits.clone()
    full = torch.full((4, mask.shape[1]), -1, dtype=torch.int32)
    full[[0, 2, 3]] = mask
    ref64 = logits.clone().to(torch.float64)
    apply_bitmask(ref64, full, [0, 2, 3])  # the torch path (not float32)
    apply_bitmask(theirs, full, [0, 2, 3])  # xgrammar's CPU kernel
    assert torch.equal(torch.isinf(ref64), torch.isinf(theirs))
    assert torch.equal(torch.isinf(ref64[[0, 2, 3]]), ~allowed[:, :vocab])
    assert torch.isinf(theirs[1]).sum() == 0
