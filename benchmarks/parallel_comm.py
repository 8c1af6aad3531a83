"""Where a parallel step's time goes: TP=1 vs TP=2 vs PP=2 (and TP=2 x PP=2 with --configs).

One engine per configuration on the same checkpoint (default: the `qwen3-dense-small`
random model of benchmarks/random_model.py: hidden 512, 8 layers, 8 heads / 2 KV heads, so
both TP=2 and PP=2 split it evenly; the embedded SmolLM2's 9 heads do not shard over 2).
The machine's threads are split over the ranks (TP=1: all of them in one process; TP=2 /
PP=2: half each), as `kvmesh serve` does. For each configuration two kinds of steps are
timed one by one:

* **prefill**: one step that prefills `--prefill-seqs` prompts of `--prefill-len` tokens;
* **decode**: `--decode-steps` steps of `--decode-batch` sequences, one token each.

Rank 0's communication meter (layers/op.py `COMM`) is reset before each step and read after
it: all-reduce calls, bytes and time (the row-parallel output / down projections and the
vocab-parallel embedding), the all-gather of vocab-parallel logits, and for pipeline stages
the hidden states sent and the time stage 0 waited on the others (transfer plus their
compute: the bubble). Medians over the steps of `--repeats` rounds; the configurations
alternate round by round. The point is the split of the step into compute and
communication, and the bytes per all-reduce against the step (`--no-shm`: TP sums over
gloo instead of the ranks' shared memory).

A second table times decode steps unmetered (the meter sends TP steps through the layer
loop, whose all-reduces it can time) on a Llama-layered model (default: the `llama-small`
random model, qwen3-dense-small without q/k norm), the one the CPU decode stack runs
(layers/decode_stack.py): TP=1, TP=2 with the stack (its all-reduces from C++) and TP=2
with `decode_stack=False` (the layer loop), at batch 1, 4 and --decode-batch.

    python benchmarks/parallel_comm.py [--configs tp1,tp2,pp2] [--repeats 3]
    python benchmarks/parallel_comm.py --quick --model PATH --out-dir DIR   # a smoke run

JSON + markdown + PNG into benchmarks/results/parallel_comm.* (--quick: parallel_comm_quick.*);
the CPU model and the load average (start and end) are stored beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from _common import RESULTS_DIR, check_idle, cpu_flags, cpu_model, load_snapshot, md_table, median, write_results

CONFIGS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
KINDS = ("all_reduce", "all_gather", "pp_send", "pp_wait")


# The decode-stack table: name -> (tp, engine options).
STACK_CONFIGS = {"tp1": (1, {}), "tp2-stack": (2, {}), "tp2-loop": (2, {"decode_stack": False})}


def build_llm(model: str, tp: int, pp: int, threads: int, max_model_len: int, num_blocks: int, **kw):
    from kvmesh.llm import LLM

    return LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=threads,
               max_model_len=max_model_len, num_blocks=num_blocks, block_size=16, progress=False,
               enable_prefix_caching=False, **kw)


def timed_step(engine) -> tuple[float, dict]:
    from kvmesh.layers.op import COMM

    COMM.reset()
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0, COMM.snapshot()


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(30000, vocab), (length,), generator=g).tolist() for _ in range(n)]


def one_round(llm, args, round_no: int) -> dict[str, list[tuple[float, dict]]]:
    """Step samples of one round: {"prefill": [(seconds, comm)], "decode": [...]}."""
    from kvmesh.engine.sampling_params import SamplingParams

    engine, vocab = llm.engine, len(llm.tokenizer)
    out: dict[str, list] = {"prefill": [], "decode": []}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts(args.prefill_seqs, args.prefill_len, 1000 + round_no, vocab)):
        engine.add_request(f"p{round_no}-{i}", ids, one)
    out["prefill"].append(timed_step(engine))
    while engine.has_unfinished():
        engine.step()
    many = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts(args.decode_batch, 32, 2000 + round_no, vocab)):
        engine.add_request(f"d{round_no}-{i}", ids, many)
    engine.step()  # their prefill, untimed
    while engine.has_unfinished():
        out["decode"].append(timed_step(engine))
    return out


def decode_steps(llm, batch: int, steps: int, seed: int) -> list[float]:
    """Seconds of each of `steps` unmetered decode steps of `batch` sequences."""
    from kvmesh.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts(batch, 32, seed, len(llm.tokenizer))):
        engine.add_request(f"s{seed}-{batch}-{i}", ids, params)
    engine.step()  # their prefill, untimed
    out = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t0)
    return out


def stack_table(model: str, args, max_len: int, blocks: int) -> list[dict]:
    """Median unmetered decode step per STACK_CONFIGS entry and batch (configurations alternating)."""
    llms = {}
    for name, (tp, kw) in tqdm(STACK_CONFIGS.items(), desc="building decode-stack engines", unit="engine"):
        llms[name] = build_llm(model, tp, 1, max(1, args.threads // tp), max_len, blocks, shm_all_reduce=args.shm, **kw)
    batches = sorted({1, 4, args.decode_batch})
    samples: dict[tuple[str, int], list[float]] = {}
    names = list(llms)
    try:
        for name in names:  # warm-up
            for b in batches:
                decode_steps(llms[name], b, 2, -1)
        with tqdm(total=args.repeats * len(names), desc="decode-stack rounds", unit="config") as bar:
            for rnd in range(args.repeats):
                for name in (names if rnd % 2 == 0 else names[::-1]):
                    for b in batches:
                        samples.setdefault((name, b), []).extend(decode_steps(llms[name], b, args.decode_steps, rnd))
                    bar.update()
    finally:
        for llm in llms.values():
            llm.close()
    return [{"config": name, "batch": b, "steps": len(samples[(name, b)]),
             "step_ms": median(samples[(name, b)]) * 1e3} for name in names for b in batches]


def summarize(samples: list[tuple[float, dict]]) -> dict:
    """Medians per step: step ms, and per kind calls / bytes / ms."""
    row = {"steps": len(samples), "step_ms": median(s for s, _ in samples) * 1e3}
    for kind in KINDS:
        calls = [c.get(kind, {}).get("calls", 0) for _, c in samples]
        if not any(calls):
            continue
        nbytes = [c.get(kind, {}).get("bytes", 0) for _, c in samples]
        secs = [c.get(kind, {}).get("seconds", 0.0) for _, c in samples]
        row[kind] = {"calls": median(calls), "bytes": median(nbytes), "ms": median(secs) * 1e3,
                     "bytes_per_call": median(b / c for b, c in zip(nbytes, calls) if c)}
    comm = [sum(c.get(k, {}).get("seconds", 0.0) for k in KINDS) for _, c in samples]
    row["comm_ms"] = median(comm) * 1e3
    row["comm_share"] = median(x / s for x, (s, _) in zip(comm, samples) if s > 0)
    return row


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} MiB"


def render(data: dict) -> str:
    lines = [f"# Parallel step: compute vs communication ({data['model_name']})", "",
             f"{data['cpu']}, {data['threads']} threads in all (split over the ranks), torch {data['torch']}, "
             f"{data.get('comm', 'gloo')}. Load average at start {data['load_start']['1min']:.2f}, at end {data['load_end']['1min']:.2f}. "
             f"Prefill step: {data['prefill_seqs']} x {data['prefill_len']} tokens; decode step: "
             f"{data['decode_batch']} sequences. Medians over {data['repeats']} rounds (configurations alternating); "
             "rank 0's view (for PP: stage 0, whose wait includes the other stage's compute).", ""]
    rows = []
    base = {r["phase"]: r["step_ms"] for r in data["rows"] if r["config"] == "tp1"}
    for r in data["rows"]:
        ar, ag = r.get("all_reduce", {}), r.get("all_gather", {})
        ps, pw = r.get("pp_send", {}), r.get("pp_wait", {})
        rows.append([r["config"], r["phase"], f"{r['step_ms']:.2f}",
                     f"{r['step_ms'] / base[r['phase']]:.2f}x" if r["phase"] in base else "",
                     f"{r['comm_ms']:.2f} ({100 * r['comm_share']:.0f}%)",
                     f"{ar.get('calls', 0):.0f}", fmt_bytes(ar["bytes_per_call"]) if ar else "",
                     f"{ar.get('ms', 0):.2f}", f"{ag.get('ms', 0):.2f}",
                     fmt_bytes(ps["bytes"]) if ps else "", f"{pw.get('ms', 0):.2f}"])
    lines += md_table(["config", "step", "step ms", "vs TP=1", "comm ms (share)", "all-reduces", "bytes / all-reduce",
                       "all-reduce ms", "all-gather ms", "PP bytes sent", "PP wait ms"], rows, "llrrrrrrrrr")
    lines += ["", "All-reduce count per step = 2 per layer (attention output, MLP down) + 1 (vocab-parallel "
              "embedding); bytes per all-reduce = tokens x hidden x 4 (fp32).", ""]
    if data.get("stack_rows"):
        ms = {(r["config"], r["batch"]): r["step_ms"] for r in data["stack_rows"]}
        batches = sorted({r["batch"] for r in data["stack_rows"]})
        rows = [[f"{b}", *(f"{ms[(c, b)]:.2f}" for c in STACK_CONFIGS),
                 f"{ms[('tp2-loop', b)] / ms[('tp2-stack', b)]:.2f}x"] for b in batches]
        lines += [f"## Decode steps, unmetered: the CPU decode stack at TP=2 ({Path(data['stack_model']).name})", "",
                  "Median decode step, ms; the stack runs each rank's layers (and its 2 all-reduces per layer) "
                  "as one C++ call, the loop one Python call per op.", ""]
        lines += md_table(["batch", "TP=1 ms", "TP=2 stack ms", "TP=2 loop ms", "loop / stack"], rows, "rrrrr")
        lines.append("")
    return "\n".join(lines)


def plot(plt, data: dict):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("prefill", "decode")):
        rows = [r for r in data["rows"] if r["phase"] == phase]
        names = [r["config"] for r in rows]
        comm = [r["comm_ms"] for r in rows]
        compute = [max(0.0, r["step_ms"] - r["comm_ms"]) for r in rows]
        ax.bar(names, compute, label="compute (step - comm)")
        ax.bar(names, comm, bottom=compute, label="communication / wait")
        ax.set_title(f"{phase} step, rank 0")
        ax.set_ylabel("ms per step (median)")
        ax.legend()
    fig.suptitle(f"{data['model_name']}: TP / PP step split on {data['cpu']}", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the qwen3-dense-small random model)")
    p.add_argument("--configs", default="tp1,tp2,pp2", help=f"comma list of {sorted(CONFIGS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-seqs", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--stack-model", default=None,
                   help="Llama-layered checkpoint of the decode-stack table (default: the llama-small random model; "
                        "with --quick: --model)")
    p.add_argument("--no-stack-table", action="store_true", help="skip the decode-stack table")
    p.add_argument("--no-shm", dest="shm", action="store_false",
                   help="TP ranks sum over gloo (shm_all_reduce=False), not shared memory")
    p.add_argument("--quick", action="store_true", help="small steps, 1 round: a smoke run (results: *_quick)")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.prefill_seqs, args.prefill_len, args.decode_batch, args.decode_steps = 1, 2, 32, 4, 4
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    if args.model is None:
        from random_model import build

        args.model = str(build("qwen3-dense-small"))
    load_start = load_snapshot()
    check_idle(args.threads, load_start["1min"])
    print(f"cpu: {cpu_model()}  load: {load_start['1min']:.2f}  model: {args.model}", file=sys.stderr)

    max_len = max(args.prefill_len, 32 + args.decode_steps + 2) + 16
    blocks = (args.prefill_seqs + args.decode_batch) * (max_len // 16 + 2) + 8
    llms = {}
    for c in tqdm(configs, desc="building engines", unit="engine"):
        tp, pp = CONFIGS[c]
        llms[c] = build_llm(args.model, tp, pp, max(1, args.threads // (tp * pp)), max_len, blocks,
                            shm_all_reduce=args.shm)
    from kvmesh.layers.op import COMM

    COMM.enabled = True
    samples: dict[tuple[str, str], list] = {}
    try:
        for c in configs:  # warm-up round, untimed
            one_round(llms[c], args, -1)
        with tqdm(total=args.repeats * len(configs), desc="rounds", unit="config") as bar:
            for rnd in range(args.repeats):
                for c in (configs if rnd % 2 == 0 else configs[::-1]):
                    for phase, got in one_round(llms[c], args, rnd).items():
                        samples.setdefault((c, phase), []).extend(got)
                    bar.update()
    finally:
        COMM.enabled = False
        for llm in llms.values():
            llm.close()
    stack_model, stack_rows = None, []
    if not args.no_stack_table:
        stack_model = args.stack_model or (args.model if args.quick else None)
        if stack_model is None:
            from random_model import build

            stack_model = str(build("llama-small"))
        stack_rows = stack_table(stack_model, args, max_len, blocks)
    load_end = load_snapshot()
    rows = [{"config": c, "phase": ph, **summarize(samples[(c, ph)])} for c in configs for ph in ("prefill", "decode")]
    data = {"benchmark": "parallel_comm", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": args.threads,
            "model": args.model, "model_name": Path(args.model).name, "repeats": args.repeats,
            "prefill_seqs": args.prefill_seqs, "prefill_len": args.prefill_len, "decode_batch": args.decode_batch,
            "decode_steps": args.decode_steps, "load_start": load_start, "load_end": load_end, "rows": rows,
            "stack_model": stack_model, "stack_rows": stack_rows,
            "comm": "TP sums and logit gathers over shared memory, the rest gloo" if args.shm else "gloo"}
    md = render(data)
    print(md)
    for path in write_results("parallel_comm_quick" if args.quick else "parallel_comm", data, md, plot, args.out_dir):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
