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
import ast
import datetime as dt
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

# Modules whose docstrings are the prompt text (English prose with some code).
TEXT_SOURCES = ("torch.nn.modules.module", "transformers.generation.utils")
# Load average (1 min) above which the machine counts as busy.
IDLE_LOAD = 0.5
# Targets from the issue.
TARGET_VS_STATIC = 5.0
TARGET_VS_BATCH1 = 20.0
TARGET_STEP_VS_FLOOR = 1.5
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    source: str
    seed: int
    prompt_offsets: list[int] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


# -- machine state ------------------------------------------------------------


def read_loadavg() -> dict:
    """The kernel's load averages (1, 5, 15 min) and a timestamp."""
    try:
        parts = Path("/proc/loadavg").read_text().split()
        one, five, fifteen = (float(x) for x in parts[:3])
    except OSError:
        one = five = fifteen = float("nan")
    return {"1min": one, "5min": five, "15min": fifteen, "time": time.time()}


def check_idle(load: dict, threads: int) -> bool:
    """Print the load and warn loudly if someone else is using the cores."""
    print(f"load average (1/5/15 min): {load['1min']:.2f} {load['5min']:.2f} {load['15min']:.2f}"
          f"  | cores: {os.cpu_count()}  | torch threads: {threads}")
    idle = load["1min"] <= IDLE_LOAD
    if not idle:
        bar = "!" * 78
        print(f"\n{bar}\n!! WARNING: 1-minute load average {load['1min']:.2f} > {IDLE_LOAD}: the machine is"
              f" busy.\n!! Timings will be slower and noisier than on idle cores; rerun when"
              f" `cat /proc/loadavg` is quiet.\n{bar}\n", file=sys.stderr, flush=True)
    if threads > (os.cpu_count() or threads):
        print(f"WARNING: --threads {threads} exceeds the {os.cpu_count()} cores", file=sys.stderr)
    return idle


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# -- workload -----------------------------------------------------------------


def load_text_tokens(tokenizer) -> tuple[list[int], str]:
    """Token ids of the docstrings of TEXT_SOURCES (read from disk, not imported)."""
    docs, used = [], []
    for mod in TEXT_SOURCES:
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.origin:
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        nodes = (n for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
        texts = [d for d in (ast.get_docstring(n) for n in nodes) if d]
        docs.extend(texts)
        used.append(f"{mod} ({len(texts)} docstrings)")
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False, verbose=False)["input_ids"] if docs else []
    return list(ids), "docstrings of " + ", ".join(used)


