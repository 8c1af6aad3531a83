"""Offline throughput of the kvmesh engine against Hugging Face transformers `generate`.

What is measured (one run, one process, same model, float32, same torch thread count):

* **Workload**: 64 requests (``--num-requests``). Prompt lengths are drawn uniformly
  from 32-512 tokens and output lengths from 16-256 tokens with a fixed seed
  (``numpy.random.default_rng(0)``). Prompts are windows of real English text: the
  docstrings of ``torch.nn.modules.module`` and ``transformers.generation.utils``,
  tokenized with the model's tokenizer, sliced at distinct random offsets (so no two
  prompts share a prefix and the prefix cache cannot help). Decoding is greedy and
  EOS is ignored, so every request generates exactly the tokens it asked for.
* **kvmesh**: all requests are submitted at once to ``LLM.generate`` (continuous
  batching, chunked prefill). Throughput = sum of output tokens / wall time.
* **transformers, static batches** of 8 and 32 (requests in arrival order, left
  padding). A batch runs until its longest request is done
  (``max_new_tokens`` = the batch's largest output length); only the tokens each
  request asked for count as useful output.
* **transformers, one prompt at a time** (batch 1) on the first 8 requests
  (``--hf-batch1-subset``); its tokens/s is computed on that subset.
* **Batch-1 decode step** of kvmesh: one request (32-token prompt, 64 output tokens)
  stepped through ``LLMEngine.step()``; the median step time over the decode steps
  (the first step, the prefill, is excluded) is compared with the memory-bandwidth
  floor = weight bytes / copy bandwidth measured in the same run (``dst.copy_(src)``
  on 256 MiB float32 tensors; bandwidth = 2 * bytes / time since a copy reads and
  writes).
* **Sanity**: kvmesh's greedy output for the first 4 requests must equal
  transformers batch-1 output token for token (recorded, never fatal).

The big workload runs once per system unless ``--repeats`` is given (then the median
wall time is reported); the batch-1 decode step is a median over all decode steps of
``--b1-repeats`` runs.

Run it on idle cores (check ``cat /proc/loadavg`` first; the script records the load
average at start and end and warns when the machine is busy)::

    python benchmarks/engine_throughput.py                  # full run, ~15+ min on 2 cores
    python benchmarks/engine_throughput.py --smoke          # tiny end-to-end check, ~1-2 min

Results go to ``benchmarks/results/engine_throughput.{json,md,png}``
(``engine_throughput_smoke.*`` for ``--smoke``, so real results are never overwritten).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from _common import RESULTS_DIR, check_idle, cpu_flags, cpu_model, load_snapshot, time_calls, write_results
from _engine_report import plot, render_markdown, summarize
from _peers import hf_generate, load_hf, run_hf_batch1, run_hf_static, sanity_check
from _workloads import Workload, make_workload, text_prompt

DEFAULT_OUT_DIR = RESULTS_DIR


# -- memory bandwidth and the batch-1 decode step -----------------------------


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
    return {
        "tensor_mib": mib,
        "repeats": repeats,
        "copy_times_s": times,
        "median_copy_s": med,
        "bandwidth_gbps": 2 * nbytes / med / 1e9,
    }


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters; `parameters()` dedups the tied embedding / lm_head."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_step_time(llm, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    """Time each engine step of a lone request; median over decode steps (prefill excluded)."""
    from kvmesh import SamplingParams

    engine = llm.engine
    assert not engine.has_unfinished(), "the engine must be idle for the batch-1 step timing"
    prefill_s, decode_s = [], []
    for r in tqdm(range(repeats), desc="kvmesh batch-1 decode steps"):
        engine.add_request(f"b1-{r}-{time.monotonic_ns()}", prompt,
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        steps = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
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


# -- kvmesh -------------------------------------------------------------------


def _reset_prefix_cache(llm) -> None:
    # Only the block pool exposes this; the engine/LLM have no public reset.
    pool = getattr(llm.engine.kv_manager, "pool", None)
    if pool is not None and hasattr(pool, "reset_prefix_cache"):
        pool.reset_prefix_cache()


def run_kvmesh(llm, workload: Workload, repeats: int = 1) -> dict:
    """All requests at once through LLM.generate (continuous batching)."""
    from kvmesh import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    walls, outputs, stats = [], None, []
    for _ in range(repeats):
        _reset_prefix_cache(llm)  # repeats (and the step timing) must not hit the prefix cache
        kv = llm.engine.kv_manager
        hit0, pre0 = kv.hit_tokens, llm.engine.scheduler.num_preemptions
        t0 = time.perf_counter()
        outs = llm.generate(workload.prompts, params, use_tqdm=True)
        walls.append(time.perf_counter() - t0)
        stats.append({"prefix_hit_tokens": kv.hit_tokens - hit0,
                      "preemptions": llm.engine.scheduler.num_preemptions - pre0})
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        ttft = [o.metrics.get("ttft_s", float("nan")) for o in outs]
    lens_ok = all(len(o) == n for o, n in zip(outputs, workload.output_lens))
    useful = workload.total_output_tokens
    wall = statistics.median(walls)
    return {
        "label": "kvmesh (continuous batching)",
        "useful_output_tokens": useful,
        "generated_tokens": sum(len(o) for o in outputs),
        "output_lengths_as_requested": lens_ok,
        "wall_s": wall,
        "wall_s_all": walls,
        "tok_per_s": useful / wall,
        "ttft_s_median": statistics.median(ttft),
        "ttft_s_p90": float(np.percentile(ttft, 90)),
        "engine_stats": stats,
        "_outputs": outputs,
    }


# -- results ------------------------------------------------------------------


def save(res: dict, out_dir: Path, prefix: str) -> tuple[list[Path], str]:
    """Write <prefix>.json (raw numbers), .md (table) and .png (bar chart); returns (paths, markdown)."""
    # Raw token lists stay out of the JSON; the .md and .png are drawn from the JSON's data.
    clean = {**res, "systems": {k: {f: v for f, v in s.items() if f != "_outputs"} for k, s in res["systems"].items()}}
    markdown = render_markdown(clean)
    return write_results(prefix, clean, markdown, plot, out_dir), markdown


# -- main ---------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both systems (2)")
    p.add_argument("--num-requests", type=int, default=None, help="requests in the workload (64; smoke 6)")
    p.add_argument("--hf-batch1-subset", type=int, default=None,
                   help="requests run one at a time through transformers (8; smoke 2)")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None, help="static batch sizes (8 32; smoke 2 4)")
    p.add_argument("--repeats", type=int, default=1, help="runs of the big workload per system (median)")
    p.add_argument("--b1-repeats", type=int, default=None, help="runs of the batch-1 step timing (3; smoke 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="local HF folder; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--skip-hf", action="store_true", help="kvmesh only (no transformers baselines, no sanity)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny end-to-end check: 6 requests, prompts 8-32, outputs 4-8; "
                        "writes engine_throughput_smoke.*")
    args = p.parse_args(argv)
    if args.smoke:
        defaults = {"num_requests": 6, "hf_batch1_subset": 2, "hf_batch_sizes": [2, 4], "b1_repeats": 1}
        args.prompt_range, args.output_range, args.b1_prompt, args.b1_tokens = (8, 32), (4, 8), 8, 16
        args.bandwidth_repeats = 3
    else:
        defaults = {"num_requests": 64, "hf_batch1_subset": 8, "hf_batch_sizes": [8, 32], "b1_repeats": 3}
        args.prompt_range, args.output_range, args.b1_prompt, args.b1_tokens = (32, 512), (16, 256), 32, 64
        args.bandwidth_repeats = 5
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.prefix = "engine_throughput_smoke" if args.smoke else "engine_throughput"
    return args


def run_peers(args, model_path: Path, workload: Workload, warm: list[int], systems: dict, phases: dict):
    """The transformers baselines into `systems`; returns (sanity check, transformers config)."""
    print("loading transformers model ...", flush=True)
    model, _tok, pad_id = load_hf(model_path)
    hf_info = {"attn_implementation": getattr(model.config, "_attn_implementation", None), "pad_token_id": pad_id}
    hf_generate(model, [warm, warm[:16]], 4, pad_id)  # warmup
    for bs in tqdm(args.hf_batch_sizes, desc="transformers static batching"):
        phases[f"hf_static_b{bs}"] = load_snapshot()
        systems[f"hf_static_b{bs}"] = r = run_hf_static(model, workload, bs, pad_id, args.repeats)
        print(f"transformers static batch {bs}: {r['tok_per_s']:.1f} tok/s in {r['wall_s']:.1f} s")
    phases["hf_batch1"] = load_snapshot()
    systems["hf_batch1"] = r = run_hf_batch1(model, workload, args.hf_batch1_subset, pad_id)
    print(f"transformers batch 1 (first {r['subset_requests']}): {r['tok_per_s']:.1f} tok/s")
    sanity = sanity_check(systems["kvmesh"]["_outputs"], r["_outputs"], model, workload, pad_id)
    print(f"sanity (kvmesh == transformers batch 1 on first {sanity['requests_compared']}): "
          f"{'MATCH' if sanity['all_match'] else 'MISMATCH'}")
    return sanity, hf_info


def run_config(args, workload: Workload) -> dict:
    """The run's settings as recorded in the JSON's "config"."""
    return {
        "threads": args.threads,
        "torch_num_threads": torch.get_num_threads(),
        "num_requests": workload.num_requests,
        "prompt_len_range": list(args.prompt_range),
        "output_len_range": list(args.output_range),
        "seed": args.seed,
        "hf_batch_sizes": args.hf_batch_sizes,
        "hf_batch1_subset": args.hf_batch1_subset,
        "repeats": args.repeats,
        "b1_prompt_tokens": args.b1_prompt,
        "b1_output_tokens": args.b1_tokens,
        "b1_repeats": args.b1_repeats,
        "skip_hf": args.skip_hf,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    import kvmesh
    from kvmesh import LLM, SamplingParams

    load_start = load_snapshot()
    idle = check_idle(args.threads, load_start["1min"])
    phases = {}

    print("loading kvmesh engine ...", flush=True)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, progress=False, num_threads=args.threads, max_num_seqs=64,
              max_num_batched_tokens=1024)
    kv_load_s = time.perf_counter() - t0
    model_path = Path(llm.engine.model_path)
    workload = make_workload(llm.tokenizer, args.num_requests, args.prompt_range, args.output_range, args.seed)
    print(f"workload: {workload.num_requests} requests, {workload.total_prompt_tokens} prompt tokens, "
          f"{workload.total_output_tokens} output tokens; prompts from {workload.source}")

    # Warmup (first-call allocations, kernel selection) on ids unrelated to the workload.
    warm = np.random.default_rng(12345).integers(3, 49152, size=24).tolist()
    llm.generate([warm, warm[:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    phases["bandwidth"] = load_snapshot()
    bandwidth = measure_bandwidth(256, args.bandwidth_repeats)
    print(f"copy bandwidth: {bandwidth['bandwidth_gbps']:.2f} GB/s")
    wbytes = weight_bytes(llm.engine.executor.model)

    phases["decode_step"] = load_snapshot()
    step = decode_step_time(llm, text_prompt(llm.tokenizer, args.b1_prompt), args.b1_tokens, args.b1_repeats)
    print(f"kvmesh batch-1 decode step: {step['decode_step_ms_median']:.2f} ms (median); "
          f"floor {wbytes / (bandwidth['bandwidth_gbps'] * 1e9) * 1e3:.2f} ms")

    systems: dict[str, dict] = {}
    phases["kvmesh"] = load_snapshot()
    print("kvmesh: all requests at once ...", flush=True)
    systems["kvmesh"] = run_kvmesh(llm, workload, args.repeats)
    print(f"kvmesh: {systems['kvmesh']['tok_per_s']:.1f} tok/s in {systems['kvmesh']['wall_s']:.1f} s")
    engine_config = llm.engine.config.model_dump()
    del llm
    gc.collect()

    sanity, hf_info = None, None
    if not args.skip_hf:
        sanity, hf_info = run_peers(args, model_path, workload, warm, systems, phases)

    load_end = load_snapshot()
    res = {
        "benchmark": "engine_throughput",
        "smoke": args.smoke,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": model_path.name,
        "model_path": str(model_path),
        "dtype": "float32",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "kvmesh_version": kvmesh.__version__,
        "python_version": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "config": {**run_config(args, workload), "kvmesh_engine_config": engine_config,
                   "kvmesh_load_s": kv_load_s, "hf": hf_info},
        "workload": {
            "source": workload.source,
            "total_prompt_tokens": workload.total_prompt_tokens,
            "total_output_tokens": workload.total_output_tokens,
            "prompt_lens": [len(p) for p in workload.prompts],
            "output_lens": workload.output_lens,
            "prompt_offsets": workload.prompt_offsets,
        },
        "idle_at_start": idle,
        "load_average": {"start": load_start, "end": load_end, "phases": phases},
        "bandwidth": bandwidth,
        "decode_step": step,
        "systems": systems,
        "sanity": sanity,
    }
    res["summary"] = summarize(systems, step, bandwidth, wbytes)
    paths, markdown = save(res, args.out_dir, args.prefix)
    print()
    print(markdown)
    print(f"load average now: {load_end['1min']:.2f} {load_end['5min']:.2f} {load_end['15min']:.2f}")
    print("wrote " + ", ".join(str(p) for p in paths))
    return res


if __name__ == "__main__":
    main()
