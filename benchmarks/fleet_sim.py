"""Routing policies and SLO autoscaling on the Mooncake conversation trace, simulated.

16 simulated workers (kvmesh's real scheduler, KV cache manager and prefix cache on a
step-time profile; the real router plugins) replay a slice of the trace
(../shared/traces/mooncake_conversation.jsonl) under each routing policy: round robin,
least load, prefix affinity alone, the router's prefix + load weights (approximate
index), the exact index fed by KV events, and an oracle that reads every cache. Then a
diurnal reshaping of the same slice runs on the SLO autoscaler against fixed fleets.

Simulation, not timing: the numbers do not depend on the machine's load.

    python benchmarks/fleet_sim.py [--duration-s 1200] [--time-scale 2.5] [--out DIR]

Results: benchmarks/results/fleet_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvmesh.router.autoscale import SLO, ScalePolicy
from kvmesh.sim import report
from kvmesh.sim.experiments import autoscale, compare
from kvmesh.sim.fleet import FleetConfig
from kvmesh.sim.policies import POLICIES, describe
from kvmesh.sim.profile import load_profile
from kvmesh.sim.trace import diurnal, load_trace, warp

from _common import RESULTS_DIR, md_table, write_results

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--profile", default="h100-sxm-llama3-8b")
    ap.add_argument("--start-s", type=float, default=0.0)
    ap.add_argument("--duration-s", type=float, default=1200.0, help="trace seconds (the whole hour: 3600)")
    ap.add_argument("--time-scale", type=float, default=2.5, help="arrival-rate multiplier (load)")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--policy", action="append", choices=POLICIES)
    ap.add_argument("--no-autoscale", action="store_true")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args()

    t0 = time.perf_counter()
    trace = load_trace(args.trace, args.start_s, args.duration_s, args.time_scale)
    cfg = FleetConfig(num_workers=args.workers, profile=load_profile(args.profile))
    slo = SLO(args.ttft_slo, args.tpot_slo)
    policies = args.policy or POLICIES
    runs = compare(trace, cfg, policies, slo,
                   progress=lambda s: print(f"{s['policy']:>13}: hit {s['cache_hit_rate']:.3f} goodput "
                                            f"{s['goodput_rps']:.2f} req/s ({s['wall_s']:.1f}s)", flush=True))
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
    if not args.no_autoscale:
        wave = warp(trace, diurnal(trace[-1].arrival_s / 2, 0.4, 1.6))
        pol = "precise_load" if "precise_load" in policies else policies[-1]
        auto = autoscale(wave, cfg, pol, slo, ScalePolicy(min_replicas=2, max_replicas=2 * args.workers),
                         [args.workers // 2, args.workers])
        data["autoscale"] = auto
        md += "\n## SLO autoscaling on a diurnal reshaping of the slice (rate x0.4 .. x1.6)\n\n"
        md += "\n".join(md_table(["fleet", "SLO met", "worker-seconds", "goodput req/s", "TTFT p90 s"],
                                 [[r["policy"], f"{r['slo_attainment']:.1%}", f"{r['worker_seconds']:.0f}",
                                   f"{r['goodput_rps']:.2f}", f"{r['ttft_s']['p90']:.2f}"] for r in auto["rows"]],
                                 "lrrrr")) + "\n"
    data["wall_s"] = time.perf_counter() - t0
    for p in write_results("fleet_sim", data, md, report.plot, args.out):
        print(f"wrote {p}")
    print(f"total {data['wall_s']:.1f}s")


if __name__ == "__main__":
    main()
