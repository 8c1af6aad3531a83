"""Routing policies, load, router replicas and SLO autoscaling on the Mooncake conversation trace, simulated.

16 simulated workers (kvmesh's real scheduler, KV cache manager and prefix cache on a
step-time profile; the real router plugins) replay the trace (`--trace`; default
../shared/traces/mooncake_conversation.jsonl) under each routing policy: round robin,
least load, prefix affinity alone, the router's prefix + load weights (approximate
index), the exact index fed by KV events, and an oracle that reads every cache. Then:

- load sweep: a slice of the hour time-compressed to 1x .. 8x its arrival rate, goodput
  and SLO attainment per policy (where prefix-aware routing pays off: near saturation);
- router replicas: 1, 2, 4 routers, each with its own approximate index, requests spread
  round robin over them, against the exact index every replica reads from KV events;
- SLO autoscaling: a diurnal reshaping of the hour (rate x0.4 .. x1.6) on the autoscaler
  against fixed fleets, SLO met beside worker-seconds.

Simulation, not timing: the numbers do not depend on the machine's load.

    python benchmarks/fleet_sim.py [--duration-s 3600] [--sweep 1,2,3,4,5,6,7,8] [--routers 1,2,4] [--out DIR]

Results: benchmarks/results/fleet_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from tqdm import tqdm

from kvmesh.router.autoscale import SLO
from kvmesh.sim import report
from kvmesh.sim.experiments import TUNED_SCALE, ScaleTiming, autoscale, compare, load_sweep, multi_router, ratio_range
from kvmesh.sim.fleet import FleetConfig
from kvmesh.sim.policies import POLICIES, describe
from kvmesh.sim.profile import load_profile
from kvmesh.sim.trace import diurnal, load_trace, warp

from _common import FULL_TRACE, RESULTS_DIR, require_trace, write_results

SWEEP_POLICIES = ["round_robin", "prefix_load", "precise_load", "oracle_load"]
ROUTER_POLICIES = ["prefix_load", "precise_load"]
SLO_TARGET = 0.9  # the SLO is a p90: met when 90% of requests are within both targets


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _bar(total: int, desc: str):
    bar = tqdm(total=total, desc=desc, unit="run")

    def step(row: dict) -> None:
        bar.set_postfix_str(f"{row['policy']} goodput {row['goodput_rps']:.2f}")
        bar.update()
    return bar, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(FULL_TRACE),
                    help="Mooncake-format JSONL (default: the shared folder's full trace)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--profile", default="h100-sxm-llama3-8b")
    ap.add_argument("--start-s", type=float, default=0.0)
    ap.add_argument("--duration-s", type=float, default=3600.0, help="trace seconds (the whole hour: 3600)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="arrival-rate multiplier (load)")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--policy", action="append", choices=POLICIES)
    ap.add_argument("--sweep", default="1,2,3,4,5,6,7,8", help="arrival-rate multipliers of the load sweep ('' skips)")
    ap.add_argument("--sweep-duration-s", type=float, default=1200.0, help="trace seconds the sweep and routers use")
    ap.add_argument("--routers", default="1,2,4", help="router replica counts ('' skips)")
    ap.add_argument("--routers-load", default="1,4", help="arrival-rate multipliers of the router runs")
    ap.add_argument("--fixed", default="10,11,12,16", help="fixed fleet sizes beside the autoscaled one")
    ap.add_argument("--no-autoscale", action="store_true")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args()
    require_trace(args.trace)

    t0 = time.perf_counter()
    trace = load_trace(args.trace, args.start_s, args.duration_s, args.time_scale)
    cfg = FleetConfig(num_workers=args.workers, profile=load_profile(args.profile))
    slo = SLO(args.ttft_slo, args.tpot_slo)
    policies = args.policy or POLICIES
    bar, step = _bar(len(policies), "policies")
    with bar:
        runs = compare(trace, cfg, policies, slo, progress=step)
    data = {"trace": args.trace, "requests": len(trace), "slice_s": [args.start_s, args.duration_s],
            "time_scale": args.time_scale, "workers": args.workers, "profile": cfg.profile.model_dump(),
            "policies": {p: describe(p) for p in policies}, "runs": runs}
    md = report.markdown(runs, f"Fleet simulation: Mooncake conversation trace, {args.workers} workers",
                         [f"{len(trace)} requests: trace seconds {args.start_s:g}-"
                          f"{args.start_s + args.duration_s:g} at {args.time_scale}x the arrival rate",
                          f"profile {cfg.profile.name}: {cfg.profile.description}; KV "
                          f"{cfg.profile.kv_capacity_tokens} tokens per worker",
                          f"SLO: TTFT <= {slo.ttft_s}s and TPOT <= {slo.tpot_s}s; goodput = requests within "
                          "both per second of arrivals"])
    part = load_trace(args.trace, args.start_s, args.sweep_duration_s)
    part_note = f"trace seconds {args.start_s:g}-{args.start_s + args.sweep_duration_s:g} ({len(part)} requests)"
    if args.sweep:
        mults = _floats(args.sweep)
        bar, step = _bar(len(mults) * len(SWEEP_POLICIES), "load sweep")
        with bar:
            sweep = load_sweep(part, cfg, SWEEP_POLICIES, slo, mults, progress=step)
        sweep["slice"] = part_note
        sweep["at_least_2x"] = {p: ratio_range(sweep, p) for p in SWEEP_POLICIES[1:]}
        data["load_sweep"] = sweep
        md += (f"\n## Goodput vs load: {part_note}, time-compressed\n\n"
               "Goodput req/s per policy (x round robin at that load, SLO met). At or over 2x round robin: "
               + "; ".join(f"{p} at {', '.join(f'{m:g}x' for m in ms) or 'no load'}"
                           for p, ms in sweep["at_least_2x"].items()) + ".\n\n" + report.sweep_markdown(sweep))
    if args.routers:
        counts, loads = _ints(args.routers), _floats(args.routers_load)
        bar, step = _bar(len(counts) * len(loads) * len(ROUTER_POLICIES), "router replicas")
        rows = []
        with bar:
            for m in loads:
                scaled = load_trace(args.trace, args.start_s, args.sweep_duration_s, m)
                rows += [{"load": m, **r} for r in multi_router(scaled, cfg, ROUTER_POLICIES, slo, counts, step)]
        data["routers"] = {"slice": part_note, "spread": cfg.router_spread, "rows": rows}
        md += f"\n## Router replicas: {part_note}, requests spread round robin over the replicas\n"
        for m in loads:
            md += f"\n### {m:g}x the arrival rate\n\n" + report.routers_markdown([r for r in rows if r["load"] == m])
    if not args.no_autoscale:
        wave = warp(trace, diurnal(trace[-1].arrival_s / 2, 0.4, 1.6))
        pol = "precise_load" if "precise_load" in policies else policies[-1]
        print("autoscaling: the autoscaled fleet and fixed fleets of", args.fixed, flush=True)
        scale, timing = replace(TUNED_SCALE, min_replicas=min(TUNED_SCALE.min_replicas, args.workers),
                               max_replicas=2 * args.workers), ScaleTiming()
        auto = autoscale(wave, cfg, pol, slo, scale, _ints(args.fixed), timing)
        data["autoscale"] = auto
        md += ("\n## SLO autoscaling on a diurnal reshaping of the hour (rate x0.4 .. x1.6, one period per half)\n\n"
               f"Autoscaler (`sim.experiments.TUNED_SCALE`): {scale.min_replicas}..{scale.max_replicas} replicas, "
               f"aim p90 at {scale.slo_headroom:.0%} of the SLO, step down under {scale.scale_down_below:.0%} of it, "
               f"growth <= {scale.max_growth}x a decision every {timing.interval_s:g} s (p90 over the last "
               f"{6 * timing.interval_s:g} s), up / down delays {timing.upscale_delay_s:g} / "
               f"{timing.downscale_delay_s:g} s; a new replica serves {timing.startup_s:g} s after it is asked for "
               "(counted in its worker-seconds).\n\n" + report.autoscale_markdown(auto, SLO_TARGET))
    data["wall_s"] = time.perf_counter() - t0
    for p in write_results("fleet_sim", data, md, report.plot, args.out):
        print(f"wrote {p}")
    print(f"total {data['wall_s']:.1f}s")


if __name__ == "__main__":
    main()
