"""Structured pruning + distillation of the embedded SmolLM2-135M-Instruct: size, speed, quality.

Rows (each measured with the kvmesh engine, fp32, batch 1):

* original;
* pruned to 75% and to 50% of the parameters (``kvmesh optimize prune --target-params``:
  least-influential layers for half of the cut, Wanda-ranked MLP channels for the rest);
* each pruned model distilled from the original (KL at temperature 1 on the teacher's
  top-k logits, cached once and shared by both students, over windows spread across the
  corpus "train" split).

Columns: parameters; decode tokens/s at batch 1 (median over repeats); perplexity on
two held-out texts: the first 1,024 tokens of CPython's LICENSE.txt (the text of
benchmarks/quant.py) and of the corpus "eval" split's documentation (pydoc topics
never seen in calibration or training). Target: distillation recovers at least half
of the perplexity pruning lost: (ppl_pruned - ppl_distilled) / (ppl_pruned - ppl_orig) >= 0.5.

Draft models for speculative decoding of the original (k=4, greedy chat prompts, batch
1): the plain first-K-layers truncation vs the same truncation distilled on the
teacher's own greedy replies to chat instructions built from the train split
(``--data chat``, kvmesh.optimize.generate); acceptance rate, tokens/s and speedup vs
no speculation, and a check that the text is identical.

Run on idle cores (prints the 1-minute load average beside the timings)::

    python benchmarks/optimize.py                 # full run, ~40 min on 2 cores
    python benchmarks/optimize.py --quick         # smoke settings, writes optimize_quick.*

Results: benchmarks/results/optimize.{json,md,png} (optimize_quick.* for --quick).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from _common import RESULTS_DIR, check_idle, decode_tok_s, is_idle, loadavg, md_table, write_results

OUT_DIR = RESULTS_DIR
RECOVERY_TARGET = 0.5
CHAT = ["Explain why the sky is blue.", "Write a short story about a robot who learns to paint.",
        "What are three tips for staying focused while studying?", "Describe the water cycle in simple terms."]


@dataclass(frozen=True)
class Settings:
    """Everything that differs between the full run and --quick."""

    steps: int
    draft_steps: int
    draft_lr: float
    batch_size: int
    seq_len: int
    lr: float
    top_k: int
    calibration_windows: int
    calibration_seq_len: int
    eval_tokens: int
    decode_tokens: int
    repeats: int
    spec_prompts: int
    spec_tokens: int
    draft_layers: int
    chat_prompts: int  # the draft's training data: the teacher's replies to this many instructions
    chat_max_tokens: int


FULL = Settings(steps=200, draft_steps=200, draft_lr=5e-4, batch_size=4, seq_len=128, lr=2e-4, top_k=64,
                calibration_windows=16, calibration_seq_len=256, eval_tokens=1024, decode_tokens=48, repeats=3,
                spec_prompts=4, spec_tokens=64, draft_layers=6, chat_prompts=256, chat_max_tokens=96)
QUICK = Settings(steps=3, draft_steps=3, draft_lr=5e-4, batch_size=2, seq_len=32, lr=2e-4, top_k=16,
                 calibration_windows=2, calibration_seq_len=64, eval_tokens=96, decode_tokens=6, repeats=1,
                 spec_prompts=1, spec_tokens=8, draft_layers=2, chat_prompts=4, chat_max_tokens=8)


def _llm(path: Path, threads: int, speculative: dict | None = None):
    from kvmesh import LLM
    from kvmesh.models.loader import load_arch_config

    max_len = min(2048, load_arch_config(path).max_position_embeddings)
    return LLM(str(path), progress=False, num_threads=threads, num_blocks=200, max_model_len=max_len,
               max_num_batched_tokens=1024, speculative=speculative)


def batch1_decode_tok_s(llm, new_tokens: int, repeats: int) -> float:
    """Median batch-1 decode tokens/s: tokens after the prefill step / their time."""
    from kvmesh import SamplingParams

    eng, rates = llm.engine, []
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for r in range(repeats + 1):  # the first run warms up
        eng.add_request(f"decode-{r}", [1, 200 + r, *range(100, 131)], params)  # distinct: no prefix hits
        rate = decode_tok_s(eng)
        if r:
            rates.append(rate)
    return statistics.median(rates)


def held_out_tokens(tokenizer, n: int) -> dict[str, list[int]]:
    """{"license": LICENSE.txt tokens, "docs": corpus eval-split docs tokens}, BOS first, n each."""
    from kvmesh.optimize.corpus import split_documents

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    docs = "\n\n".join(d.text for d in split_documents("eval") if not d.source.startswith("CPython"))
    lic = next(d.text for d in split_documents("eval") if d.source.startswith("CPython"))
    texts = {"license": lic, "docs": docs}
    return {k: bos + tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"][:n] for k, t in texts.items()}


def measure_model(name: str, path: Path, s: Settings, threads: int) -> dict:
    from kvmesh.models.loader import load_arch_config
    from kvmesh.quant.quality import perplexity

    llm = _llm(path, threads)
    row = {"model": name, "path": str(path), "params": load_arch_config(path).num_params,
           "decode_b1_tok_s": batch1_decode_tok_s(llm, s.decode_tokens, s.repeats), "loadavg": loadavg()[0]}
    for key, ids in held_out_tokens(llm.tokenizer, s.eval_tokens).items():
        row[f"ppl_{key}"] = perplexity(llm.engine, ids)
    return row


def spec_run(target: Path, draft: Path | None, s: Settings, threads: int) -> dict:
    """Greedy chat generations at batch 1 with (or without) a draft model."""
    from kvmesh import SamplingParams

    spec = None if draft is None else {"method": "draft", "model": str(draft), "num_speculative_tokens": 4,
                                       "max_batch_size": 64}
    llm = _llm(target, threads, spec)
    eng = llm.engine
    prompts = [eng.encode_chat([{"role": "user", "content": c}]) if eng.tokenizer.chat_template
               else eng.encode(c) for c in CHAT[: s.spec_prompts]]
    params = SamplingParams(max_tokens=s.spec_tokens, temperature=0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm up
    before = dict(eng.spec_counters)
    texts, tokens, t0 = [], 0, time.perf_counter()
    for p in prompts:
        out = llm.generate([p], params)[0].outputs[0]
        texts.append(out.token_ids)
        tokens += len(out.token_ids)
    wall = time.perf_counter() - t0
    prop = eng.spec_counters["proposed"] - before["proposed"]
    acc = eng.spec_counters["accepted"] - before["accepted"]
    return {"draft": None if draft is None else draft.name, "tok_s": tokens / wall, "tokens": tokens,
            "acceptance_rate": acc / prop if prop else None, "token_ids": texts, "loadavg": loadavg()[0]}


def build_models(src: Path, work: Path, s: Settings, threads: int, bar) -> dict[str, Path]:
    """Prune, truncate and distill every model of the benchmark; returns {name: folder}."""
    from kvmesh.models.loader import load_arch_config, load_tokenizer
    from kvmesh.optimize.corpus import token_windows
    from kvmesh.optimize.distill import DistillConfig, distill
    from kvmesh.optimize.prune import first_layers_checkpoint, prune_checkpoint, resolve_shape

    tok, cfg = load_tokenizer(src), load_arch_config(src)
    calib = token_windows(tok, "calibration", s.calibration_seq_len, s.calibration_windows)
    train = token_windows(tok, "train", s.seq_len, s.steps * s.batch_size)
    cache = work / "teacher-topk.pt"
    paths: dict[str, Path] = {"original": src}
    timings: dict[str, float] = {}
    for pct in (75, 50):
        name = f"pruned-{100 - pct}%"
        bar.set_postfix_str(f"prune {name}")
        t0 = time.perf_counter()
        paths[name] = prune_checkpoint(src, work / name, resolve_shape(cfg, f"{pct}%"), calib, progress=False).out
        timings[f"prune {name}"] = time.perf_counter() - t0
        bar.update(1)
    # Pruned students learn the corpus (their quality is measured on held-out text); the
    # draft learns the teacher's own chat replies (it is measured on chat prompts).
    jobs = [(f"{n}+distilled", str(paths[n]), s.steps, "corpus") for n in ("pruned-25%", "pruned-50%")]
    jobs.append((f"first-{s.draft_layers}+distilled", f"first-layers:{s.draft_layers}", s.draft_steps, "chat"))
    for name, student, steps, data in jobs:
        bar.set_postfix_str(f"distill {name}")
        dc = DistillConfig(steps=steps, lr=s.lr if data == "corpus" else s.draft_lr, batch_size=s.batch_size,
                           seq_len=s.seq_len, teacher_top_k=s.top_k,
                           checkpoint_every=max(steps // 2, 1), threads=threads, data=data,
                           chat_prompts=s.chat_prompts, chat_max_tokens=s.chat_max_tokens)
        t0 = time.perf_counter()
        paths[name] = distill(src, student, work / name, dc, train_windows=train if data == "corpus" else None,
                              teacher_cache=cache if data == "corpus" else work / "teacher-topk-chat.pt",
                              progress=True).out
        timings[f"distill {name}"] = time.perf_counter() - t0
        bar.update(1)
    paths[f"first-{s.draft_layers}"] = first_layers_checkpoint(src, work / f"first-{s.draft_layers}", s.draft_layers)
    (work / "timings.json").write_text(json.dumps(timings, indent=2))
    return paths


def recovery(rows: list[dict], key: str) -> dict[str, float]:
    """Share of the perplexity lost by pruning that distillation won back, per pruned model."""
    orig = next(r for r in rows if r["model"] == "original")[key]
    by = {r["model"]: r[key] for r in rows}
    out = {}
    for name in ("pruned-25%", "pruned-50%"):
        lost = by[name] - orig
        out[name] = (by[name] - by[f"{name}+distilled"]) / lost if lost > 0 else float("nan")
    return out


def markdown(res: dict) -> str:
    m, st = res["meta"], res["meta"]["settings"]
    busy = "" if m["idle"] else " (BUSY: do not quote timings)"
    lines = [f"# kvmesh pruning + distillation: {m['model']}", "",
             (f"{m['date']}, torch threads {m['threads']}, load avg start/end {m['load_start']:.2f}/"
              f"{m['load_end']:.2f}{busy}{' — QUICK settings' if m['quick'] else ''}; "
              f"distill {st['steps']} steps x {st['batch_size']} x {st['seq_len']} "
              f"tokens, lr {st['lr']}, temperature 1, teacher top-{st['top_k']}; pruned "
              f"students on the corpus train split, the draft on the teacher's greedy replies to "
              f"{st.get('chat_prompts')} chat instructions ({st['draft_steps']} steps, lr {st.get('draft_lr')})"), ""]
    orig = res["models"][0]
    lines += md_table(["model", "params", "vs original", "decode b1 tok/s", "load avg", "ppl LICENSE",
                       "ppl held-out docs"],
                      ([r["model"], f"{r['params'] / 1e6:.1f}M", f"{r['params'] / orig['params']:.2f}x",
                        f"{r['decode_b1_tok_s']:.1f}", f"{r['loadavg']:.1f}", f"{r['ppl_license']:.2f}",
                        f"{r['ppl_docs']:.2f}"] for r in res["models"]), "lrrrrrr")
    lines += ["", ("Recovery = (ppl pruned - ppl distilled) / (ppl pruned - ppl original); "
                   f"target >= {RECOVERY_TARGET}:")]
    for key, rec in res["recovery"].items():
        for name, v in rec.items():
            lines.append(f"- {name}, {key}: {v:.2f} ({'met' if v >= RECOVERY_TARGET else 'MISSED'})")
    lines += ["", (f"## Drafts for speculative decoding of the original (k=4, batch 1, greedy chat, "
                   f"{st['spec_tokens']} tokens)"), ""]
    lines += md_table(["draft", "params", "acceptance", "tok/s", "speedup vs off", "load avg", "same output"],
                      ([r["draft"] or "off", f"{r['params'] / 1e6:.1f}M",
                        "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}", f"{r['tok_s']:.1f}",
                        f"{r['speedup']:.2f}x", f"{r['loadavg']:.1f}", "yes" if r["identical_to_off"] else "NO"]
                       for r in res["drafts"]), "lrrrrrl")
    lines += ["", "Build timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in res["build_timings_s"].items())]
    return "\n".join(lines) + "\n"


def plot(plt, res: dict):
    rows = res["models"]
    names = [r["model"] for r in rows]
    panels = [("parameters (M)", [r["params"] / 1e6 for r in rows]),
              ("decode b1 tok/s", [r["decode_b1_tok_s"] for r in rows]),
              ("ppl LICENSE (log)", [r["ppl_license"] for r in rows]),
              ("ppl held-out docs (log)", [r["ppl_docs"] for r in rows]),
              ("draft acceptance", [r["acceptance_rate"] or 0.0 for r in res["drafts"]])]
    fig, axes = plt.subplots(1, len(panels), figsize=(20, 3.8))
    for ax, (title, vals) in zip(axes, panels):
        labels = [r["draft"] or "off" for r in res["drafts"]] if "draft" in title else names
        ax.bar(labels, vals, color="#37a")
        if "log" in title:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    return fig


def measure_all(src: Path, work: Path, s: Settings, threads: int) -> tuple[list[dict], list[dict], dict]:
    """Build every model in `work`, then measure them: (model rows, draft rows, build timings)."""
    from kvmesh.models.loader import load_arch_config

    bar = tqdm(total=5 + 5 + 3, desc="optimize benchmark", unit="phase")
    try:
        paths = build_models(src, work, s, threads, bar)
        rows = []
        for name in ("original", "pruned-25%", "pruned-25%+distilled", "pruned-50%", "pruned-50%+distilled"):
            bar.set_postfix_str(f"measure {name}")
            rows.append(measure_model(name, paths[name], s, threads))
            bar.update(1)
        drafts = []
        for name in (None, f"first-{s.draft_layers}", f"first-{s.draft_layers}+distilled"):
            bar.set_postfix_str(f"speculative {name or 'off'}")
            path = src if name is None else paths[name]
            drafts.append({**spec_run(src, None if name is None else path, s, threads),
                           "params": load_arch_config(path).num_params})
            bar.update(1)
    finally:
        bar.close()
    for d in drafts:
        d["speedup"] = d["tok_s"] / drafts[0]["tok_s"]
        d["identical_to_off"] = d["token_ids"] == drafts[0]["token_ids"]
    for d in drafts:
        d.pop("token_ids")
    return rows, drafts, json.loads((work / "timings.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke settings (a few steps); writes optimize_quick.*")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="teacher folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=int, default=None, help="override distillation steps of the pruned students")
    p.add_argument("--work-dir", type=Path, default=None, help="keep the built models here (default: a temp dir)")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    from kvmesh.models.loader import resolve_model_path

    s = QUICK if args.quick else FULL
    if args.steps:
        s = Settings(**{**s.__dict__, "steps": args.steps})
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = loadavg()[0]
    check_idle(args.threads, start)
    src = resolve_model_path(args.model)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvmesh-optimize-"))
    if args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        rows, drafts, timings = measure_all(src, work, s, args.threads)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    end = loadavg()[0]
    meta = {"model": "SmolLM2-135M-Instruct (embedded)" if args.model is None else args.model,
            "date": dt.datetime.now().isoformat(timespec="seconds"), "threads": args.threads,
            "load_start": start, "load_end": end,
            "idle": is_idle(start) and is_idle(end, own_threads=args.threads),
            "quick": args.quick, "settings": s.__dict__, "wall_s": time.perf_counter() - t_start,
            "torch": torch.__version__}
    res = {"meta": meta, "models": rows, "drafts": drafts, "build_timings_s": timings,
           "recovery": {"ppl LICENSE": recovery(rows, "ppl_license"), "ppl held-out docs": recovery(rows, "ppl_docs")}}
    md = markdown(res)
    write_results("optimize_quick" if args.quick else "optimize", res, md, plot, args.out_dir, dpi=110)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
