"""Multi-LoRA output throughput: 1, 4 and 16 adapters in the mix against base-only on the same
requests (target: >= 0.8x at 4 adapters of rank 16), and the time to load an adapter; beside
vLLM's CPU LoRA on the same weights, adapters and token ids.

What is measured: ``--requests`` (32) chat prompts of the embedded SmolLM2-135M (fp32), greedy,
``--max-tokens`` (128) each with ignore_eos (every mix generates the same token count), all
submitted at once through the offline ``LLM.generate``. Mixes:

- ``base (LoRA off)``: an engine without LoRA: what a team pays today;
- ``base (LoRA on)``: the LoRA engine, no adapter in the batch (the base path must stay as fast);
- ``1`` / ``4`` / ``16``: request i runs under adapter i mod m (rank ``--rank``, all seven
  attention and MLP projections, random A and B from ``optimize.lora_adapter``, written as peft
  writes them), so every step batches m adapters and the base path's KV is never shared with
  theirs.

Rounds alternate the mixes (base, base-on, 1, 4, 16, base, ...) after a warm-up pass of each, so
a drift in the machine hits every mix alike; tok/s = generated tokens / median wall time, ratios
against base (LoRA off) of the same system. Load time: ``LLM.load_lora`` of each adapter from
disk (read + validate + host copy), median and max. ``--peer vllm`` then runs the same token ids
and adapter folders through vLLM's offline LLM (``_vllm_lora.py``, its venv ``--vllm-venv``); a
missing venv is recorded as skipped. Run on idle cores (load printed at start and end)::

    python benchmarks/lora_throughput.py --peer vllm
    python benchmarks/lora_throughput.py --smoke --out-dir /tmp/lora   # 4 requests, 1 round

Results: ``benchmarks/results/lora_throughput.{json,md,png}`` (``_smoke`` for --smoke).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from pathlib import Path

import torch

from kvmesh import LLM, SamplingParams
from kvmesh.config import LoRAConfig

from _common import RESULTS_DIR, cpu_model, load_snapshot, md_table, write_results
from _peer_procs import DEFAULT_VLLM_VENV, VLLM_INSTALL, run_child, venv_python, vllm_env

MIXES = (1, 4, 16)
TOPICS = ["rivers", "volcanoes", "bread", "chess", "comets", "bees", "jazz", "glaciers"]


def make_adapters(base: Path, out: Path, n: int, rank: int, seed: int = 0) -> list[tuple[str, Path]]:
    """`n` random rank-`rank` peft adapters of `base` under `out` (re-used when already there)."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from kvmesh.optimize.lora_adapter import LoRALinear, add_lora, save_adapter

    folders = [(f"bench-{i}", out / f"r{rank}-s{seed}-{i}") for i in range(n)]
    missing = [f for f in folders if not (f[1] / "adapter_model.safetensors").is_file()]
    if missing:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        add_lora(model, rank, 2.0 * rank)
        g = torch.Generator().manual_seed(seed)
        for name, folder in tqdm(missing, desc="random adapters", unit="adapter"):
            for module in model.modules():
                if isinstance(module, LoRALinear):
                    with torch.no_grad():
                        module.lora_A.normal_(0, module.lora_A.shape[1] ** -0.5, generator=g)
                        module.lora_B.normal_(0, 0.02, generator=g)
            save_adapter(model, folder, base, rank, 2.0 * rank)
    return folders


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.engine.encode_chat([{"role": "user", "content": f"Tell me three facts about {TOPICS[i % 8]} "
                                     f"(list {i})."}]) for i in range(n)]


def _mix_requests(mix: int, n: int) -> list[str | None] | None:
    return None if mix == 0 else [f"bench-{i % mix}" for i in range(n)]


def run_kvmesh(args, base_path: Path, adapters) -> tuple[dict, list[list[int]]]:
    torch.set_num_threads(args.threads)
    common = dict(progress=False, max_model_len=1024, max_num_seqs=max(args.requests, 1),
                  enable_prefix_caching=False)
    plain = LLM(str(base_path), **common)
    lora = LLM(str(base_path), lora=LoRAConfig(max_loras=max(MIXES), max_lora_rank=args.rank,
                                               max_cpu_loras=max(MIXES)), **common)
    loads = []
    for name, folder in adapters:
        t0 = time.perf_counter()
        lora.load_lora(name, str(folder))
        loads.append(time.perf_counter() - t0)
    prompts = _prompts(plain, args.requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = [("base (LoRA off)", plain, 0), ("base (LoRA on)", lora, 0)] + [(str(m), lora, m) for m in MIXES]
    walls: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    tokens: dict[str, int] = {}
    for name, llm, mix in runs:  # warm-up: first activation of every adapter, kernels, packing
        llm.generate(prompts, params, lora_request=_mix_requests(mix, len(prompts)))
    for r in range(args.rounds):
        for name, llm, mix in runs:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=_mix_requests(mix, len(prompts)))
            walls[name].append(time.perf_counter() - t0)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {walls[n][-1]:.2f}s" for n in walls), flush=True)
    res = _summary(walls, tokens, "base (LoRA off)")
    res["load_s"] = {"all": loads, "median": statistics.median(loads), "max": max(loads)}
    return res, prompts


