"""Speculative decoding: proposers draft k tokens, the target verifies them in one pass.

Lossless by construction (Leviathan et al. 2023; Chen et al. 2023): draft token d_i,
drawn from the proposer's distribution q_i, is accepted with probability
min(1, p_i(d_i) / q_i(d_i)) where p_i is the target's (temperature / top-k / top-p
processed) distribution; at the first rejection the token is resampled from
normalize(max(0, p_i - q_i)); if all k are accepted, a bonus token is drawn from
p_{k+1}. The output distribution is exactly p. Greedy requests accept a draft iff it
equals the target argmax, so their output is token-for-token the target's.

Proposers:
- `NgramProposer` (prompt lookup): find the most recent earlier occurrence of the
  sequence's last n tokens (n from ngram_max down to ngram_min) and propose the k
  tokens that followed it. Deterministic: q is a point mass on each draft.
- `DraftModelProposer`: a smaller (or quantized, or distilled) model with the same
  tokenizer and its own paged KV cache over the *same block tables* as the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.outputs import ScheduledSeq, SchedulerOutput
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.worker.sampler import processed_probs


def accept_prob(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """The acceptance rule, min(1, p/q). (A module function so a test can break it.)"""
    return torch.clamp(p_d / q_d, max=1.0)


def verify(
    logits: torch.Tensor,
    draft: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Tokens to append for one request: accepted drafts + one corrected/bonus token.

    logits: (k + 1, V) target logits at the positions that predict draft_1..draft_k and
    the bonus token; draft_probs: (k, V) proposer distributions, None for a
    deterministic proposer (point masses).
    """
    k = len(draft)
    if params.greedy:
        target = logits.argmax(-1).tolist()
        out = []
        for i, d in enumerate(draft):
            if d != target[i]:
                return out + [target[i]]
            out.append(d)
        return out + [target[k]]
    p = processed_probs(logits, [params] * (k + 1))  # (k + 1, V)
    draft_t = torch.tensor(list(draft), device=logits.device)
    rows = torch.arange(k, device=logits.device)
    p_d = p[rows, draft_t]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs[rows, draft_t]
    u = torch.rand(k, generator=generator, device=logits.device)
    accept = u < accept_prob(p_d, q_d)
    out: list[int] = []
    for i, d in enumerate(draft):
        if bool(accept[i]):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q numerically: any draw from p is exact
            residual = p[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # (k, V); None for deterministic proposers


class NgramProposer:
    method = "ngram"

    def __init__(self, k: int, ngram_min: int = 1, ngram_max: int = 4):
        self.k, self.ngram_min, self.ngram_max = k, ngram_min, ngram_max

    def propose_one(self, tokens: Sequence[int], k: int) -> list[int]:
        n_tok = len(tokens)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            tail = list(tokens[n_tok - n :])
            # most recent earlier match first: recent context predicts best
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start] == tail[0] and list(tokens[start : start + n]) == tail:
                    follow = list(tokens[start + n : start + n + k])
                    if follow:
                        return follow
        return []

    def propose(self, requests: list[Request], block_tables: dict[str, list[int]], k: int) -> dict[str, Proposal]:
        out = {}
        for req in requests:
            toks = self.propose_one(req.all_token_ids, k)
            if toks:
                out[req.request_id] = Proposal(toks)
        return out

    def forget(self, request_id: str) -> None:
        pass


class DraftModelProposer:
    """Runs a draft model with its own KV cache, block-for-block parallel to the target's.

    The draft's cache uses the target's block ids, so no second block manager is
    needed: the engine reserves the target's slots for the k draft positions before
    proposing. Per request the proposer remembers how many tokens its cache holds and
    catches up (a prefill chunk) before drafting; a preempted request starts over.
    """

    method = "draft"

    def __init__(self, runner, k: int):
        self.runner = runner  # a ModelRunner over the draft model
        self.k = k
        self._computed: dict[str, tuple[int, int]] = {}  # rid -> (tokens in cache, preemptions)

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)
        self.runner.forget(request_id)

    def propose(self, requests: list[Request], block_tables: dict[str, list[int]], k: int) -> dict[str, Proposal]:
        if not requests or k < 1:
            return {}
        toks: dict[str, list[int]] = {r.request_id: [] for r in requests}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        seqs = []
        for req in requests:
            done, preempts = self._computed.get(req.request_id, (0, req.num_preemptions))
            if preempts != req.num_preemptions:
                done = 0  # blocks were freed and reallocated: the draft's KV is gone
            done = min(done, req.num_tokens - 1)
            seqs.append(self._seq(req, req.all_token_ids[done:], done, block_tables[req.request_id]))
            self._computed[req.request_id] = (req.num_tokens, req.num_preemptions)
        for step in range(k):
            out = self.runner.execute(SchedulerOutput(seqs), return_probs=True)
            for s in seqs:
                t = out.sampled_token_ids[s.request_id][0]
                toks[s.request_id].append(t)
                if out.probs is not None and s.request_id in out.probs:
                    probs[s.request_id].append(out.probs[s.request_id])
            if step + 1 < k:
                seqs = [self._seq(r, [toks[r.request_id][-1]], r.num_tokens + step, block_tables[r.request_id])
                        for r in requests]
        result = {}
        for req in requests:
            rid = req.request_id
            p = torch.stack(probs[rid]) if len(probs[rid]) == k else None
            result[rid] = Proposal(toks[rid], p)
        return result

    @staticmethod
    def _seq(req: Request, token_ids: list[int], start: int, block_ids: list[int]) -> ScheduledSeq:
        return ScheduledSeq(req.request_id, token_ids, start, block_ids, True, req.sampling_params,
                            req.prompt_token_ids, req.output_token_ids)
