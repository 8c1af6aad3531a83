"""Speculative decoding on the embedded SmolLM2: tokens/s with speculation off vs on.

Two workloads (chat template, greedy, 96 new tokens, EOS respected):

* free text: open-ended chat prompts ("Explain why the sky is blue.");
* input-grounded: a passage from the Python standard library (the Zen of Python from
  the `this` module, and the `json` module docstring) followed by an instruction to
  repeat / quote / lightly edit it, where output tokens largely copy the input.

Each is run at batch 1 (requests one after another) and batch 8 (8 at once), with
speculation off, with n-gram prompt lookup, and with each model-based proposer that
is available (`--draft` folders; `self` = the target as its own draft, a correctness
and upper-bound check that costs k extra target passes). Speculation is lossless, so
every configuration must produce the same text as `off` (checked and recorded).
Reports tokens/s, speedup vs off, acceptance rate and mean accepted length; writes
benchmarks/results/spec_decode.{json,md,png}. Run on idle cores:

    python benchmarks/spec_decode.py [--threads 2] [--k 4] [--draft PATH ...]
"""

from __future__ import annotations

import argparse
import codecs
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvmesh import LLM, SamplingParams

from _common import RESULTS_DIR, check_idle, loadavg, md_table, write_results

FREE = [
    "Explain why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are three tips for staying focused while studying?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why do cats purr?",
    "What is the difference between weather and climate?",
    "Suggest a name for a coffee shop and explain it.",
]


def passages() -> list[str]:
    import json as json_mod
    import this  # prints the Zen once on import

    zen = codecs.decode(this.s, "rot13")
    doc = " ".join(json_mod.__doc__.split()[:120])
    return [zen, doc]


def grounded() -> list[str]:
    zen, doc = passages()
    tasks = [
        "Repeat the passage above exactly.",
        "Quote the first five lines of the passage above.",
        "Rewrite the passage above with every line starting with a dash.",
        "Copy the passage above, replacing 'better' with 'preferable'.",
    ]
    return [f"{p}\n\n{t}" for p in (zen, doc) for t in tasks]


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], params)
    wall = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    return wall, sum(len(t) for t in toks), toks


def measure(configs: dict[str, dict | None], threads: int, max_tokens: int) -> list[dict]:
    """Every proposer x workload x batch size; each row also says whether its text equals "off"."""
    results, texts = [], {}
    bar = tqdm(total=len(configs) * 4, desc="spec decode runs")
    for name, spec in configs.items():
        if spec is not None:
            spec = {**spec, "max_batch_size": 64}  # measure every batch size, no auto-off
        llm = LLM(num_threads=threads, speculative=spec)
        eng = llm.engine
        for wl_name, wl in (("free text", FREE), ("input-grounded", grounded())):
            prompts = [eng.encode_chat([{"role": "user", "content": p}]) for p in wl]
            for batch in (1, 8):
                run(llm, prompts[:1], 1, 8)  # warm up
                before = dict(eng.spec_counters)
                bar.set_postfix_str(f"{name} / {wl_name} / batch {batch}")
                wall, ntok, toks = run(llm, prompts, batch, max_tokens)
                bar.update(1)
                prop = eng.spec_counters["proposed"] - before["proposed"]
                acc = eng.spec_counters["accepted"] - before["accepted"]
                steps = eng.spec_counters["verify_steps"] - before["verify_steps"]
                texts[(wl_name, batch, name)] = toks
                results.append({
                    "proposer": name, "workload": wl_name, "batch": batch, "tokens": ntok, "wall_s": wall,
                    "tok_per_s": ntok / wall, "acceptance_rate": acc / prop if prop else None,
                    "mean_accepted_length": (acc + steps) / steps if steps else None,
                })
        del llm
    bar.close()
    base = {(r["workload"], r["batch"]): r["tok_per_s"] for r in results if r["proposer"] == "off"}
    for r in results:
        r["speedup"] = r["tok_per_s"] / base[(r["workload"], r["batch"])]
        r["identical_to_off"] = texts[(r["workload"], r["batch"], r["proposer"])] == texts[
            (r["workload"], r["batch"], "off")]
    return results


def markdown(res: dict) -> str:
    md = [f"# Speculative decoding, embedded SmolLM2 fp32, {res['threads']} threads, k={res['k']}", "",
          f"load average start/end: {res['loadavg_start']} / {res['loadavg_end']}", ""]
    md += md_table(["workload", "batch", "proposer", "tok/s", "speedup", "acceptance", "mean accepted len",
                    "same output"],
                   ([r["workload"], r["batch"], r["proposer"], f"{r['tok_per_s']:.1f}", f"{r['speedup']:.2f}x",
                     "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
                     "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}",
                     "yes" if r["identical_to_off"] else "NO"] for r in res["results"]), "lrlrrrrl")
    return "\n".join(md) + "\n"


def plot(plt, res: dict):
    results = res["results"]
    groups = sorted({(r["workload"], r["batch"]) for r in results})
    names = list(dict.fromkeys(r["proposer"] for r in results))  # the configs, in run order
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [next(r["tok_per_s"] for r in results if r["proposer"] == name and (r["workload"], r["batch"]) == g)
                for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\nbatch {b}" for w, b in groups])
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft", action="append", default=[], help="draft model folder (repeatable) or 'self'")
    ap.add_argument("--quantized-self-draft", action="append", default=[], choices=["int8", "int4"],
                    help="add a draft that is the target quantized at load (repeatable)")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = loadavg()
    check_idle(args.threads, load0[0])
    configs = {"off": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k}}
    for d in args.draft:
        configs[f"draft:{Path(d).name}"] = {"method": "draft", "model": d, "num_speculative_tokens": args.k}
    for q in args.quantized_self_draft:
        configs[f"draft:{q}-self"] = {"method": "draft", "model": "self", "quantization": q,
                                      "num_speculative_tokens": args.k}
    results = measure(configs, args.threads, args.max_tokens)
    res = {"threads": args.threads, "k": args.k, "max_tokens": args.max_tokens, "torch": torch.__version__,
           "loadavg_start": load0, "loadavg_end": loadavg(), "results": results}
    md = markdown(res)
    write_results("spec_decode", res, md, plot, args.out_dir)
    print(md, end="")


if __name__ == "__main__":
    main()