def _summary(walls: dict[str, list[float]], tokens: dict[str, int], base: str) -> dict:
    out = {"mixes": {}}
    for name, w in walls.items():
        out["mixes"][name] = {"wall_s_all": w, "wall_s": statistics.median(w), "tokens": tokens[name],
                              "tok_per_s": tokens[name] / statistics.median(w)}
    b = out["mixes"][base]["tok_per_s"]
    for m in out["mixes"].values():
        m["ratio"] = m["tok_per_s"] / b
    return out


def run_vllm(args, base_path: Path, adapters, prompts) -> dict:
    py, reason = venv_python(args.vllm_venv, "vllm", VLLM_INSTALL)
    if py is None:
        print(f"vLLM: skipped: {reason}", flush=True)
        return {"status": "skipped", "reason": reason}
    spec = {"model": str(base_path), "prompts": prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "max_model_len": 1024, "adapters": [[n, str(p)] for n, p in adapters], "mixes": [0, *MIXES],
            "max_lora_rank": args.rank}
    ans, why = run_child(py, "_vllm_lora.py", spec, vllm_env(args.threads), "vllm", 5400)
    if ans is None:
        return {"status": "failed", "reason": why}
    walls = {("base (LoRA off)" if k == "0" else k): v for k, v in ans["walls"].items()}
    tokens = {("base (LoRA off)" if k == "0" else k): v for k, v in ans["tokens"].items()}
    out = {"status": "ok", "version": ans["vllm_version"], **_summary(walls, tokens, "base (LoRA off)")}
    out["load_s"] = {"all": ans["load_s"], "median": statistics.median(ans["load_s"]), "max": max(ans["load_s"])}
    return out


def render(data: dict) -> str:
    k, v = data["kvmesh"], data["vllm"]
    names = list(k["mixes"])
    header = ["adapters in the mix", "kvmesh tok/s", "kvmesh vs base"]
    if v.get("status") == "ok":
        header += [f"vLLM {v['version']} tok/s", "vLLM vs base", "kvmesh / vLLM"]
    rows = []
    for n in names:
        row = [n, f"{k['mixes'][n]['tok_per_s']:.1f}", f"{k['mixes'][n]['ratio']:.2f}x"]
        if v.get("status") == "ok":
            vm = v["mixes"].get(n)
            row += ([f"{vm['tok_per_s']:.1f}", f"{vm['ratio']:.2f}x",
                     f"{k['mixes'][n]['tok_per_s'] / vm['tok_per_s']:.2f}x"] if vm else ["-", "-", "-"])
        rows.append(row)
    lines = ["# Multi-LoRA throughput: adapters in the mix vs base-only", "",
             f"{data['date']}; {data['cpu']}; embedded SmolLM2-135M fp32; {data['requests']} requests, greedy, "
             f"{data['max_tokens']} tokens each (ignore_eos); rank {data['rank']} on q/k/v/o/gate/up/down; "
             f"median of {data['rounds']} alternating round(s); {data['threads']} threads; load "
             f"{data['load_start']['1min']:.2f} -> {data['load_end']['1min']:.2f} (1 min).", ""]
    lines += md_table(header, rows)
    four = k["mixes"]["4"]["ratio"]
    lines += ["", f"Target 4 adapters >= 0.8x base: **{'MET' if four >= 0.8 else 'MISSED'}** ({four:.2f}x).", "",
              f"Adapter load (disk -> host, validated): kvmesh median {k['load_s']['median'] * 1e3:.1f} ms, max "
              f"{k['load_s']['max'] * 1e3:.1f} ms"
              + (f"; vLLM first use (load + 1-token request) median {v['load_s']['median'] * 1e3:.1f} ms."
                 if v.get("status") == "ok" else "."),
              "" if v.get("status") == "ok" else f"vLLM column: {v.get('status')}: {v.get('reason', '')}", ""]
    return "\n".join(lines)


def plot(plt, data: dict):
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = list(data["kvmesh"]["mixes"])
    systems = [("kvmesh", data["kvmesh"])] + ([("vLLM", data["vllm"])] if data["vllm"].get("status") == "ok" else [])
    width = 0.8 / len(systems)
    for j, (label, d) in enumerate(systems):
        ys = [d["mixes"].get(n, {}).get("tok_per_s", 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], ys, width=width, label=label)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel("output tok/s")
    ax.set_xlabel("adapters in the batch")
    ax.set_title("Multi-LoRA throughput (same requests)")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--adapters-dir", type=Path, default=Path.home() / ".cache" / "kvmesh" / "bench-adapters")
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    ap.add_argument("--smoke", action="store_true", help="4 requests, 1 round, 16 tokens: a pipeline check")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.rounds, args.max_tokens = 4, 1, 16
    from kvmesh.checkpoint.embedded import ensure_embedded_model

    base_path = ensure_embedded_model(progress=False)
    adapters = make_adapters(base_path, args.adapters_dir, max(MIXES), args.rank)
    start = load_snapshot()
    print("load at start:", start, flush=True)
    kv, prompts = run_kvmesh(args, base_path, adapters)
    vl = run_vllm(args, base_path, adapters, prompts) if args.peer == "vllm" else {"status": "skipped",
                                                                                   "reason": "--peer none"}
    data = {"date": dt.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(), "requests": args.requests,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "rank": args.rank, "threads": args.threads,
            "load_start": start, "load_end": load_snapshot(), "kvmesh": kv, "vllm": vl}
    md = render(data)
    print(md)
    write_results("lora_throughput_smoke" if args.smoke else "lora_throughput", data, md, plot, out_dir=args.out_dir)
    return data


if __name__ == "__main__":
    main()
