"""engine_throughput's kvmesh side: the offline workload, batch-1 decode, and the bandwidth floor.

Protocols (the peers in ``_peer_procs`` follow the same ones):

* **Offline**: ``warmup_passes`` untimed passes of the whole workload (the first full pass
  is ~30% slower, on kvmesh and vLLM alike: allocator and oneDNN warm-up), then ``repeats``
  timed passes, every request submitted at once to ``LLM.generate``; the prefix cache is
  reset before each pass. Throughput = requested output tokens / median wall time.
* **Batch-1 decode**: one greedy request (the same prompt ids as llama.cpp gets), one untimed
  warm-up run, then ``repeats`` runs; a run's decode tok/s = (tokens - 1) / the time of the
  steps after the first token (the prefill step excluded); the median over runs.
* **Decode step vs floor**: the median engine step of lone decodes, against weight bytes /
  measured copy bandwidth.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from kvmesh import SamplingParams

from _common import time_calls
from _workloads import Workload


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> dict:
    """Copy bandwidth: time dst.copy_(src) on `mib` MiB float32 tensors; 2*bytes/median."""
    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros_like(src)
    # The warmup also faults the pages in.
    times = time_calls(functools.partial(dst.copy_, src), repeats, warmup=1)
    nbytes = n * 4
    med = statistics.median(times)
    del src, dst
    gc.collect()
    return {"tensor_mib": mib, "repeats": repeats, "copy_times_s": times, "median_copy_s": med,
            "bandwidth_gbps": 2 * nbytes / med / 1e9}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters; `parameters()` dedups the tied embedding / lm_head."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _lone_request(engine, tag: str, prompt: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
    """Step one request to the end alone; (seconds per step, generated ids)."""
    assert not engine.has_unfinished(), "the engine must be idle for batch-1 timing"
    engine.add_request(f"{tag}-{time.monotonic_ns()}", prompt, _greedy(max_tokens))
    steps, ids = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t0)
        for o in outs:
            ids.extend(o.outputs[0].delta_token_ids)
    return steps, ids


def decode_step_time(llm, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    """Time each engine step of a lone request; median over decode steps (prefill excluded)."""
    prefill_s, decode_s = [], []
    for r in tqdm(range(repeats), desc="kvmesh batch-1 decode steps"):
        steps, _ = _lone_request(llm.engine, f"b1-{r}", prompt, max_tokens)
        prefill_s.append(steps[0])
        decode_s.extend(steps[1:])
    return {
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "num_decode_steps": len(decode_s),
        "prefill_step_ms": [t * 1e3 for t in prefill_s],
        "decode_step_ms_median": statistics.median(decode_s) * 1e3,
        "decode_step_ms_mean": statistics.fmean(decode_s) * 1e3,
        "decode_step_ms_min": min(decode_s) * 1e3,
        "decode_step_ms_p90": float(np.percentile(decode_s, 90)) * 1e3,
    }


def b1_decode(llm, prompt: list[int], max_tokens: int, repeats: int, label: str) -> dict:
    """Greedy batch-1 decode tok/s, llama.cpp's protocol: 1 warm-up run, median of `repeats` runs."""
    _lone_request(llm.engine, "b1w", prompt, max_tokens)
    runs, ids = [], []
    for r in tqdm(range(repeats), desc=f"{label} batch-1 decode", leave=False):
        steps, ids = _lone_request(llm.engine, f"b1d-{r}", prompt, max_tokens)
        decode_s = sum(steps[1:])
        runs.append({"first_token_s": steps[0], "decode_s": decode_s, "tok_per_s": (len(ids) - 1) / decode_s})
    return {"label": label, "runs": runs, "decode_tok_per_s": statistics.median(r["tok_per_s"] for r in runs),
            "first_token_s_median": statistics.median(r["first_token_s"] for r in runs), "output_ids": ids}


def _reset_prefix_cache(llm) -> None:
    if not llm.reset_prefix_cache():
        raise RuntimeError("prefix cache not reset: a request still holds KV blocks")


def run_kvmesh(llm, workload: Workload, repeats: int = 1, warmup_passes: int = 1) -> dict:
    """All requests at once through LLM.generate (continuous batching): warm-up passes, then timed ones."""
    params = [_greedy(n) for n in workload.output_lens]
    walls, warm_walls, outputs, stats, ttft = [], [], None, [], []
    passes = ["warmup"] * warmup_passes + ["timed"] * repeats
    for i, kind in enumerate(passes):
        _reset_prefix_cache(llm)  # no pass (nor the step timing) may hit the prefix cache
        kv = llm.engine.kv_manager
        hit0, pre0 = kv.hit_tokens, llm.engine.scheduler.num_preemptions
        t0 = time.perf_counter()
        outs = llm.generate(workload.prompts, params, use_tqdm=True)
        wall = time.perf_counter() - t0
        print(f"kvmesh {kind} pass: {wall:.2f} s", flush=True)
        if kind == "warmup":
            warm_walls.append(wall)
            continue
        walls.append(wall)
        stats.append({"prefix_hit_tokens": kv.hit_tokens - hit0,
                      "preemptions": llm.engine.scheduler.num_preemptions - pre0})
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        ttft = [o.metrics.get("ttft_s", float("nan")) for o in outs]
    useful = workload.total_output_tokens
    wall = statistics.median(walls)
    return {
        "label": "kvmesh (continuous batching)",
        "useful_output_tokens": useful,
        "generated_tokens": sum(len(o) for o in outputs),
        "output_lengths_as_requested": all(len(o) == n for o, n in zip(outputs, workload.output_lens)),
        "wall_s": wall,
        "wall_s_all": walls,
        "warmup_wall_s": warm_walls,
        "tok_per_s": useful / wall,
        "ttft_s_median": statistics.median(ttft),
        "ttft_s_p90": float(np.percentile(ttft, 90)),
        "engine_stats": stats,
        "_outputs": outputs,
    }
