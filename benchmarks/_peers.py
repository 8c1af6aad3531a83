"""engine_throughput's peer: Hugging Face transformers `generate`, static batches and batch 1.

Everything is greedy with EOS disabled, so each request's useful output is exactly the
tokens it asked for; a static batch runs to its longest request (`max_new_tokens` = the
batch's largest output length) and only the requested tokens count as useful.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from _workloads import Workload


def load_hf(model_path: Path):
    """(model, tokenizer, pad id) of a local HF folder, float32, left padding, EOS off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # belt and braces; also passed per call
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return model, tok, pad_id


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> tuple[list[list[int]], float]:
    """One left-padded greedy batch; returns each row's generated ids and the wall time."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_id, eos_token_id=None)
    wall = time.perf_counter() - t0
    return out[:, width:].tolist(), wall


def run_hf_static(model, workload: Workload, batch_size: int, pad_id: int, repeats: int = 1) -> dict:
    """Static batches in arrival order; each batch runs to its longest request."""
    idx = list(range(workload.num_requests))
    batches = [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    walls, generated = [], 0
    for r in range(repeats):
        total = 0.0
        generated = 0
        for b in tqdm(batches, desc=f"transformers static batch {batch_size}"
                      + (f" (repeat {r + 1}/{repeats})" if repeats > 1 else ""), leave=False):
            max_new = max(workload.output_lens[i] for i in b)
            outs, wall = hf_generate(model, [workload.prompts[i] for i in b], max_new, pad_id)
            assert all(len(o) == max_new for o in outs), "transformers stopped early (EOS not disabled?)"
            total += wall
            generated += max_new * len(b)
        walls.append(total)
    useful = workload.total_output_tokens
    wall = statistics.median(walls)
    return {
        "label": f"transformers static batch {batch_size}",
        "batch_size": batch_size,
        "num_batches": len(batches),
        "useful_output_tokens": useful,
        "generated_tokens": generated,
        "wall_s": wall,
        "wall_s_all": walls,
        "tok_per_s": useful / wall,
    }


def run_hf_batch1(model, workload: Workload, subset: int, pad_id: int) -> dict:
    """One prompt at a time on the first `subset` requests; tokens/s on that subset."""
    n = min(subset, workload.num_requests)
    outputs, wall = [], 0.0
    for i in tqdm(range(n), desc="transformers batch 1", leave=False):
        outs, w = hf_generate(model, [workload.prompts[i]], workload.output_lens[i], pad_id)
        outputs.append(outs[0])
        wall += w
    useful = sum(workload.output_lens[:n])
    tps = useful / wall
    return {
        "label": f"transformers batch 1 (first {n} requests)",
        "subset_requests": n,
        "useful_output_tokens": useful,
        "generated_tokens": useful,
        "wall_s": wall,
        "tok_per_s": tps,
        "estimated_full_workload_wall_s": workload.total_output_tokens / tps,
        "_outputs": outputs,
    }


def sanity_check(kv_outputs: list[list[int]], hf_b1_outputs: list[list[int]], model, workload: Workload,
                 pad_id: int, n: int = 4) -> dict:
    """kvmesh greedy == transformers batch-1 greedy on the first n requests (token for token)."""
    n = min(n, workload.num_requests)
    per = []
    for i in range(n):
        ref = hf_b1_outputs[i] if i < len(hf_b1_outputs) else None
        if ref is None:  # outside the timed subset (smoke): run it untimed
            ref = hf_generate(model, [workload.prompts[i]], workload.output_lens[i], pad_id)[0][0]
        ours = kv_outputs[i]
        first_diff = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if first_diff is None and len(ours) != len(ref):
            first_diff = min(len(ours), len(ref))
        per.append({"request": i, "tokens": len(ref), "match": first_diff is None, "first_mismatch": first_diff})
    return {"requests_compared": n, "all_match": all(p["match"] for p in per), "per_request": per}
