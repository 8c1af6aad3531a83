"""kvmesh's sampler (worker/sampler.py) against a plain PyTorch reference written from the
definitions (vLLM / OpenAI / transformers), one row at a time, in float64:

- repetition penalty (transformers / vLLM): for every token seen in prompt + output, a
  positive logit is divided by the penalty, a negative one multiplied by it;
- presence / frequency penalties (OpenAI): logit -= presence * [count > 0] + frequency * count,
  counts over the OUTPUT tokens only;
- temperature: logits / T (T == 0: greedy, argmax of the penalized logits);
- top-k: keep the k most likely tokens (k <= 0 or k >= vocab: all);
- min-p: drop tokens whose probability is below min_p * the largest probability (a ratio, so
  it is the same before or after top-k);
- top-p (nucleus), on the distribution left by top-k / min-p: keep the smallest set of most
  likely tokens whose cumulative probability reaches top_p (always at least one);
- logprobs: kvmesh reports log-softmax of the logits AFTER penalties and BEFORE temperature
  and the filters (sampler.sample: `logits.log_softmax(-1)` right after apply_penalties), for
  the sampled token plus the top n.

Checks: the distribution kvmesh samples from (`return_probs=True`) equals the reference's
final probability vector, support included, for each parametrized batch (rows with
different parameters); seeded draws land only in the reference's support, and a large
batch of draws matches the reference frequencies; greedy rows pick the argmax of the
penalized logits; logprobs match.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.worker.sampler import sample

VOCAB = 50


# ---------------------------------------------------------------- the reference

def ref_penalized(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int],
                  output_ids: list[int]) -> torch.Tensor:
    """(V,) float64 logits after repetition / presence / frequency penalties."""
    x = logits.double().clone()
    if p.repetition_penalty != 1.0:
        for t in set(prompt_ids) | set(output_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(output_ids).items():
        x[t] -= p.presence_penalty * 1.0 + p.frequency_penalty * count
    return x


def ref_probs(penalized: torch.Tensor, p: SamplingParams, margin: float = 1e-5) -> torch.Tensor:
    """(V,) float64 distribution a sampling row draws from. Also asserts the case is well
    posed: no probability / cumulative sum within `margin` of a min-p / top-p threshold
    (where float32 vs float64 rounding could flip a token in or out of the support)."""
    assert p.temperature > 0
    probs = torch.softmax(penalized / p.temperature, -1)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    order = sorted(range(VOCAB), key=lambda t: -probs[t].item())
    if 0 < p.top_k < VOCAB:
        keep[:] = False
        keep[order[: p.top_k]] = True
    if p.min_p > 0:
        threshold = p.min_p * probs.max()
        others = torch.arange(VOCAB) != probs.argmax()  # (min_p == 1 keeps exactly the max)
        assert ((probs - threshold).abs() > margin * threshold)[others].all(), "min-p threshold too close"
        keep &= probs >= threshold
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    kept = kept / kept.sum()
    if p.top_p < 1.0:
        nucleus, mass = [], 0.0
        for t in order:
            if not keep[t]:
                continue
            nucleus.append(t)
            mass += kept[t].item()
            if mass >= p.top_p:
                assert mass - p.top_p > margin, "top-p threshold too close to a cumulative sum"
                break
            assert p.top_p - mass > margin, "top-p threshold too close to a cumulative sum"
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[nucleus] = True
        kept = torch.where(keep, kept, torch.zeros_like(kept))
        kept = kept / kept.sum()
    return kept


def ref_logprobs(penalized: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(penalized, -1)


# ---------------------------------------------------------------- the cases

def _batch(rows: list[dict], seed: int):
    """Random logits and histories for the rows: prompt-only tokens, output tokens repeated
    1-4 times (frequency != presence), and each row's two most likely raw tokens in its
    history (so penalties move the argmax and the top of the distribution)."""
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(max_tokens=8, **r) for r in rows]
    logits = torch.randn(len(rows), VOCAB, generator=g) * 2.0
    inputs = []
    for i in range(len(rows)):
        perm = torch.randperm(VOCAB, generator=g).tolist()
        top2 = logits[i].topk(2).indices.tolist()
        rest = [t for t in perm if t not in top2]
        prompt = rest[:6] + [top2[1]] + rest[6:8]  # rest[6:8] also in the output
        output = []
        for j, t in enumerate([top2[0]] + rest[6:8] + rest[8:14]):
            output += [t] * (1 + (j + i) % 4)
        output = [output[k] for k in torch.randperm(len(output), generator=g).tolist()]
        inputs.append((prompt, output))
    return logits, params, inputs


CASES = {
    "temperature": [dict(temperature=t) for t in (0.3, 0.7, 1.0, 1.8)],
    "top_k": [dict(top_k=k, temperature=0.9) for k in (1, 3, 17, VOCAB, VOCAB + 7, -1)],
    "top_p": [dict(top_p=q, temperature=t) for q, t in ((0.05, 1.0), (0.5, 0.8), (0.8, 1.3), (0.95, 1.0))],
    "min_p": [dict(min_p=m, temperature=t) for m, t in ((0.02, 1.0), (0.15, 1.5), (0.5, 0.7), (1.0, 1.0))],
    "repetition": [dict(repetition_penalty=r) for r in (1.3, 2.0, 0.7)],
    "presence": [dict(presence_penalty=v) for v in (0.8, 2.0, -1.0)],
    "frequency": [dict(frequency_penalty=v) for v in (0.6, 2.0, -0.7)],
    "presence+frequency": [dict(presence_penalty=0.5, frequency_penalty=0.9),
                           dict(presence_penalty=-0.5, frequency_penalty=1.5)],
    "all-filters": [dict(top_k=20, top_p=0.9, min_p=0.05, temperature=1.2),
                    dict(top_k=8, top_p=0.6, min_p=0.1, temperature=0.6)],
    "mixed-batch": [
        dict(temperature=0),
        dict(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0),
        dict(temperature=0.8, top_k=10, repetition_penalty=1.4, logprobs=3),
        dict(temperature=1.1, top_p=0.7, presence_penalty=1.2, frequency_penalty=0.4, logprobs=0),
        dict(temperature=1.0, min_p=0.1, frequency_penalty=-0.5, repetition_penalty=0.8),
        dict(temperature=0.5),
        dict(temperature=1.3, top_k=25, top_p=0.85, min_p=0.03, repetition_penalty=1.2,
             presence_penalty=0.3, frequency_penalty=0.7, logprobs=5),
    ],
    "greedy-penalties": [dict(temperature=0, repetition_penalty=r, presence_penalty=pp, frequency_penalty=f,
                              logprobs=2)
                         for r, pp, f in ((1.0, 0, 0), (2.0, 0, 0), (1.0, 1.5, 0), (1.0, 0, 1.0), (1.3, 0.4, 0.8))],
}


def _run(logits, params, inputs, seeds=None, return_probs=True):
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return sample(logits.clone(), params, gens, torch.Generator().manual_seed(1234), inputs,
                  return_probs=return_probs)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_distribution_matches_reference(name, seed):
    logits, params, inputs = _batch(CASES[name], seed)
    tokens, lps, probs = _run(logits, params, inputs)
    for i, p in enumerate(params):
        pen = ref_penalized(logits[i], p, *inputs[i])
        if p.greedy:
            assert tokens[i] == int(pen.argmax()), f"row {i}: greedy must pick the penalized argmax"
            continue
        ref = ref_probs(pen, p)
        ours = probs[i].double()
        assert torch.equal(ours > 0, ref > 0), (
            f"row {i} {p}: support {sorted(torch.nonzero(ours > 0).flatten().tolist())} "
            f"!= reference {sorted(torch.nonzero(ref > 0).flatten().tolist())}")
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"row {i} {p}: {m}")
        assert ref[tokens[i]] > 0, f"row {i}: drew token {tokens[i]} outside the reference support"


def test_disabled_top_p_row_is_not_filtered_by_its_batch():
    """A row without top-p has the full support (the reference's), whatever else is batched
    with it; here a top_p=0.5 row shares the batch. (Regression: the top-p pass ran on every
    row once one row had top_p < 1, and a float32 cumsum that reaches 1.0 before the tail
    dropped the tail tokens of the top_p == 1 row.)"""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(top_p=0.5), SamplingParams()]
    _, _, probs = _run(logits, params, [([], [])] * 2)
    ref = ref_probs(logits[1].double(), params[1])
    assert torch.equal(probs[1] > 0, ref > 0), f"dropped {torch.nonzero(probs[1] == 0).flatten().tolist()}"


def test_penalties_change_the_distribution():
    """The cases are sensitive: each penalty moves the reference away from the plain one."""
    logits, _, inputs = _batch([{}], 0)
    plain = ref_probs(ref_penalized(logits[0], SamplingParams(), *inputs[0]), SamplingParams())
    for kw in (dict(repetition_penalty=1.3), dict(presence_penalty=0.8), dict(frequency_penalty=0.6)):
        p = SamplingParams(**kw)
        assert (ref_probs(ref_penalized(logits[0], p, *inputs[0]), p) - plain).abs().max() > 1e-2, kw
    # frequency differs from presence (counts > 1), repetition sees the prompt
    a, b = SamplingParams(presence_penalty=1.0), SamplingParams(frequency_penalty=1.0)
    assert not torch.allclose(ref_penalized(logits[0], a, *inputs[0]), ref_penalized(logits[0], b, *inputs[0]))
    prompt_only = set(inputs[0][0]) - set(inputs[0][1])
    assert prompt_only
    r = ref_penalized(logits[0], SamplingParams(repetition_penalty=2.0), *inputs[0])
    assert all(r[t] != logits[0, t] for t in prompt_only if logits[0, t] != 0)


@pytest.mark.parametrize("name", [n for n in CASES if any(r.get("temperature", 1.0) > 0 for r in CASES[n])])
def test_seeded_draws_stay_in_reference_support(name):
    logits, params, inputs = _batch(CASES[name], 3)
    supports = []
    for i, p in enumerate(params):
        pen = ref_penalized(logits[i], p, *inputs[i])
        supports.append(None if p.greedy else set(torch.nonzero(ref_probs(pen, p) > 0).flatten().tolist()))
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
    drawn = [set() for _ in params]
    for _ in range(150):
        tokens, _, _ = sample(logits.clone(), params, gens, torch.Generator().manual_seed(0), inputs)
        for i, t in enumerate(tokens):
            if supports[i] is not None:
                assert t in supports[i], f"row {i} {params[i]}: token {t} outside {sorted(supports[i])}"
                drawn[i].add(t)
    for i, s in enumerate(supports):
        if s is not None and len(s) > 1:
            assert len(drawn[i]) > 1, f"row {i}: 150 draws from a {len(s)}-token support gave one token"


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.8, top_k=10, repetition_penalty=1.4),
    dict(temperature=1.1, top_p=0.7, presence_penalty=1.2, frequency_penalty=0.4),
    dict(temperature=1.3, top_k=25, top_p=0.85, min_p=0.03, repetition_penalty=1.2, frequency_penalty=0.7),
])
def test_draw_frequencies_match_reference(kwargs):
    """4000 unseeded copies of one row in a batch: empirical frequencies vs the reference
    (total variation distance; ~0.03 expected at this size, fixed seeds)."""
    logits, params, inputs = _batch([kwargs], 5)
    n = 4000
    ref = ref_probs(ref_penalized(logits[0], params[0], *inputs[0]), params[0])
    tokens, _, _ = sample(logits.expand(n, VOCAB).clone(), params * n, [None] * n,
                          torch.Generator().manual_seed(7), inputs * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / n
    assert freq[ref == 0].sum() == 0
    tv = 0.5 * (freq - ref).abs().sum().item()
    assert tv < 0.06, f"total variation {tv:.3f}"


@pytest.mark.parametrize("name", ["mixed-batch", "greedy-penalties"])
def test_logprobs_match_reference(name):
    logits, params, inputs = _batch(CASES[name], 2)
    tokens, lps, _ = _run(logits, params, inputs, seeds=[11 + i for i in range(len(params))])
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert lps[i] is None
            continue
        ref = ref_logprobs(ref_penalized(logits[i], p, *inputs[i]))
        lp = lps[i]
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(ref[tokens[i]].item(), abs=1e-5)
        vals, ids = ref.topk(p.logprobs)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-5)
        if p.greedy and p.logprobs:
            assert lp.top[0][0] == tokens[i]
    # logprobs are of the penalized logits, not the raw ones (the cases penalize the argmax)
    i = next(i for i, p in enumerate(params) if p.logprobs is not None and p.needs_penalties)
    raw = torch.log_softmax(logits[i].double(), -1)
    assert abs(lps[i].logprob - raw[tokens[i]].item()) > 1e-3
