"""Test helpers: drive an engine step by step and collect per-step logits; reference
outputs from transformers on the same checkpoint."""

from __future__ import annotations

import psutil
import torch

from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.layers.attention import CpuPagedAttentionBackend


def run_collecting_logits(engine: LLMEngine, prompts, params, loras=None) -> tuple[dict, dict]:
    """Run prompts to completion (prompt i under LoRA adapter `loras[i]`, if given); returns
    ({rid: token ids}, {rid: [(V,) logits per token]})."""
    loras = loras or [None] * len(prompts)
    rids = [engine.add_request(f"r{i}", p, params, lora=name) for i, (p, name) in enumerate(zip(prompts, loras))]
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


def run_one_at_a_time(engine: LLMEngine, prompts, max_tokens: int) -> tuple[list, list]:
    """Each prompt alone (batch-1 decode), greedy: ([tokens per prompt], [(N, V) logits per prompt])."""
    tokens, logits = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for prompt in prompts:
        t, lg = run_collecting_logits(engine, [prompt], params)
        tokens.append(t["r0"])
        logits.append(torch.stack(lg["r0"]))
    assert engine.num_free_blocks == engine.num_usable_blocks
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


def stack_then_loop(make_engine, prompts, stack_calls, monkeypatch, max_new: int = 12):
    """Runs `prompts` one at a time on a fresh engine with the stack, then on another
    without it (a fresh one: the first one's prefix cache would change how prompts are
    prefilled); asserts every decode step ran the stack and both give the same bits."""
    engine = make_engine()
    stack_calls.clear()  # (building warms the engine up)
    tokens, logits = run_one_at_a_time(engine, prompts, max_new)
    # Every decode step, and a one-token prompt's prefill (a one-token step too).
    expected = sum(max_new - 1 + (len(p) == 1) for p in prompts)
    assert sum(stack_calls) == expected, "every decode step should run decode_stack"
    with monkeypatch.context() as m:
        m.setattr(CpuPagedAttentionBackend, "runs_decode_stack", False)
        loop_tokens, loop_logits = run_one_at_a_time(make_engine(), prompts, max_new)
    assert sum(stack_calls) == expected
    assert loop_tokens == tokens
    for i, (a, b) in enumerate(zip(logits, loop_logits)):
        assert torch.equal(a, b), f"prompt {i}"
    return tokens, logits


def make_adapter(base, out, seed: int, **lora_kwargs):
    """A peft adapter of the checkpoint at `base`, every LoRA weight random, saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.empty(p.shape).normal_(0, 0.15, generator=g))
    peft_model.save_pretrained(out)
    return out


def peft_reference(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def is_rank_process(p: psutil.Process) -> bool:
    """A parallel rank process: a fork of a replica's fork server (multiprocessing forkserver:
    the server and its forks share its command line; the server's parent is the replica)."""
    try:
        parent = p.parent()
        return parent is not None and all("multiprocessing.forkserver" in " ".join(q.cmdline()) for q in (p, parent))
    except psutil.NoSuchProcess:
        return False
