"""Real multi-worker check on the Mooncake conversation trace: prefix-aware routing vs
round robin on `kvmesh worker` processes behind a `kvmesh router`, and beside each the
fleet simulator's prediction for the same setup.

* **Workload**: a session sample of the Mooncake trace (`--trace`; default
  ../shared/traces/mooncake_conversation.jsonl): every request whose second prefix block
  id falls in 1 of `--session-every` buckets (whole conversations are kept, so their turns
  still share prefixes), cut to `--num-requests`,
  its arrival times compressed by the factor at which the fleet is `--utilization` busy
  (the simulated round-robin fleet's step seconds per worker-second, from this machine's
  calibrated step times: a faster CPU is offered more requests per second, not a lighter
  load; `--time-scale` fixes the factor instead). Each trace block id (512
  tokens in the trace) becomes one kvmesh block of `--block-size` pseudo-random token ids
  (kvmesh.sim.trace.block_tokens), so equal id chains are equal token prefixes and the
  workers' prefix caches see exactly the trace's sharing; prompt and output lengths are
  scaled by block_size / 512 (outputs capped at `--max-output-tokens`).
* **Real**: `--workers` unified workers with `--num-blocks` KV blocks each (too few to
  hold the sample's working set: placement decides what stays cached) behind a router
  serving the OpenAI API; the trace replays through /v1/completions at its arrival
  times (benchmarks/_loadgen.py). Fresh workers per policy: no policy inherits caches.
* **Simulated**: kvmesh.sim on the same scaled trace, fleet size, KV capacity and
  routing config, with a step-time profile from `kvmesh sim calibrate` (`--profile`, or
  a calibration of the same model and thread count run here first).

    python benchmarks/fleet_real.py                # embedded SmolLM2-135M, <= 5 minutes idle
    python benchmarks/fleet_real.py --smoke --out /tmp/fleet_real   # tiny random model, 20 requests

Results: benchmarks/results/fleet_real.{json,md,png} (fleet_real_smoke.* with --smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmesh.checkpoint.files import resolve_model_path
from kvmesh.models.loader import load_arch_config
from kvmesh.router.autoscale import SLO
from kvmesh.rpc import free_port
from kvmesh.serve.local import spawn, stop, wait_ready
from kvmesh.sim.experiments import compare
from kvmesh.sim.fleet import FleetConfig
from kvmesh.sim.profile import load_profile
from kvmesh.sim.trace import TRACE_BLOCK_SIZE, TraceRequest, block_tokens, load_trace

from _common import FULL_TRACE, check_idle, loadavg, md_table, require_trace, wait_for_idle, write_results
from _loadgen import Request, run_load, summarize

ROOT = Path(__file__).resolve().parents[1]
# real router picker -> the simulator policy with the same RouterConfig
POLICIES = {"prefix-aware": ("max_score", "prefix_load"), "round-robin": ("round_robin", "round_robin")}


@dataclass
class ScaledFleet(FleetConfig):
    """A simulated fleet whose blocks are the real workers' (`tokens_per_block` tokens per
    trace block id) instead of the trace's 512."""

    tokens_per_block: int = 16

    @property
    def block_size(self) -> int:
        return self.tokens_per_block


@dataclass(frozen=True)
class Item:
    sim: TraceRequest  # scaled lengths, arrival re-based: what the simulator replays
    prompt_ids: list[int]


def workload(args, vocab: int) -> list[Item]:
    """The scaled, session-sampled trace slice (see the module docstring), at the trace's
    own rate (`retime` compresses it)."""
    raw = load_trace(args.trace, args.start_s, args.duration_s)
    scale = args.block_size / TRACE_BLOCK_SIZE
    items: list[Item] = []
    for r in raw:
        key = r.hash_ids[min(1, len(r.hash_ids) - 1)]
        if (key * 2654435761) % args.session_every:
            continue
        n_in = math.ceil(r.input_length * scale)
        n_out = min(args.max_output_tokens, max(1, math.ceil(r.output_length * scale)))
        if n_in > args.max_prompt_tokens:
            continue
        ids = r.hash_ids[: math.ceil(n_in / args.block_size)]
        prompt = [t for h in ids for t in block_tokens(h, args.block_size, vocab)][:n_in]
        items.append(Item(TraceRequest(r.arrival_s, n_in, n_out, ids), prompt))
        if len(items) >= args.num_requests:
            break
    if not items:
        raise SystemExit(f"no requests in the slice of {args.trace}; widen --duration-s or lower --session-every")
    t0 = items[0].sim.arrival_s
    return [Item(TraceRequest(i.sim.arrival_s - t0, i.sim.input_length, i.sim.output_length, i.sim.hash_ids),
                 i.prompt_ids) for i in items]


