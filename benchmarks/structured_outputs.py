"""Output throughput with a JSON schema vs unconstrained, on the same requests (target >= 0.9x),
beside vLLM's structured outputs on the same weights and schema.

What is measured: ``--requests`` (32) chat prompts asking for a JSON record, through the
embedded model's chat template, greedy, ``--max-tokens`` (256) at most, all submitted at once
through the offline ``LLM.generate``: once free, once with ``structured_outputs=json`` (the
schema below). A warm-up pass of each first (the schema's compile is paid there, once, as in
serving), then ``--rounds`` (3) timed passes; tok/s = generated tokens / median wall time.
Constrained outputs are shorter (they stop when the JSON closes), so tok/s, not wall time, is
compared; every constrained output is checked with jsonschema (the count is recorded).

``--peer vllm`` runs the same token ids through vLLM's offline LLM in its venv
(``--vllm-venv``, default /tmp/vllm-cpu; ``_vllm_structured.py``) after kvmesh has finished;
a missing venv is recorded as skipped. Run on idle cores (load printed at start and end)::

    python benchmarks/structured_outputs.py --peer vllm
    python benchmarks/structured_outputs.py --smoke --out-dir /tmp/so   # 4 requests, 1 round

Results: ``benchmarks/results/structured_outputs.{json,md,png}`` (``_smoke`` for --smoke).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.structured_outputs import StructuredOutputsParams

from _common import RESULTS_DIR, load_snapshot, md_table, write_results
from _peer_procs import DEFAULT_VLLM_VENV, VLLM_INSTALL, run_child, venv_python, vllm_env

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 40},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "level": {"type": "string", "enum": ["junior", "mid", "senior"]},
        "remote": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "skills", "level", "remote"],
}
TOPICS = ["a data engineer", "a nurse", "a chef", "a pilot", "a teacher", "a plumber", "a violinist", "a farmer"]


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msg = (f"Write a JSON record for {TOPICS[i % len(TOPICS)]} number {i}: name, age, email, city, "
               "skills, level and whether they work remotely.")
        out.append(llm.engine.encode_chat([{"role": "user", "content": msg}]))
    return out


def _passes(llm: LLM, prompts, params: SamplingParams, rounds: int) -> tuple[list[float], list]:
    llm.generate(prompts, params)  # warm-up
    walls, outs = [], None
    for _ in range(rounds):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        walls.append(time.perf_counter() - t0)
    return walls, outs


def run_kvmesh(args) -> tuple[dict, list[list[int]]]:
    torch.set_num_threads(args.threads)
    llm = LLM(progress=False, max_model_len=2048, max_num_seqs=max(args.requests, 1))
    prompts = _prompts(llm, args.requests)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    cons = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))
    res = {}
    for name, params in (("free", free), ("json", cons)):
        walls, outs = _passes(llm, prompts, params, args.rounds)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        res[name] = {"wall_s_all": walls, "wall_s": statistics.median(walls), "tokens": tokens,
                     "tok_per_s": tokens / statistics.median(walls)}
        if name == "json":
            res[name]["valid"] = sum(_valid(o.outputs[0].text) for o in outs)
    res["ratio"] = res["json"]["tok_per_s"] / res["free"]["tok_per_s"]
    return res, prompts


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_vllm(args, prompts) -> dict:
    py, reason = venv_python(args.vllm_venv, "vllm", VLLM_INSTALL)
    if py is None:
        print(f"vLLM: skipped: {reason}", flush=True)
        return {"status": "skipped", "reason": reason}
    from kvmesh.checkpoint.embedded import ensure_embedded_model

    spec = {"model": str(ensure_embedded_model(progress=False)), "prompts": prompts, "max_tokens": args.max_tokens,
            "schema": SCHEMA, "rounds": args.rounds, "max_model_len": 2048}
    ans, why = run_child(py, "_vllm_structured.py", spec, vllm_env(args.threads), "vllm", 3600)
    if ans is None:
        return {"status": "failed", "reason": why}
    out = {"status": "ok", "version": ans["vllm_version"]}
    for name in ("free", "json"):
        wall = statistics.median(ans[name])
        out[name] = {"wall_s_all": ans[name], "wall_s": wall, "tokens": ans[f"{name}_tokens"][-1],
                     "tok_per_s": ans[f"{name}_tokens"][-1] / wall}
    out["json"]["valid"] = sum(_valid(t) for t in ans["json_texts"])
    out["ratio"] = out["json"]["tok_per_s"] / out["free"]["tok_per_s"]
    return out


def render(data: dict) -> str:
    k, v = data["kvmesh"], data["vllm"]
    rows = [["kvmesh", f"{k['free']['tok_per_s']:.1f}", f"{k['json']['tok_per_s']:.1f}", f"{k['ratio']:.2f}x",
             f"{k['json']['valid']}/{data['requests']}"]]
    if v.get("status") == "ok":
        rows.append([f"vLLM {v['version']}", f"{v['free']['tok_per_s']:.1f}", f"{v['json']['tok_per_s']:.1f}",
                     f"{v['ratio']:.2f}x", f"{v['json']['valid']}/{data['requests']}"])
    lines = ["# Structured outputs: JSON schema vs unconstrained output tok/s", "",
             f"{data['date']}; embedded SmolLM2-135M fp32; {data['requests']} requests, greedy, max_tokens "
             f"{data['max_tokens']}; median of {data['rounds']} round(s); {data['threads']} threads; load "
             f"{data['load_start']['1min']:.2f} -> {data['load_end']['1min']:.2f} (1 min).", ""]
    lines += md_table(["system", "free tok/s", "json tok/s", "json / free", "valid outputs"], rows)
    verdict = "MET" if k["ratio"] >= 0.9 else "MISSED"
    lines += ["", f"Target json / free >= 0.9x: **{verdict}** ({k['ratio']:.2f}x).",
              "" if v.get("status") == "ok" else f"vLLM column: {v.get('status')}: {v.get('reason', '')}", ""]
    return "\n".join(lines)


def plot(plt, data: dict):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    systems = [("kvmesh", data["kvmesh"])] + ([("vLLM", data["vllm"])] if data["vllm"].get("status") == "ok" else [])
    for i, (name, d) in enumerate(systems):
        ax.bar([i - 0.2, i + 0.2], [d["free"]["tok_per_s"], d["json"]["tok_per_s"]], width=0.4,
               color=["#888", "#2a7"])
    ax.set_xticks(range(len(systems)), [s for s, _ in systems])
    ax.set_ylabel("output tok/s (grey: free, green: JSON schema)")
    ax.set_title("Structured outputs throughput")
    fig.tight_layout()
    return fig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    ap.add_argument("--smoke", action="store_true", help="4 requests, 1 round: a pipeline check")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.rounds, args.max_tokens = 4, 1, min(args.max_tokens, 128)
    start = load_snapshot()
    print("load at start:", start, flush=True)
    kv, prompts = run_kvmesh(args)
    vl = run_vllm(args, prompts) if args.peer == "vllm" else {"status": "skipped", "reason": "--peer none"}
    data = {"date": dt.datetime.now().isoformat(timespec="seconds"), "requests": args.requests,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "threads": args.threads, "schema": SCHEMA,
            "load_start": start, "load_end": load_snapshot(), "kvmesh": kv, "vllm": vl}
    md = render(data)
    print(md)
    write_results("structured_outputs_smoke" if args.smoke else "structured_outputs", data, md, plot,
                  out_dir=args.out_dir)
    return data


if __name__ == "__main__":
    main()
