"""engine_throughput's A/B of two kvmesh source trees (``--baseline-src``): this checkout's
engine against another checkout's (e.g. the previous commit, ``git worktree add``) on the
same workload, in the same run.

Each side runs in its own subprocess (this file as a script, with ``PYTHONPATH`` set to that
tree's ``platform/`` folder, so `import kvmesh` is that tree's): load the engine, one untimed
warm-up pass and one timed pass of the offline workload (the ``_kvmesh_runs`` protocol), then
batch-1 decode. Rounds alternate the order (A B, B A, ...) so neither side always runs on a
machine warmed by the other; the result per side is the median over rounds, and the greedy
outputs of the two sides must be equal (recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
THIS_SRC = HERE.parent / "platform"


def _child(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    spec = json.loads(a.spec.read_text())
    sys.path.insert(0, str(HERE))
    import torch

    import kvmesh
    from kvmesh import LLM, SamplingParams

    from _kvmesh_runs import b1_decode, decode_step_time, run_kvmesh
    from _workloads import Workload

    torch.set_num_threads(spec["threads"])
    src = str(Path(kvmesh.__file__).resolve())
    assert src.startswith(spec["src"]), f"imported kvmesh from {src}, not {spec['src']}"
    llm = LLM(model=spec["model"], progress=False, num_threads=spec["threads"], max_num_seqs=64,
              max_num_batched_tokens=1024)
    warm = spec["warm"]
    llm.generate([warm, warm[:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    workload = Workload(spec["prompts"], spec["output_lens"], "ab", 0)
    offline = run_kvmesh(llm, workload, repeats=1, warmup_passes=spec["warmup_passes"])
    b1 = b1_decode(llm, spec["b1_prompt"], spec["b1_tokens"], spec["b1_repeats"], "ab")
    step = decode_step_time(llm, spec["b1_prompt"], spec["b1_tokens"], 1)
    a.out.write_text(json.dumps({"src": src, "tok_per_s": offline["tok_per_s"], "wall_s": offline["wall_s"],
                                 "outputs": offline["_outputs"], "b1_decode_tok_per_s": b1["decode_tok_per_s"],
                                 "b1_output_ids": b1["output_ids"],
                                 "decode_step_ms_median": step["decode_step_ms_median"]}))


def _run_side(src: Path, spec: dict, workdir: Path, tag: str) -> dict:
    spec = {**spec, "src": str(src.resolve())}
    spec_path, out = workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--spec", str(spec_path), "--out", str(out)],
                   env=env, check=True)
    return json.loads(out.read_text())


def run_ab(baseline_src: Path, model: str | None, workload, warm: list[int], b1_prompt: list[int], args) -> dict:
    """`args.ab_rounds` alternating rounds of this tree vs `baseline_src`; see the module doc."""
    from _common import load_snapshot

    spec = {"model": model, "threads": args.threads, "prompts": workload.prompts,
            "output_lens": workload.output_lens, "warm": warm, "b1_prompt": b1_prompt,
            "b1_tokens": args.b1_llama_tokens, "b1_repeats": args.b1_llama_repeats,
            "warmup_passes": args.warmup_passes}
    sides = {"current": THIS_SRC, "baseline": baseline_src}
    runs: dict[str, list[dict]] = {"current": [], "baseline": []}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.ab_rounds):
            order = ["current", "baseline"] if r % 2 == 0 else ["baseline", "current"]
            for name in order:
                loads.append({"round": r, "side": name, **load_snapshot()})
                print(f"A/B round {r + 1}/{args.ab_rounds}: {name} ({sides[name]}) ...", flush=True)
                res = _run_side(sides[name], spec, Path(tmp), f"{name}{r}")
                print(f"  {name}: offline {res['tok_per_s']:.1f} tok/s, batch-1 {res['b1_decode_tok_per_s']:.1f} "
                      f"tok/s, step {res['decode_step_ms_median']:.2f} ms", flush=True)
                runs[name].append(res)
    out = {"baseline_src": str(baseline_src), "rounds": args.ab_rounds, "load": loads, "sides": {}}
    for name, rs in runs.items():
        out["sides"][name] = {
            "src": rs[0]["src"],
            "offline_tok_per_s": [x["tok_per_s"] for x in rs],
            "offline_tok_per_s_median": statistics.median(x["tok_per_s"] for x in rs),
            "b1_decode_tok_per_s": [x["b1_decode_tok_per_s"] for x in rs],
            "b1_decode_tok_per_s_median": statistics.median(x["b1_decode_tok_per_s"] for x in rs),
            "decode_step_ms": [x["decode_step_ms_median"] for x in rs],
            "decode_step_ms_median": statistics.median(x["decode_step_ms_median"] for x in rs),
        }
    cur, base = out["sides"]["current"], out["sides"]["baseline"]
    out["offline_ratio"] = cur["offline_tok_per_s_median"] / base["offline_tok_per_s_median"]
    out["b1_ratio"] = cur["b1_decode_tok_per_s_median"] / base["b1_decode_tok_per_s_median"]
    out["outputs_equal"] = all(a["outputs"] == b["outputs"] and a["b1_output_ids"] == b["b1_output_ids"]
                               for a, b in zip(runs["current"], runs["baseline"]))
    return out


def ab_markdown(ab: dict) -> str:
    cur, base = ab["sides"]["current"], ab["sides"]["baseline"]
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    lines = [
        "", f"## A/B: this tree vs `{ab['baseline_src']}` ({ab['rounds']} alternating rounds)", "",
        "| | offline tok/s (median; rounds) | batch-1 decode tok/s (median; rounds) | decode step ms |",
        "|---|---|---|---|",
        f"| current | {cur['offline_tok_per_s_median']:.1f} ({fmt(cur['offline_tok_per_s'])}) | "
        f"{cur['b1_decode_tok_per_s_median']:.1f} ({fmt(cur['b1_decode_tok_per_s'])}) | "
        f"{cur['decode_step_ms_median']:.2f} |",
        f"| baseline | {base['offline_tok_per_s_median']:.1f} ({fmt(base['offline_tok_per_s'])}) | "
        f"{base['b1_decode_tok_per_s_median']:.1f} ({fmt(base['b1_decode_tok_per_s'])}) | "
        f"{base['decode_step_ms_median']:.2f} |",
        f"| **ratio** | **{ab['offline_ratio']:.3f}x** | **{ab['b1_ratio']:.3f}x** | |",
        "", f"Greedy outputs equal on both sides: {ab['outputs_equal']}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    _child(sys.argv[1:])