def retime(items: list[Item], time_scale: float) -> list[Item]:
    """The same requests, arriving `time_scale` times faster."""
    return [Item(TraceRequest(i.sim.arrival_s / time_scale, i.sim.input_length, i.sim.output_length, i.sim.hash_ids),
                 i.prompt_ids) for i in items]


def fit_time_scale(args, profile_path: str, items: list[Item], rounds: int = 6) -> tuple[float, float]:
    """(time scale, simulated utilization): the scale at which the simulated round-robin
    fleet's workers spend `--utilization` of the arrival span in steps (their busy seconds
    over workers x span). The work barely changes with the scale and the span shrinks with
    it, so utilization ~ scale; a few fixed-point rounds settle the batching effects."""
    scale, util = 36.0, 0.0  # a starting guess (2 one-thread workers of a 135M model)
    for _ in range(rounds):
        s = run_sim(args, profile_path, retime(items, scale), "round_robin")
        busy_s = sum(w["busy_fraction"] for w in s["workers"]) * s["makespan_s"]
        util = busy_s / (len(s["workers"]) * max(s["duration_s"], 1e-3))
        if abs(util - args.utilization) <= 0.01 * args.utilization:
            break
        scale *= args.utilization / max(util, 1e-3)
    return scale, util


def tiny_model() -> Path:
    """The tests' tiny random Llama (tests/tiny_models.py), long enough for the scaled prompts."""
    spec = importlib.util.spec_from_file_location("kvmesh_tiny_models", ROOT / "tests" / "tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_model(Path(tempfile.mkdtemp(prefix="kvmesh-fleet-tiny-")), max_position_embeddings=4096)


def engine_flags(args, model: str | None) -> list[str]:
    return [*(["--model", model] if model else []), "--threads", str(args.threads), "--block-size",
            str(args.block_size), "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", str(args.max_prompt_tokens + args.max_output_tokens)]


def calibrate(args, model: str | None, out: Path) -> Path:
    """`kvmesh sim calibrate` of the workers' engine (same model, threads, block size), one
    calibration per worker run at once: the workers share this machine's cores, memory
    bandwidth and cache, so a step of one runs slower beside the others than alone. The
    profile is their mean."""
    lengths = ",".join(str(n) for n in (16, 64, 256, min(512, args.max_prompt_tokens)))
    n = args.workers if args.calibrate_together else 1
    outs = [out.with_name(f"{out.stem}-{i}.json") for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "sim", "calibrate", "--out", str(o), "--name",
                               "fleet_real-local", "--prompt-lengths", lengths, "--batch-sizes", "1,4,8",
                               "--decode-steps", "8", *engine_flags(args, model)], stdout=subprocess.DEVNULL)
             for o in outs]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("kvmesh sim calibrate failed")
    profiles = [json.loads(o.read_text()) for o in outs]
    merged = dict(profiles[0])
    for key, value in merged.items():
        if isinstance(value, float):
            merged[key] = sum(p[key] for p in profiles) / n
    if n > 1:
        merged["description"] += f", {n} engines calibrated at once (the mean)"
    out.write_text(json.dumps(merged, indent=2))
    return out


