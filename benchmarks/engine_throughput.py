"""Offline throughput of the kvmesh engine against its peers: vLLM CPU, llama.cpp, transformers.

What is measured (one run; one system at a time, never two at once; same weights, float32
unless stated, same thread count ``--threads``):

* **Workload** (``--preset issue16``, the default): 48 requests, prompt lengths uniform in
  32-384 tokens, output lengths uniform in 16-192 (``numpy.random.default_rng(0)``);
  ``--preset wide`` is the older 64 requests, 32-512 / 16-256. Prompts are windows of real
  English text (docstrings of ``torch.nn.modules.module`` and
  ``transformers.generation.utils``) at distinct random offsets, so no two prompts share a
  prefix. Greedy, EOS ignored: every request generates exactly the tokens it asked for.
* **Offline protocol** (kvmesh and vLLM alike): ``--warmup-passes`` (1) untimed passes of the
  whole workload, then ``--repeats`` (3) timed passes, every request submitted at once
  (``LLM.generate``), prefix cache reset before each pass; tok/s = requested output tokens /
  median wall time. The warm-up pass matters: the first full pass runs ~30% slower on both
  (allocator and oneDNN warm-up), so ratios without it are unfair to whoever runs first.
* **vLLM CPU** (``--vllm-venv``, default /tmp/vllm-cpu): the same token ids through
  ``vllm.LLM.generate`` (float32) in a subprocess of that venv (``_vllm_offline.py``). After
  both have warmed up, the timed passes alternate: a kvmesh pass, then a vLLM pass, ``--repeats``
  rounds, both engines resident (each idle while the other runs); the ratio is the median of the
  rounds' ratios, reported with its spread. kvmesh's greedy outputs must equal vLLM's for every
  request (recorded, never fatal).
* **transformers** static batches of 8 and 32 (arrival order, left padding, a batch runs to its
  longest request, only requested tokens count) and batch 1 on the first 8 requests, once
  each (``--hf-repeats``); kvmesh's first 4 outputs must equal transformers batch 1.
* **Batch-1 decode vs llama.cpp** (``--llamacpp-venv``, default /tmp/llamacpp-venv): one greedy
  request, a 32-token text prompt, 128 output tokens (``--b1-llama-tokens``), 1 warm-up run then
  the median over ``--b1-llama-repeats`` (5) runs of (tokens - 1) / decode time (prefill
  excluded), at the same precision on both sides: the embedded model's own Q4_1 GGUF (kvmesh
  ``quantization="gguf"`` vs llama.cpp) and f32 (kvmesh float32 vs an F32 GGUF that llama.cpp's
  ``convert_hf_to_gguf.py`` makes from kvmesh's float32 folder, cached under the kvmesh cache).
  Greedy agreement: f32 must agree on the first 16 tokens; Q4_1 only records the common prefix
  (llama.cpp's Q4_1 kernels quantize activations to Q8, so exact equality is not expected).
* **bf16** (``--bf16``, default on CPUs that multiply bf16 natively: AVX512-BF16 or AMX):
  kvmesh with bf16 weights, activations and KV cache on the same workload (offline protocol
  as above) and batch-1 prompt, against kvmesh fp32; greedy agreement with the fp32 outputs
  is recorded (bf16 rounding makes some requests diverge after a while: not an error).
* **Batch-1 decode step** of kvmesh (median engine step of lone decodes) vs the memory-bandwidth
  floor = weight bytes / copy bandwidth measured in the same run.
* **Targets** (MET / MISSED): offline >= 1.2x vLLM CPU fp32; batch-1 decode >= llama.cpp at the
  same precision; bf16 >= fp32 (offline and batch-1); >= 5x the best static batch; >= 20x one-at-a-time; step <= 1.5x the floor.

A peer whose venv is missing is skipped with the reason printed and recorded (``peers`` in the
JSON); install them with ``scripts/install_vllm_cpu.sh /tmp/vllm-cpu`` and
``scripts/install_llamacpp.sh /tmp/llamacpp-venv``. Run on idle cores (the script records the
load average at start and end and warns when the machine is busy)::

    python benchmarks/engine_throughput.py --wait-idle 300    # full run, ~20 min on 2 cores
    python benchmarks/engine_throughput.py --smoke --out-dir /tmp/et   # pipeline check, a few min

Results go to ``benchmarks/results/engine_throughput.{json,md,png}``
(``engine_throughput_smoke.*`` for ``--smoke``, so real results are never overwritten).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import kvmesh
from kvmesh import LLM, SamplingParams
from kvmesh.checkpoint.embedded import cache_dir, gguf_path
from kvmesh.layers.native import native_bf16

from _common import RESULTS_DIR, check_idle, cpu_flags, cpu_model, load_snapshot, wait_for_idle, write_results
from _engine_report import plot, render_markdown, summarize
from _kvmesh_ab import ab_markdown, run_ab
from _kvmesh_runs import b1_decode, decode_step_time, measure_bandwidth, run_kvmesh, weight_bytes
from _peer_procs import (DEFAULT_LLAMACPP_VENV, DEFAULT_VLLM_VENV, common_prefix, compare_outputs, f32_gguf,
                         run_llamacpp, run_vllm_alternating)
from _peers import hf_generate, load_hf, run_hf_batch1, run_hf_static, sanity_check
from _workloads import Workload, make_workload, text_prompt

DEFAULT_OUT_DIR = RESULTS_DIR
# name: (requests, prompt range, output range, hf batch sizes, hf batch-1 subset)
PRESETS = {
    "issue16": (48, (32, 384), (16, 192), [8, 32], 8),
    "wide": (64, (32, 512), (16, 256), [8, 32], 8),
    "smoke": (6, (8, 32), (4, 8), [2, 4], 2),
}
F32_AGREEMENT_TOKENS = 16  # f32 llama.cpp must match kvmesh f32 on this many first tokens


# -- results ------------------------------------------------------------------


def save(res: dict, out_dir: Path, prefix: str) -> tuple[list[Path], str]:
    """Write <prefix>.json (raw numbers), .md (tables) and .png (bars); returns (paths, markdown)."""
    # Raw token lists of the big workload stay out of the JSON; the .md and .png are drawn from it.
    clean = {**res, "systems": {k: {f: v for f, v in s.items() if f != "_outputs"} for k, s in res["systems"].items()}}
    markdown = render_markdown(clean) + (ab_markdown(res["ab"]) if res.get("ab") else "")
    return write_results(prefix, clean, markdown, plot, out_dir), markdown


# -- arguments ----------------------------------------------------------------


def _venv(value: str) -> Path | None:
    return None if value.lower() in ("", "none", "off") else Path(value)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads for every system (2)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="workload: issue16 (default: 48 requests, prompts 32-384, outputs 16-192), "
                        "wide (64, 32-512, 16-256), smoke")
    p.add_argument("--num-requests", type=int, default=None, help="requests in the workload (preset's)")
    p.add_argument("--prompt-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--hf-batch1-subset", type=int, default=None,
                   help="requests run one at a time through transformers (8; smoke 2)")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None, help="static batch sizes (8 32; smoke 2 4)")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="untimed passes of the whole workload before the timed ones (kvmesh and vLLM; 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes for kvmesh and vLLM; median (3; smoke 2)")
    p.add_argument("--hf-repeats", type=int, default=1, help="timed passes per transformers static batch size (1)")
    p.add_argument("--b1-repeats", type=int, default=None, help="runs of the batch-1 step timing (3; smoke 1)")
    p.add_argument("--b1-llama-tokens", type=int, default=None, help="output tokens of the llama.cpp decode (128)")
    p.add_argument("--b1-llama-repeats", type=int, default=None, help="timed runs of the llama.cpp decode (5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="local HF folder; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--vllm-venv", type=_venv, default=DEFAULT_VLLM_VENV, help="vLLM CPU venv, or 'none'")
    p.add_argument("--llamacpp-venv", type=_venv, default=DEFAULT_LLAMACPP_VENV,
                   help="llama-cpp-python venv (scripts/install_llamacpp.sh), or 'none'")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--name", default=None,
                   help="result file names (default engine_throughput, or engine_throughput_smoke with --smoke)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers baselines (nor their sanity check)")
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="also run kvmesh in bf16 (offline and batch-1); auto: where the CPU multiplies bf16 "
                        "natively (AVX512-BF16 / AMX)")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="the platform/ folder of another kvmesh checkout (e.g. the previous commit's worktree): "
                        "its engine and this one's run the offline workload and batch-1 decode in alternating "
                        "subprocess rounds (_kvmesh_ab.py)")
    p.add_argument("--ab-rounds", type=int, default=3, help="A/B rounds with --baseline-src (3)")
    p.add_argument("--wait-idle", type=float, default=0, help="wait up to this many seconds for idle cores first")
    p.add_argument("--smoke", action="store_true",
                   help="tiny end-to-end check (preset smoke, few repeats); writes engine_throughput_smoke.*")
    args = p.parse_args(argv)
    args.preset = args.preset or ("smoke" if args.smoke else "issue16")
    n, prompts, outputs, sizes, subset = PRESETS[args.preset]
    small = args.smoke
    defaults = {"num_requests": n, "prompt_range": prompts, "output_range": outputs, "hf_batch_sizes": sizes,
                "hf_batch1_subset": subset, "repeats": 2 if small else 3, "b1_repeats": 1 if small else 3,
                "b1_llama_tokens": 16 if small else 128, "b1_llama_repeats": 2 if small else 5}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.prompt_range, args.output_range = tuple(args.prompt_range), tuple(args.output_range)
    args.b1_prompt, args.b1_tokens = (8, 16) if small else (32, 64)
    args.bandwidth_repeats = 3 if small else 5
    args.prefix = args.name or ("engine_throughput_smoke" if args.smoke else "engine_throughput")
    args.bf16 = args.bf16 == "on" or (args.bf16 == "auto" and native_bf16())
    return args


# -- phases -------------------------------------------------------------------


def run_hf(args, model_path: Path, workload: Workload, warm: list[int], systems: dict, phases: dict):
    """The transformers baselines into `systems`; returns (sanity check, transformers config)."""
    print("loading transformers model ...", flush=True)
    model, _tok, pad_id = load_hf(model_path)
    hf_info = {"attn_implementation": getattr(model.config, "_attn_implementation", None), "pad_token_id": pad_id}
    hf_generate(model, [warm, warm[:16]], 4, pad_id)  # warmup
    for bs in tqdm(args.hf_batch_sizes, desc="transformers static batching"):
        phases[f"hf_static_b{bs}"] = load_snapshot()
        systems[f"hf_static_b{bs}"] = r = run_hf_static(model, workload, bs, pad_id, args.hf_repeats)
        print(f"transformers static batch {bs}: {r['tok_per_s']:.1f} tok/s in {r['wall_s']:.1f} s")
    phases["hf_batch1"] = load_snapshot()
    systems["hf_batch1"] = r = run_hf_batch1(model, workload, args.hf_batch1_subset, pad_id)
    print(f"transformers batch 1 (first {r['subset_requests']}): {r['tok_per_s']:.1f} tok/s")
    sanity = sanity_check(systems["kvmesh"]["_outputs"], r["_outputs"], model, workload, pad_id)
    print(f"sanity (kvmesh == transformers batch 1 on first {sanity['requests_compared']}): "
          f"{'MATCH' if sanity['all_match'] else 'MISMATCH'}")
    return sanity, hf_info


def _kvmesh_llm(args, **kw) -> LLM:
    """The kvmesh engine of the offline runs (fp32 unless `kw` says otherwise)."""
    return LLM(model=args.model, progress=False, num_threads=args.threads, max_num_seqs=64,
               max_num_batched_tokens=1024, **kw)


def run_bf16(args, workload, systems: dict, b1: dict, phases: dict) -> None:
    """kvmesh with bf16 weights, activations and KV cache on the same workload and batch-1
    prompt (offline protocol as fp32); greedy agreement with the fp32 outputs is recorded."""
    phases["kvmesh_bf16"] = load_snapshot()
    llm = _kvmesh_llm(args, dtype="bfloat16")
    print(f"kvmesh bf16: all requests at once, {args.warmup_passes} warm-up pass(es) + {args.repeats} timed ...")
    r = systems["kvmesh_bf16"] = {**run_kvmesh(llm, workload, args.repeats, args.warmup_passes),
                                  "label": "kvmesh bf16 (continuous batching)"}
    print(f"kvmesh bf16: {r['tok_per_s']:.1f} tok/s")
    ref, got = systems["kvmesh"]["_outputs"], r["_outputs"]
    prefixes = [common_prefix(a, b) for a, b in zip(ref, got)]
    r["agreement_with_fp32"] = {"requests_equal": sum(a == b for a, b in zip(ref, got)), "requests": len(ref),
                                "common_prefix_median": float(np.median(prefixes)),
                                "output_tokens_median": float(np.median([len(a) for a in ref]))}
    phases["kvmesh_bf16_b1"] = load_snapshot()
    b1["systems"]["kvmesh_bf16"] = {**b1_decode(llm, b1["prompt_ids"], args.b1_llama_tokens, args.b1_llama_repeats,
                                                "kvmesh bf16"), "precision": "BF16", "system": "kvmesh"}
    del llm
    gc.collect()


def run_b1_peers(args, model_path: Path, prompt: list[int], b1: dict, peers: dict, phases: dict) -> None:
    """kvmesh on the embedded GGUF, then llama.cpp on it and on an F32 GGUF; fills b1["systems"]."""
    ggufs: dict[str, Path] = {}
    if args.model is None:
        phases["kvmesh_gguf_b1"] = load_snapshot()
        try:
            llm = LLM(progress=False, quantization="gguf", num_threads=args.threads, max_model_len=2048)
            b1["systems"]["kvmesh_gguf"] = {**b1_decode(llm, prompt, args.b1_llama_tokens, args.b1_llama_repeats,
                                                        "kvmesh gguf"), "precision": "Q4_1", "system": "kvmesh"}
            ggufs["q4_1"] = gguf_path()
            peers["kvmesh_gguf"] = {"status": "ok"}
            del llm
            gc.collect()
        except Exception as e:  # recorded, never fatal
            peers["kvmesh_gguf"] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            print(f"kvmesh gguf: FAILED: {e}")
    else:
        peers["kvmesh_gguf"] = {"status": "skipped", "reason": "--model given: the Q4_1 GGUF is the embedded model's"}
    if args.llamacpp_venv is not None and (args.llamacpp_venv / "bin" / "python").exists():
        path, why = f32_gguf(model_path, args.llamacpp_venv, cache_dir() / "peers" / f"{model_path.name}-F32.gguf")
        peers["f32_gguf"] = {"status": "ok", "path": str(path)} if path else {"status": "failed", "reason": why}
        if path:
            ggufs["f32"] = path
        else:
            print(f"F32 GGUF for llama.cpp: FAILED: {why}")
    phases["llamacpp"] = load_snapshot()
    got, peers["llamacpp"] = None, {"status": "skipped", "reason": "no GGUF to run (see kvmesh_gguf, f32_gguf)"}
    if ggufs or args.llamacpp_venv is None:
        got, peers["llamacpp"] = run_llamacpp(args.llamacpp_venv, ggufs, prompt, args.b1_llama_tokens,
                                              args.b1_llama_repeats, args.threads)
    for name, r in (got or {}).items():
        b1["systems"][f"llamacpp_{name}"] = {**r, "label": f"llama.cpp {name.upper()}",
                                             "precision": name.upper(), "system": "llama.cpp"}
    agreement = {}
    for prec, ours, theirs in (("f32", "kvmesh_f32", "llamacpp_f32"), ("q4_1", "kvmesh_gguf", "llamacpp_q4_1")):
        if ours in b1["systems"] and theirs in b1["systems"]:
            a, b = b1["systems"][ours]["output_ids"], b1["systems"][theirs]["output_ids"]
            agreement[prec] = {"common_prefix": common_prefix(a, b), "tokens": min(len(a), len(b))}
    if "f32" in agreement:
        agreement["f32"]["first_tokens_required"] = F32_AGREEMENT_TOKENS
        agreement["f32"]["first_tokens_equal"] = agreement["f32"]["common_prefix"] >= min(
            F32_AGREEMENT_TOKENS, agreement["f32"]["tokens"])
    b1["agreement"] = agreement
    for k, s in b1["systems"].items():
        print(f"batch-1 decode {s['label']}: {s['decode_tok_per_s']:.1f} tok/s")


def run_offline_rounds(args, llm: LLM, model_path: Path, workload: Workload) -> tuple[dict, dict | None, dict, dict]:
    """kvmesh's and vLLM's offline passes in alternating rounds: kvmesh warms up, vLLM loads and
    warms up in its own process, then each round times one kvmesh pass and one vLLM pass (vLLM
    idle and resident while kvmesh runs, kvmesh idle while vLLM does), so a machine that speeds
    up or slows down during the run moves both columns alike. The ratio is the median of the
    per-round ratios, with their spread. Returns (kvmesh entry, vLLM entry or None, vLLM's peers
    record, the rounds record)."""
    print(f"kvmesh: {args.warmup_passes} warm-up pass(es) of all requests at once ...")
    if args.warmup_passes:
        run_kvmesh(llm, workload, 1, args.warmup_passes - 1)  # the last warm-up's time is discarded too
    passes: list[dict] = []

    def kvmesh_pass() -> float:
        passes.append(run_kvmesh(llm, workload, 1, 0))
        return passes[-1]["wall_s"]

    vllm_sys, peer, played = run_vllm_alternating(args.vllm_venv, model_path, workload.prompts,
                                                  workload.output_lens, args.threads, args.warmup_passes,
                                                  args.repeats, kvmesh_pass)
    while len(passes) < args.repeats:  # no vLLM (or it failed): kvmesh's passes alone
        kvmesh_pass()
    kv = {**passes[-1], "wall_s_all": [p["wall_s"] for p in passes],
          "engine_stats": [s for p in passes for s in p["engine_stats"]]}
    kv["wall_s"] = float(np.median(kv["wall_s_all"]))
    kv["tok_per_s"] = workload.total_output_tokens / kv["wall_s"]
    print(f"kvmesh: {kv['tok_per_s']:.1f} tok/s (median of {len(passes)}: "
          + ", ".join(f"{w:.1f}" for w in kv["wall_s_all"]) + " s)")
    if vllm_sys is not None:
        peer["output_match"] = m = compare_outputs(kv["_outputs"], vllm_sys["_outputs"])
        print(f"greedy outputs kvmesh vs vLLM: {m['requests_equal']}/{m['requests_compared']} requests equal")
    ratios = [r["ratio"] for r in played]
    rounds = {"played": played, "alternating": bool(played)}
    if ratios:
        rounds.update(ratio_median=float(np.median(ratios)), ratio_min=min(ratios), ratio_max=max(ratios))
        print(f"kvmesh / vLLM over {len(ratios)} alternating rounds: median {rounds['ratio_median']:.3f}x "
              f"(spread {rounds['ratio_min']:.3f}-{rounds['ratio_max']:.3f}x)")
    return kv, vllm_sys, peer, rounds


def run_config(args, workload: Workload) -> dict:
    """The run's settings as recorded in the JSON's "config"."""
    return {
        "threads": args.threads, "torch_num_threads": torch.get_num_threads(), "preset": args.preset,
        "num_requests": workload.num_requests, "prompt_len_range": list(args.prompt_range),
        "output_len_range": list(args.output_range), "seed": args.seed, "hf_batch_sizes": args.hf_batch_sizes,
        "hf_batch1_subset": args.hf_batch1_subset, "warmup_passes": args.warmup_passes, "repeats": args.repeats,
        "hf_repeats": args.hf_repeats, "b1_prompt_tokens": args.b1_prompt, "b1_output_tokens": args.b1_tokens,
        "b1_repeats": args.b1_repeats, "skip_hf": args.skip_hf,
        "vllm_venv": str(args.vllm_venv) if args.vllm_venv else None,
        "llamacpp_venv": str(args.llamacpp_venv) if args.llamacpp_venv else None,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.wait_idle:
        print(f"waited {wait_for_idle(args.wait_idle):.0f} s for idle cores", flush=True)
    torch.set_num_threads(args.threads)
    import transformers

    load_start = load_snapshot()
    idle = check_idle(args.threads, load_start["1min"])
    phases, peers = {}, {}

    print("loading kvmesh engine ...", flush=True)
    t0 = time.perf_counter()
    llm = _kvmesh_llm(args)
    kv_load_s = time.perf_counter() - t0
    model_path = Path(llm.engine.model_path)
    workload = make_workload(llm.tokenizer, args.num_requests, args.prompt_range, args.output_range, args.seed)
    print(f"workload ({args.preset}): {workload.num_requests} requests, {workload.total_prompt_tokens} prompt "
          f"tokens, {workload.total_output_tokens} output tokens; prompts from {workload.source}")

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
    systems["kvmesh"], vllm_sys, peers["vllm"], rounds = run_offline_rounds(args, llm, model_path, workload)
    if vllm_sys is not None:
        systems["vllm_cpu"] = vllm_sys

    b1_prompt = text_prompt(llm.tokenizer, 32)
    b1 = {"prompt_tokens": len(b1_prompt), "max_tokens": args.b1_llama_tokens, "repeats": args.b1_llama_repeats,
          "threads": args.threads, "prompt_ids": b1_prompt, "systems": {}}
    phases["kvmesh_f32_b1"] = load_snapshot()
    b1["systems"]["kvmesh_f32"] = {**b1_decode(llm, b1_prompt, args.b1_llama_tokens, args.b1_llama_repeats,
                                               "kvmesh f32"), "precision": "F32", "system": "kvmesh"}
    engine_config = llm.engine.config.model_dump()
    del llm
    gc.collect()
    ab = None
    if args.baseline_src is not None:
        phases["ab"] = load_snapshot()
        ab = run_ab(args.baseline_src, args.model, workload, warm, b1_prompt, args)
        print(f"A/B vs {args.baseline_src}: offline {ab['offline_ratio']:.3f}x, batch-1 {ab['b1_ratio']:.3f}x, "
              f"outputs equal: {ab['outputs_equal']}")
    if args.bf16:
        run_bf16(args, workload, systems, b1, phases)

    run_b1_peers(args, model_path, b1_prompt, b1, peers, phases)

    sanity, hf_info = None, None
    if not args.skip_hf:
        sanity, hf_info = run_hf(args, model_path, workload, warm, systems, phases)

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
        "b1_decode": b1,
        "peers": peers,
        "sanity": sanity,
        "ab": ab,
        "rounds": rounds,
    }
    res["summary"] = summarize(systems, step, bandwidth, wbytes, b1, peers, rounds)
    paths, markdown = save(res, args.out_dir, args.prefix)
    print()
    print(markdown)
    print(f"load average now: {load_end['1min']:.2f} {load_end['5min']:.2f} {load_end['15min']:.2f}")
    print("wrote " + ", ".join(str(p) for p in paths))
    return res


if __name__ == "__main__":
    main()