def make_workload(tokenizer, num_requests: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> Workload:
    """Requests with uniform prompt/output lengths (inclusive ranges), text windows as prompts."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_requests)
    text, source = load_text_tokens(tokenizer)
    if len(text) < 4 * prompt_range[1]:
        # Fallback: random ids from a safe range (skips the special tokens at the start).
        vocab = len(tokenizer)
        text = rng.integers(3, min(vocab, 49152), size=max(64 * prompt_range[1], 8192)).tolist()
        source = "random token ids in [3, 49152) (text source unavailable)"
    prompts, offsets, used = [], [], set()
    for n in prompt_lens:
        n = int(n)
        while True:  # distinct start offsets: no shared prefixes between prompts
            start = int(rng.integers(0, len(text) - n + 1))
            if start not in used:
                break
        used.add(start)
        offsets.append(start)
        prompts.append([int(t) for t in text[start:start + n]])
    source += f"; {len(text)} tokens, windows at distinct random offsets"
    return Workload(prompts, [int(x) for x in output_lens], source, seed, offsets)


# -- memory bandwidth and the batch-1 decode step -----------------------------


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> dict:
    """Copy bandwidth: time dst.copy_(src) on `mib` MiB float32 tensors; 2*bytes/median."""
    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros_like(src)
    dst.copy_(src)  # warmup (also faults the pages in)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
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


# -- systems ------------------------------------------------------------------


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
    for r in range(repeats):
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


def load_hf(model_path: Path):
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


# -- results ------------------------------------------------------------------


def summarize(systems: dict, step: dict | None, bandwidth: dict | None, wbytes: int | None) -> dict:
    """Ratios and target verdicts."""
    ratios, targets = {}, []
    kv = systems.get("kvmesh")
    static = {k: v for k, v in systems.items() if k.startswith("hf_static")}
    if kv and static:
        best = max(static, key=lambda k: static[k]["tok_per_s"])
        ratios["hf_best_static"] = best
        ratios["kvmesh_vs_hf_best_static"] = kv["tok_per_s"] / static[best]["tok_per_s"]
        targets.append({"name": f"kvmesh vs best static batch ({systems[best]['label']})",
                        "target": f">= {TARGET_VS_STATIC:g}x",
                        "value": ratios["kvmesh_vs_hf_best_static"],
                        "met": ratios["kvmesh_vs_hf_best_static"] >= TARGET_VS_STATIC})
    if kv and "hf_batch1" in systems:
        ratios["kvmesh_vs_hf_batch1"] = kv["tok_per_s"] / systems["hf_batch1"]["tok_per_s"]
        targets.append({"name": "kvmesh vs one-at-a-time", "target": f">= {TARGET_VS_BATCH1:g}x",
                        "value": ratios["kvmesh_vs_hf_batch1"],
                        "met": ratios["kvmesh_vs_hf_batch1"] >= TARGET_VS_BATCH1})
    floor = None
    if step and bandwidth and wbytes:
        floor_ms = wbytes / (bandwidth["bandwidth_gbps"] * 1e9) * 1e3
        ratio = step["decode_step_ms_median"] / floor_ms
        floor = {"weight_bytes": wbytes, "bandwidth_gbps": bandwidth["bandwidth_gbps"],
                 "floor_ms": floor_ms, "step_ms": step["decode_step_ms_median"], "step_vs_floor": ratio}
        targets.append({"name": "batch-1 decode step vs bandwidth floor",
                        "target": f"<= {TARGET_STEP_VS_FLOOR:g}x", "value": ratio,
                        "met": ratio <= TARGET_STEP_VS_FLOOR})
    return {"ratios": ratios, "floor": floor, "targets": targets}


def render_markdown(res: dict) -> str:
    cfg, systems = res["config"], res["systems"]
    kv_tps = systems.get("kvmesh", {}).get("tok_per_s")
    title = "Engine throughput" + (" (SMOKE run: numbers are not meaningful)" if res["smoke"] else "")
    lines = [
        f"# {title}",
        "",
        f"{res['date']} · {res['model']} float32 · torch {res['torch_version']} · "
        f"transformers {res['transformers_version']} · {cfg['threads']} thread(s) · {res['cpu']}",
        "",
        f"Workload: {cfg['num_requests']} requests, prompts {cfg['prompt_len_range'][0]}-"
        f"{cfg['prompt_len_range'][1]} tokens ({res['workload']['total_prompt_tokens']} total), outputs "
        f"{cfg['output_len_range'][0]}-{cfg['output_len_range'][1]} tokens "
        f"({res['workload']['total_output_tokens']} total), seed {cfg['seed']}, greedy, EOS ignored. "
        f"Prompt text: {res['workload']['source']}.",
        f"The big workload ran {cfg['repeats']} time(s) per system"
        + (" (median wall time)." if cfg["repeats"] > 1 else "."),
        "",
        "| system | useful output tokens | wall s | tok/s | kvmesh speedup vs it |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, s in systems.items():
        speed = "—" if key == "kvmesh" or kv_tps is None else f"{kv_tps / s['tok_per_s']:.2f}x"
        lines.append(f"| {s['label']} | {s['useful_output_tokens']} | {s['wall_s']:.2f} | "
                     f"{s['tok_per_s']:.1f} | {speed} |")
    notes = []
    if "hf_batch1" in systems:
        b1 = systems["hf_batch1"]
        notes.append(f"transformers batch 1 ran on the first {b1['subset_requests']} requests only; its tok/s "
                     f"is computed on that subset (full workload would take ~{b1['estimated_full_workload_wall_s']:.0f} s).")
    if any(k.startswith("hf_static") for k in systems):
        notes.append("Static batches: arrival order, left padding, each batch runs to its longest request; "
                     "only the tokens each request asked for count.")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    fl = res["summary"]["floor"]
    if fl:
        st = res["decode_step"]
        lines += [
            "",
            f"Batch-1 decode step (kvmesh, {st['prompt_tokens']}-token prompt, {st['max_tokens']} output tokens, "
            f"median of {st['num_decode_steps']} decode steps): **{fl['step_ms']:.2f} ms** "
            f"(mean {st['decode_step_ms_mean']:.2f}, min {st['decode_step_ms_min']:.2f}, p90 {st['decode_step_ms_p90']:.2f})",
            f"Bandwidth floor: {fl['weight_bytes'] / 1e6:.1f} MB of weights / {fl['bandwidth_gbps']:.2f} GB/s copy "
            f"bandwidth = **{fl['floor_ms']:.2f} ms**; step / floor = **{fl['step_vs_floor']:.2f}x**",
        ]
    if res["summary"]["targets"]:
        lines += ["", "| target | goal | measured | verdict |", "|---|---:|---:|---|"]
        for t in res["summary"]["targets"]:
            lines.append(f"| {t['name']} | {t['target']} | {t['value']:.2f}x | {'met' if t['met'] else 'MISSED'} |")
    san = res.get("sanity")
    if san:
        verdict = "match" if san["all_match"] else "MISMATCH"
        detail = ", ".join(f"#{p['request']}: {'ok' if p['match'] else 'differs at token ' + str(p['first_mismatch'])}"
                           for p in san["per_request"])
        lines += ["", f"Sanity: kvmesh greedy vs transformers batch 1 on the first {san['requests_compared']} "
                      f"requests: **{verdict}** ({detail})."]
    la = res["load_average"]
    lines += ["", f"Load average (1 min) at start {la['start']['1min']:.2f}, at end {la['end']['1min']:.2f}"
                  + ("" if res["idle_at_start"] else " — WARNING: the machine was busy at start")]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = res["systems"]
    keys = list(systems)
    labels = [systems[k]["label"].replace(" (", "\n(").replace("transformers ", "transformers\n") for k in keys]
    tps = [systems[k]["tok_per_s"] for k in keys]
    colors = ["tab:orange" if k == "kvmesh" else "tab:gray" for k in keys]
    kv_tps = systems.get("kvmesh", {}).get("tok_per_s")

    fig, ax = plt.subplots(figsize=(9, 5.2))
    bars = ax.bar(range(len(keys)), tps, color=colors, edgecolor="black", linewidth=0.6)
    top = max(tps)
    for bar, k, v in zip(bars, keys, tps):
        text = f"{v:.1f} tok/s"
        if k != "kvmesh" and kv_tps:
            text += f"\nkvmesh = {kv_tps / v:.1f}x"
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + top * 0.015, text,
                ha="center", va="bottom", fontsize=9, fontweight="bold" if k == "kvmesh" else "normal")
    ax.set_xticks(range(len(keys)), labels, fontsize=9)
    ax.set_ylabel("useful output tokens / s")
    ax.set_ylim(0, top * 1.25)
    cfg = res["config"]
    title = (f"{res['model']} float32, {cfg['num_requests']} requests, {cfg['threads']} thread(s)"
             + ("  [SMOKE]" if res["smoke"] else ""))
    ax.set_title(title, fontsize=11)
    fl = res["summary"]["floor"]
    if fl:
        fig.text(0.5, 0.01, f"kvmesh batch-1 decode step {fl['step_ms']:.1f} ms vs bandwidth floor "
                 f"{fl['floor_ms']:.1f} ms ({fl['step_vs_floor']:.2f}x; {fl['bandwidth_gbps']:.1f} GB/s copy)",
                 ha="center", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(res: dict, out_dir: Path, prefix: str) -> tuple[list[Path], str]:
    """Write <prefix>.json (raw numbers), .md (table) and .png (bar chart); returns (paths, markdown)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = json.loads(json.dumps(res, default=str))
    for s in clean["systems"].values():  # raw token lists stay out of the JSON
        s.pop("_outputs", None)
    markdown = render_markdown(clean)
    paths = [out_dir / f"{prefix}.json", out_dir / f"{prefix}.md", out_dir / f"{prefix}.png"]
    paths[0].write_text(json.dumps(clean, indent=2) + "\n")
    paths[1].write_text(markdown)
    plot(clean, paths[2])
    return paths, markdown


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
                   help="tiny end-to-end check: 6 requests, prompts 8-32, outputs 4-8; writes engine_throughput_smoke.*")
    args = p.parse_args(argv)
    if args.smoke:
        defaults = dict(num_requests=6, hf_batch1_subset=2, hf_batch_sizes=[2, 4], b1_repeats=1)
        args.prompt_range, args.output_range, args.b1_prompt, args.b1_tokens = (8, 32), (4, 8), 8, 16
        args.bandwidth_repeats = 3
    else:
        defaults = dict(num_requests=64, hf_batch1_subset=8, hf_batch_sizes=[8, 32], b1_repeats=3)
        args.prompt_range, args.output_range, args.b1_prompt, args.b1_tokens = (32, 512), (16, 256), 32, 64
        args.bandwidth_repeats = 5
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.prefix = "engine_throughput_smoke" if args.smoke else "engine_throughput"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    import kvmesh
    from kvmesh import LLM, SamplingParams

    load_start = read_loadavg()
    idle = check_idle(load_start, args.threads)
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

    phases["bandwidth"] = read_loadavg()
    bandwidth = measure_bandwidth(256, args.bandwidth_repeats)
    print(f"copy bandwidth: {bandwidth['bandwidth_gbps']:.2f} GB/s")
    wbytes = weight_bytes(llm.engine.model)

    phases["decode_step"] = read_loadavg()
    b1_text, _ = load_text_tokens(llm.tokenizer)
    b1_prompt = (b1_text[-args.b1_prompt:] if len(b1_text) >= args.b1_prompt
                 else np.random.default_rng(1).integers(3, 49152, size=args.b1_prompt).tolist())
    step = decode_step_time(llm, b1_prompt, args.b1_tokens, args.b1_repeats)
    print(f"kvmesh batch-1 decode step: {step['decode_step_ms_median']:.2f} ms (median); "
          f"floor {wbytes / (bandwidth['bandwidth_gbps'] * 1e9) * 1e3:.2f} ms")

    systems: dict[str, dict] = {}
    phases["kvmesh"] = read_loadavg()
    print("kvmesh: all requests at once ...", flush=True)
    systems["kvmesh"] = run_kvmesh(llm, workload, args.repeats)
    print(f"kvmesh: {systems['kvmesh']['tok_per_s']:.1f} tok/s in {systems['kvmesh']['wall_s']:.1f} s")
    engine_config = llm.engine.config.model_dump()
    del llm
    gc.collect()

    sanity = None
    hf_info = None
    if not args.skip_hf:
        print("loading transformers model ...", flush=True)
        model, _tok, pad_id = load_hf(model_path)
        hf_info = {"attn_implementation": getattr(model.config, "_attn_implementation", None), "pad_token_id": pad_id}
        hf_generate(model, [warm, warm[:16]], 4, pad_id)  # warmup
        for bs in tqdm(args.hf_batch_sizes, desc="transformers static batching"):
            phases[f"hf_static_b{bs}"] = read_loadavg()
            systems[f"hf_static_b{bs}"] = r = run_hf_static(model, workload, bs, pad_id, args.repeats)
            print(f"transformers static batch {bs}: {r['tok_per_s']:.1f} tok/s in {r['wall_s']:.1f} s")
        phases["hf_batch1"] = read_loadavg()
        systems["hf_batch1"] = r = run_hf_batch1(model, workload, args.hf_batch1_subset, pad_id)
        print(f"transformers batch 1 (first {r['subset_requests']}): {r['tok_per_s']:.1f} tok/s")
        sanity = sanity_check(systems["kvmesh"]["_outputs"], r["_outputs"], model, workload, pad_id)
        print(f"sanity (kvmesh == transformers batch 1 on first {sanity['requests_compared']}): "
              f"{'MATCH' if sanity['all_match'] else 'MISMATCH'}")

    load_end = read_loadavg()
    res = {
        "benchmark": "engine_throughput",
        "smoke": args.smoke,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model_path.name,
        "model_path": str(model_path),
        "dtype": "float32",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "kvmesh_version": kvmesh.__version__,
        "python_version": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "config": {
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
            "kvmesh_engine_config": engine_config,
            "kvmesh_load_s": kv_load_s,
            "hf": hf_info,
        },
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
    paths, markdown = write_results(res, args.out_dir, args.prefix)
    print()
    print(markdown)
    print(f"load average now: {load_end['1min']:.2f} {load_end['5min']:.2f} {load_end['15min']:.2f}")
    print("wrote " + ", ".join(str(p) for p in paths))
    return res


if __name__ == "__main__":
    main()