async def _wait_http(base: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as c:
        while True:
            try:
                if (await c.get(f"{base}/models")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"router HTTP {base} not ready within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


def run_real(args, model: str | None, items: list[Item], picker: str) -> dict:
    """Fresh workers and router; replay the items at their arrival times; the loadgen summary."""
    workers, router = [], None
    try:
        workers = [spawn(f"worker{i}", ["-m", "kvmesh.cli", "worker", "--role", "unified", "--port", "0",
                                        *engine_flags(args, model)]) for i in range(args.workers)]
        for w in workers:
            wait_ready(w, 600)
        port = free_port()
        router = wait_ready(spawn(f"router-{picker}", [
            "-m", "kvmesh.cli", "router", "--port", "0", "--http-port", str(port), "--picker", picker,
            *(["--model", model] if model else []), *[a for w in workers for a in ("--worker", w.address)]],
            is_worker=False), 600)
        base = f"http://127.0.0.1:{port}/v1"
        asyncio.run(_wait_http(base))
        reqs = [Request(i.prompt_ids, i.sim.output_length) for i in items]
        results, wall = asyncio.run(run_load(base, "kvmesh", reqs, math.inf, arrivals_s=[i.sim.arrival_s for i in items],
                                             timeout_s=args.timeout_s))
        out = summarize(results, wall, args.ttft_slo, args.tpot_slo)
        return out
    finally:
        if router is not None:
            stop(router)
        for w in workers:
            stop(w)


def run_sim(args, profile_path: str, items: list[Item], policy: str) -> dict:
    cfg = ScaledFleet(num_workers=args.workers, profile=load_profile(profile_path),
                      kv_capacity_tokens=(args.num_blocks - 1) * args.block_size, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, tokens_per_block=args.block_size,
                      reported_hashes=4096, affinity_capacity=65536)
    (s,) = compare([i.sim for i in items], cfg, [policy], SLO(args.ttft_slo, args.tpot_slo))
    return s


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# Real fleet vs simulator: Mooncake conversation slice ({report['date']})", "",
             f"- {report['requests']} requests, {c['workers']} workers x {c['num_blocks']} KV blocks of "
             f"{c['block_size']} tokens, model {c['model']}, {c['threads']} thread(s) per worker",
             f"- step profile: {report['profile']['name']} ({report['profile']['description']})",
             f"- arrivals {c['time_scale']:.1f}x the trace's rate over {report['workload']['span_s']:.0f} s"
             + (f": the scale at which the simulated round-robin fleet is {c['utilization']:.0%} busy"
                if report["workload"].get("sim_rr_utilization") is not None else " (fixed by --time-scale)"),
             f"- load at start {report['loadavg_start']}, end {report['loadavg_end']}", ""]
    rows = []
    for name, r in report["policies"].items():
        real, sim = r["real"], r["sim"]
        err = sim["ttft_s"]["p50"] / real["ttft_p50_s"] - 1 if real["ttft_p50_s"] else float("nan")
        rows.append([name, f"{real['requests'] - real['failed']}/{real['requests']}", f"{real['ttft_p50_s']:.3f}",
                     f"{sim['ttft_s']['p50']:.3f}", f"{err:+.0%}", f"{real['ttft_p99_s']:.3f}",
                     f"{real['tpot_p50_s'] * 1e3:.1f}", f"{sim['tpot_s']['p50'] * 1e3:.1f}",
                     f"{sim['cache_hit_rate']:.1%}", f"{real['slo_attainment']:.1%}", f"{sim['slo_attainment']:.1%}"])
    lines += md_table(["policy", "done", "TTFT p50 s real", "sim", "sim err", "TTFT p99 s real", "TPOT p50 ms real",
                       "sim", "sim hit rate", "SLO met real", "sim"], rows, "lrrrrrrrrrr")
    lines += ["", "Real TTFT p50 of each run (s): " + "; ".join(
        f"{n} {', '.join(f'{x:.3f}' for x in r['real_ttft_p50_runs_s'])}" for n, r in report["policies"].items())
        + f" (the median run is in the table; {report['config']['repeats']} runs per policy, alternating); "
        + "failed requests over all runs: " + ", ".join(f"{n} {r['real_failed']}" for n, r in report["policies"].items())]
    v = report["verdicts"]
    lines += ["", f"- median TTFT round robin / prefix-aware: real {v['ttft_ratio_real']:.2f}x, simulated "
              f"{v['ttft_ratio_sim']:.2f}x (target >= 1.5x real: {'met' if v['ttft_ratio_real'] >= 1.5 else 'MISSED'})",
              f"- simulator median TTFT within 25% of the real run: "
              f"{'yes' if v['sim_within_25pct'] else 'NO'} (errors {v['sim_ttft_errors']})"]
    if not report["idle_at_start"]:
        lines.append("- WARNING: the machine was busy at the start; do not quote these numbers")
    return "\n".join(lines) + "\n"


def plot(plt, report: dict):
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(report["policies"])
    for k, (label, get) in enumerate((("real p50", lambda r: r["real"]["ttft_p50_s"]),
                                      ("sim p50", lambda r: r["sim"]["ttft_s"]["p50"]),
                                      ("real p99", lambda r: r["real"]["ttft_p99_s"]),
                                      ("sim p99", lambda r: r["sim"]["ttft_s"]["p99"]))):
        ax.bar([j + k * 0.2 for j in range(len(names))], [get(report["policies"][n]) for n in names], 0.2, label=label)
    ax.set_xticks([j + 0.3 for j in range(len(names))], names)
    ax.set_ylabel("TTFT, s")
    ax.set_title("TTFT on the trace slice: real workers vs the simulator")
    ax.legend()
    fig.tight_layout()
    return fig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(FULL_TRACE),
                   help="Mooncake-format JSONL (default: the shared folder's full trace)")
    p.add_argument("--model", default=None, help="checkpoint folder (default: embedded; --smoke: tiny random)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 20 requests: checks the pipeline only")
    p.add_argument("--profile", default=None, help="`kvmesh sim calibrate` JSON (default: calibrate here first)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--calibrate-together", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate one engine per worker at once, as they will share the machine")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block = per trace block id")
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks per worker (small: caches must evict)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget per step")
    p.add_argument("--start-s", type=float, default=0.0, help="trace slice start, trace seconds")
    p.add_argument("--duration-s", type=float, default=3600.0, help="trace slice length, trace seconds")
    p.add_argument("--session-every", type=int, default=100, help="keep 1 conversation in this many")
    p.add_argument("--time-scale", type=float, default=None,
                   help="arrival-rate multiplier (default: the one that loads the fleet to --utilization)")
    p.add_argument("--utilization", type=float, default=0.8,
                   help="offered load: the simulated round-robin fleet's step seconds per worker-second of the "
                   "arrival span; sets the time scale from this machine's calibrated step times, so a faster CPU "
                   "is offered more requests per second, not a lighter load")
    p.add_argument("--num-requests", type=int, default=110)
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer (scaled) prompts are left out")
    p.add_argument("--max-output-tokens", type=int, default=24)
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--repeats", type=int, default=3,
                   help="real runs per policy (alternating policies); the run with the median TTFT p50 is reported")
    p.add_argument("--wait-idle", type=float, default=0, help="wait up to this many seconds for idle cores first")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests = min(args.num_requests, 20)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    require_trace(args.trace)
    if args.wait_idle:
        print(f"waited {wait_for_idle(args.wait_idle):.0f} s for idle cores", flush=True)
    load_start = loadavg()
    idle = check_idle(args.threads * args.workers, load_start[0])
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model = args.model or (str(tiny_model()) if args.smoke else None)
    vocab = load_arch_config(resolve_model_path(model, progress=False)).vocab_size
    trace_items = workload(args, vocab)
    t0 = time.perf_counter()
    profile_path = args.profile or str(calibrate(args, model, Path(tempfile.mkdtemp()) / "profile.json"))
    sim_util = None
    if args.time_scale is None:
        args.time_scale, sim_util = fit_time_scale(args, profile_path, trace_items)
    items = retime(trace_items, args.time_scale)
    report: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "loadavg_start": load_start,
                    "idle_at_start": idle, "requests": len(items),
                    "config": {**vars(args), "model": model or "embedded SmolLM2-135M"},
                    "profile": json.loads(Path(profile_path).read_text()),
                    "workload": {"prompt_tokens_mean": sum(i.sim.input_length for i in items) / len(items),
                                 "output_tokens_mean": sum(i.sim.output_length for i in items) / len(items),
                                 "span_s": items[-1].sim.arrival_s, "time_scale": args.time_scale,
                                 "sim_rr_utilization": sim_util},
                    "policies": {}}
    print(f"{len(items)} requests over {items[-1].sim.arrival_s:.0f} s (time scale {args.time_scale:.1f}"
          + (f", simulated round-robin utilization {sim_util:.2f}" if sim_util is not None else "")
          + f"); profile {profile_path}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
    for rep in range(args.repeats):
        order = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))  # neither always runs first
        for name in order:
            real = run_real(args, model, items, POLICIES[name][0])
            runs[name].append(real)
            print(f"{name:>13} run {rep + 1}/{args.repeats}: real TTFT p50 {real['ttft_p50_s']:.3f}s "
                  f"({real['failed']} failed)", flush=True)
    for name, (_, sim_policy) in POLICIES.items():
        sim = run_sim(args, profile_path, items, sim_policy)
        sim.pop("workers", None)
        ordered = sorted(runs[name], key=lambda r: r["ttft_p50_s"])
        report["policies"][name] = {"real": ordered[(len(ordered) - 1) // 2], "sim": sim,
                                    "real_ttft_p50_runs_s": [r["ttft_p50_s"] for r in runs[name]],
                                    "real_failed": sum(r["failed"] for r in runs[name])}
        print(f"{name:>13}: real TTFT p50 (median run) {report['policies'][name]['real']['ttft_p50_s']:.3f}s, "
              f"sim {sim['ttft_s']['p50']:.3f}s, sim hit {sim['cache_hit_rate']:.1%}", flush=True)
    report["loadavg_end"] = loadavg()
    report["wall_s"] = time.perf_counter() - t0
    pa, rr = report["policies"]["prefix-aware"], report["policies"]["round-robin"]
    errs = {n: r["sim"]["ttft_s"]["p50"] / r["real"]["ttft_p50_s"] - 1 if r["real"]["ttft_p50_s"] else float("nan")
            for n, r in report["policies"].items()}
    report["verdicts"] = {
        "ttft_ratio_real": rr["real"]["ttft_p50_s"] / pa["real"]["ttft_p50_s"],
        "ttft_ratio_sim": rr["sim"]["ttft_s"]["p50"] / pa["sim"]["ttft_s"]["p50"],
        "sim_ttft_errors": {n: round(e, 3) for n, e in errs.items()},
        "sim_within_25pct": all(abs(e) <= 0.25 for e in errs.values()),
    }
    md = markdown(report)
    for path in write_results("fleet_real_smoke" if args.smoke else "fleet_real", report, md, plot, args.out):
        print(f"wrote {path}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
