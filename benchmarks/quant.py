"""Weight quantization on the embedded SmolLM2-135M-Instruct: bytes, memory, speed, quality.

Methods: fp32, bf16, int8 (per channel), int4 g32, int4 g128 (g64 on the 576-wide
inputs, which 128 does not divide; int4 quantizes the tied embedding / lm_head with
the same scheme), and gguf-q4_1: the embedded model's own GGUF tensors kept quantized
(Q4_1 projections, Q8_0 embedding / lm_head; ``--quantization gguf``). Each method runs in its own child process (so
peak RSS is that method's alone) and measures:

* weight bytes (parameters + quantized buffers, shared tensors once) and peak RSS
  (``resource.getrusage``, kB -> MiB);
* decode tokens/s at batch 1 (one request, 32-token prompt) and batch 16 (16 such
  requests at once): output tokens of the steps after the prefill step / their time;
* prefill tokens/s: one 512-token prompt in one step;
* perplexity on the first 1,024 tokens of CPython's LICENSE.txt
  (kvmesh.quant.quality.license_text);
* three greedy chat generations, to show the text stays sensible.

Speeds are medians of ``--repeats`` (5) timed runs after a warm-up. Run on idle cores
(the script prints /proc/loadavg and marks a busy run; ``--wait-idle S`` waits up to S
seconds for the load to settle first)::

    python benchmarks/quant.py --wait-idle 180   # full run, ~2 minutes on 2 cores
    python benchmarks/quant.py --smoke      # tiny settings, writes quant_smoke.*

Results: benchmarks/results/quant.{json,md,png} (quant_smoke.* for --smoke).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    IDLE_LOAD,
    RESULTS_DIR,
    check_idle,
    cpu_flags,
    cpu_model,
    decode_tok_s,
    drain,
    is_idle,
    loadavg,
    md_table,
    median,
    wait_for_idle,
    write_results,
)

METHODS = {  # name -> (dtype, quantization, group size)
    "fp32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "int8": ("float32", "int8", None),
    "int4-g32": ("float32", "int4", 32),
    "int4-g128": ("float32", "int4", 128),
    "gguf-q4_1": ("float32", "gguf", None),
}
TARGETS = {"int8": 1.5, "int4-g32": 2.0}  # batch-1 decode speedup vs fp32
BYTE_TARGETS = {"int8": 0.26, "int4-g32": 0.16}  # weight bytes vs fp32 (int4: below)
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU cache is."]
OUT_DIR = RESULTS_DIR


def _decode(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    from kvmesh import SamplingParams

    eng = llm.engine
    base = list(range(100, 100 + prompt_len))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):  # distinct first token: no shared prefix blocks
        eng.add_request(f"d{batch}-{i}", [1000 + i, *base], params)
    return decode_tok_s(eng)  # all prompts fit one prefill step's token budget


def _prefill(llm, prompt_len: int, run: int = 0) -> float:
    from kvmesh import SamplingParams

    eng = llm.engine
    # A distinct first token per run: a repeat must not hit the prefix cache.
    ids = [3000 + run, *range(200, 199 + prompt_len)]
    eng.add_request(f"p{run}", ids, SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    eng.step()
    dt_s = time.perf_counter() - t0
    drain(eng)
    return prompt_len / dt_s


def run_one(name: str, smoke: bool, threads: int, repeats: int = 5) -> dict:
    """Child process: everything for one method, as a JSON-able dict."""
    import torch

    from kvmesh import LLM, SamplingParams
    from kvmesh.quant.loader import weight_bytes
    from kvmesh.quant.quality import eval_tokens, perplexity

    torch.set_num_threads(threads)
    dtype, quant, group = METHODS[name]
    t0 = time.perf_counter()
    llm = LLM(progress=False, dtype=dtype, quantization=quant, quantization_group_size=group, num_blocks=512,
              max_num_batched_tokens=1024, max_model_len=2048)
    res = {"method": name, "load_s": time.perf_counter() - t0, "weight_bytes": weight_bytes(llm.engine.executor.model)}
    new = 8 if smoke else 64
    _decode(llm, 1, 32, 8)  # warm-up: first-call allocations and thread-pool start
    samples = {"decode_b1_tok_s": [_decode(llm, 1, 32, new) for _ in range(repeats)],
               "decode_b16_tok_s": [_decode(llm, 16, 32, new // 2 if smoke else 32) for _ in range(repeats)],
               "prefill_tok_s": [_prefill(llm, 64 if smoke else 512, i) for i in range(repeats)]}
    res.update({k: median(v) for k, v in samples.items()})
    res["samples"] = samples
    ids, source = eval_tokens(llm.tokenizer, 128 if smoke else 1024)
    res["perplexity"], res["ppl_text"] = perplexity(llm.engine, ids), source
    prompts = [llm.engine.encode_chat([{"role": "user", "content": c}]) for c in CHAT]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8 if smoke else 40, temperature=0))
    res["generations"] = [{"prompt": c, "text": o.outputs[0].text} for c, o in zip(CHAT, outs)]
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def _markdown(rows: list[dict], meta: dict) -> str:
    fp = next(r for r in rows if r["method"] == "fp32")
    lines = [f"# kvmesh weight quantization: {meta['model']}", "",
             (f"{meta['date']}, {meta['cpu']}, torch threads {meta['threads']}, load avg start/end "
              f"{meta['load_start']:.2f}/{meta['load_end']:.2f}{' (BUSY: do not quote)' if not meta['idle'] else ''}"
              f"{' — SMOKE settings' if meta['smoke'] else ''}"), ""]
    lines += md_table(["method", "weight MiB", "vs fp32", "peak RSS MiB", "decode b1 tok/s", "vs fp32",
                       "decode b16 tok/s", "prefill tok/s", "perplexity", "vs fp32"],
                      ([r["method"], f"{r['weight_bytes'] / 2**20:.1f}",
                        f"{r['weight_bytes'] / fp['weight_bytes']:.3f}x", f"{r['peak_rss_mib']:.0f}",
                        f"{r['decode_b1_tok_s']:.1f}",
                        f"{r['decode_b1_tok_s'] / fp['decode_b1_tok_s']:.2f}x", f"{r['decode_b16_tok_s']:.1f}",
                        f"{r['prefill_tok_s']:.0f}", f"{r['perplexity']:.3f}",
                        f"{100 * (r['perplexity'] / fp['perplexity'] - 1):+.2f}%"] for r in rows))
    lines += ["", (f"Speeds are medians of {meta.get('repeats', 1)} runs per method. "
                   f"Perplexity text: {fp['ppl_text']}."), "", "Targets:"]
    for name, t in TARGETS.items():
        r = next((x for x in rows if x["method"] == name), None)
        if r:
            sp = r["decode_b1_tok_s"] / fp["decode_b1_tok_s"]
            by = r["weight_bytes"] / fp["weight_bytes"]
            lines.append(f"- {name}: batch-1 decode {sp:.2f}x (target >= {t}x: {'met' if sp >= t else 'MISSED'}); "
                         f"weight bytes {by:.3f}x (target {BYTE_TARGETS[name]}x: "
                         f"{'met' if by <= BYTE_TARGETS[name] + (0.005 if name == 'int8' else 0) else 'MISSED'})")
    lines += ["", "## Greedy generations", ""]
    for r in rows:
        for g in r["generations"]:
            lines.append(f"- **{r['method']}** — {g['prompt']} → {g['text'].strip()!r}")
    return "\n".join(lines) + "\n"


def _plot(plt, res: dict):
    rows = res["results"]
    names = [r["method"] for r in rows]
    panels = [("weight MiB", [r["weight_bytes"] / 2**20 for r in rows]),
              ("decode b1 tok/s", [r["decode_b1_tok_s"] for r in rows]),
              ("decode b16 tok/s", [r["decode_b16_tok_s"] for r in rows]),
              ("perplexity", [r["perplexity"] for r in rows])]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (title, vals) in zip(axes, panels):
        ax.bar(names, vals, color=["#888", "#aaa", "#3a7", "#37a", "#58c", "#c73"][: len(names)])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


def _run_child(name: str, args) -> dict | None:
    """One method in a fresh interpreter (so peak RSS is that method's alone); None on failure."""
    cmd = [sys.executable, __file__, "--one", name, "--threads", str(args.threads), "--repeats", str(args.repeats)]
    cmd += ["--smoke"] if args.smoke else []
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        print(r.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(line[7:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny settings; writes quant_smoke.*")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {list(METHODS)}")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help=f"wait up to S seconds for the 1-minute load average to fall below {IDLE_LOAD}")
    p.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one method, JSON on stdout
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.smoke, args.threads, args.repeats)))
        return 0
    from tqdm import tqdm

    names = args.methods.split(",")
    for n in names:
        if n not in METHODS:
            p.error(f"--methods: unknown {n!r}; valid: {list(METHODS)}")
    if "fp32" not in names:
        names.insert(0, "fp32")
    wait_for_idle(args.wait_idle)
    start = loadavg()[0]
    check_idle(args.threads, start)
    rows = []
    for name in tqdm(names, desc="methods", unit="method"):
        row = _run_child(name, args)
        if row is None:
            return 1
        rows.append(row)
    end = loadavg()[0]
    meta = {"model": "SmolLM2-135M-Instruct (embedded)", "date": dt.datetime.now().isoformat(timespec="seconds"),
            "cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": args.threads, "load_start": start,
            "load_end": end, "repeats": args.repeats,
            "idle": is_idle(start) and is_idle(end, own_threads=args.threads), "smoke": args.smoke}
    md = _markdown(rows, meta)
    write_results("quant_smoke" if args.smoke else "quant", {"meta": meta, "results": rows}, md, _plot,
                  args.out_dir, dpi=110)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
