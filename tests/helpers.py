"""Test helpers: drive an engine step by step and collect per-step logits; reference
outputs from transformers on the same checkpoint."""

from __future__ import annotations

import torch

from kvmesh.engine.engine import LLMEngine


def run_collecting_logits(engine: LLMEngine, prompts, params) -> tuple[dict, dict]:
    """Run prompts to completion; returns ({rid: token ids}, {rid: [(V,) logits per token]})."""
    rids = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    tokens = {r: [] for r in rids}
    logits = {r: [] for r in rids}
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        out = engine.executor.runner.execute(sched, return_logits=True)
        for rid, lg in out.logits.items():
            logits[rid].append(lg)
        for res in engine.scheduler.update_from_output(sched, out):
            tokens[res.request.request_id].extend(res.new_token_ids)
    engine._states.clear()
    return tokens, logits


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
    )
    return out[0, len(prompt_ids):].tolist()


def hf_step_logits(hf_model, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """Logits that predicted each generated token, from one full forward pass: (N, V)."""
    seq = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        lg = hf_model(seq).logits[0].float()
    n = len(prompt_ids)
    return lg[n - 1 : n - 1 + len(generated)]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-3) -> None:
    """Relative to the scale of the reference logits (elementwise rtol breaks near 0)."""
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol} * max |ref| {scale:.3g}"
