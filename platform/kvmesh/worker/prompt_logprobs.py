"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): the logprob of every prompt
token given its prefix, plus the top-k alternatives, from the logits of the prompt positions
a prefill chunk computes.

The runner normally applies the LM head to the last position of a sampling sequence only;
for requests that ask, it is applied to all of the chunk's prompt positions as well
(position j scores prompt token j + 1; the prompt's last position is the normal sample).
Their full-vocabulary rows are taken in slices so a long chunk never holds chunk x vocab
logits at once. Such requests never read the prefix cache (engine/kv_cache_manager.py):
every prompt position is computed, in order, chunk after chunk.
"""

from __future__ import annotations

import torch

from kvmesh.engine.outputs import PromptLogprobs, ScheduledSeq, TokenLogprobs
from kvmesh.layers.attention import SeqSpan

# Prompt positions scored per LM-head call (bounds the (rows, vocab) float32 logits).
ROWS_PER_SLICE = 256


def compute_prompt_logprobs(model, hidden: torch.Tensor, spans: list[SeqSpan],
                            seqs: list[ScheduledSeq]) -> dict[str, PromptLogprobs]:
    """{request id: the prompt tokens this step's chunk scores} for the sequences that ask.
    `hidden` is the step's (T, hidden) output; spans[i] locates seqs[i] in it."""
    out: dict[str, PromptLogprobs] = {}
    for span, seq in zip(spans, seqs):
        k = seq.sampling_params.prompt_logprobs
        prompt = seq.prompt_token_ids
        # positions start .. end - 1 score prompt tokens start + 1 .. end
        start, end = seq.start_pos, min(seq.start_pos + seq.num_tokens, len(prompt) - 1)
        if k is None or end <= start:
            continue
        items: list[TokenLogprobs] = []
        for a in range(start, end, ROWS_PER_SLICE):
            b = min(a + ROWS_PER_SLICE, end)
            rows = hidden[span.q_start + a - start : span.q_start + b - start]
            lp = model.compute_logits(rows).float().log_softmax(-1)  # (b - a, V)
            targets = torch.tensor(prompt[a + 1 : b + 1], dtype=torch.long, device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
            tops = [[] for _ in chosen]
            if k:
                vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            items += [TokenLogprobs(t, c, top) for t, c, top in zip(targets.tolist(), chosen, tops)]
        out[seq.request_id] = PromptLogprobs(start + 1, items)
    return out
