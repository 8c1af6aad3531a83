"""`kvmesh sim run` (trace-driven fleet simulation) and `kvmesh sim calibrate` (fit a
step-time profile to the local engine)."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from kvmesh.build import build_parts
from kvmesh.cli.args import add_engine_args, engine_config
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.router.autoscale import SLO
from kvmesh.sim import report
from kvmesh.sim.experiments import TUNED_SCALE, autoscale, compare
from kvmesh.sim.fleet import FleetConfig
from kvmesh.sim.policies import POLICIES, describe
from kvmesh.sim.profile import GPU_PROFILES, fit_profile, load_profile, step_features
from kvmesh.sim.trace import diurnal, load_trace, warp


def add_parser(sub) -> None:
    p = sub.add_parser("sim", help="trace-driven fleet simulation (routing, caching, autoscaling)")
    ssub = p.add_subparsers(dest="sim_command", required=True)
    r = ssub.add_parser("run", help="replay a Mooncake-format trace on simulated workers")
    r.add_argument("--trace", required=True, help="Mooncake-format JSONL (timestamp, input/output_length, hash_ids)")
    r.add_argument("--workers", type=int, default=16)
    r.add_argument("--profile", default="h100-sxm-llama3-8b",
                   help=f"step-time profile: a `kvmesh sim calibrate` JSON or one of {sorted(GPU_PROFILES)}")
    r.add_argument("--kv-capacity-tokens", type=int, default=None, help="KV cache per worker (default: the profile's)")
    r.add_argument("--policy", action="append", choices=POLICIES, help="repeatable; default: all")
    r.add_argument("--start-s", type=float, default=0.0, help="slice of the trace: start (trace seconds)")
    r.add_argument("--duration-s", type=float, default=None, help="slice of the trace: length (trace seconds)")
    r.add_argument("--time-scale", type=float, default=1.0, help="compress time: 2 = twice the arrival rate")
    r.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO, seconds (goodput counts requests within both)")
    r.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO, seconds")
    r.add_argument("--max-num-seqs", type=int, default=128)
    r.add_argument("--max-num-batched-tokens", type=int, default=8192)
    r.add_argument("--routers", type=int, default=1,
                   help="router replicas, each with its own approximate prefix index (the exact one is shared)")
    r.add_argument("--router-spread", choices=["round_robin", "random"], default="round_robin",
                   help="how requests are spread over the router replicas")
    r.add_argument("--autoscale", action="store_true",
                   help="also replay a diurnal reshaping of the trace with the SLO autoscaler vs fixed fleets")
    r.add_argument("--out", default=".", help="folder for NAME.json, NAME.md, NAME.png")
    r.add_argument("--name", default="fleet_sim")
    r.set_defaults(func=cmd_run)
    c = ssub.add_parser("calibrate", help="measure the local engine's step times and write a profile JSON")
    c.add_argument("--out", required=True, help="profile JSON to write (use it as `kvmesh sim run --profile`)")
    c.add_argument("--name", default="local")
    c.add_argument("--prompt-lengths", default="32,128,256", help="comma-separated prefill lengths to time")
    c.add_argument("--batch-sizes", default="1,4,8", help="comma-separated decode batch sizes to time")
    c.add_argument("--decode-steps", type=int, default=8, help="decode steps per batch")
    add_engine_args(c)
    c.set_defaults(func=cmd_calibrate)


def cmd_run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace, args.start_s, args.duration_s, args.time_scale)
    if not trace:
        raise ValueError(f"no requests in {args.trace} between {args.start_s}s and the slice's end")
    cfg = FleetConfig(num_workers=args.workers, profile=load_profile(args.profile),
                      kv_capacity_tokens=args.kv_capacity_tokens, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, num_routers=args.routers,
                      router_spread=args.router_spread)
    slo = SLO(args.ttft_slo, args.tpot_slo)
    policies = args.policy or POLICIES
    t0 = time.perf_counter()

    def show(s: dict) -> None:
        print(f"{s['policy']:>14}: hit {s['cache_hit_rate']:.3f}  TTFT p50 {s['ttft_s']['p50']:.2f}s "
              f"p90 {s['ttft_s']['p90']:.2f}s  goodput {s['goodput_rps']:.2f} req/s  ({s['wall_s']:.1f}s wall)",
              flush=True)

    runs = compare(trace, cfg, policies, slo, progress=show)
    data = {"trace": str(args.trace), "requests": len(trace), "time_scale": args.time_scale,
            "slice": [args.start_s, args.duration_s], "workers": args.workers, "num_routers": args.routers,
            "profile": cfg.profile.model_dump(),
            "kv_capacity_tokens": cfg.kv_capacity_tokens or cfg.profile.kv_capacity_tokens,
            "policies": {p: describe(p) for p in policies}, "runs": runs}
    if args.autoscale:
        span = trace[-1].arrival_s
        wave = warp(trace, diurnal(span / 2, 0.5, 2.0))
        scale = replace(TUNED_SCALE, min_replicas=min(TUNED_SCALE.min_replicas, args.workers),
                        max_replicas=2 * args.workers)
        data["autoscale"] = autoscale(wave, cfg, policies[-1], slo, scale, [args.workers // 2, args.workers])
    md = report.markdown(runs, f"Fleet simulation: {len(trace)} requests, {args.workers} workers, {cfg.profile.name}",
                         [f"time scale {args.time_scale}, KV capacity {data['kv_capacity_tokens']} tokens/worker",
                          f"SLO: TTFT <= {slo.ttft_s}s and TPOT <= {slo.tpot_s}s"])
    for path in report.write(args.name, data, md, args.out):
        print(f"wrote {path}")
    print(f"total {time.perf_counter() - t0:.1f}s")
    return 0


class _TimedExecutor:
    """An engine's executor that records (step features, seconds) of every model step:
    calibration fits the model step only, not the engine's bookkeeping."""

    def __init__(self, inner):
        self.inner = inner
        self.samples: list[tuple[float, float, float, float]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, sched):
        t = time.perf_counter()
        out = self.inner.execute(sched)
        self.samples.append((*step_features(sched), time.perf_counter() - t))
        return out


def cmd_calibrate(args: argparse.Namespace) -> int:
    parts = build_parts(engine_config(args))
    executor = _TimedExecutor(parts.executor)
    engine = LLMEngine(parts.config, executor, parts.tokenizer, parts.info)
    samples = executor.samples
    vocab = engine.model_info.vocab_size
    rid = 0
    for n in (int(x) for x in args.prompt_lengths.split(",")):
        for _ in range(3):  # distinct prompts: nothing cached
            rid += 1
            engine.add_request(f"c{rid}", [(rid * 7919 + i) % max(vocab - 10, 10) + 5 for i in range(n)],
                               SamplingParams(max_tokens=1, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for _ in range(b):
            rid += 1
            engine.add_request(f"c{rid}", [(rid * 31 + i) % max(vocab - 10, 10) + 5 for i in range(64)],
                               SamplingParams(max_tokens=args.decode_steps, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    capacity = engine.kv_manager.num_usable_blocks * engine.kv_manager.block_size
    prof = fit_profile(samples, args.name, capacity, f"kvmesh sim calibrate: {len(samples)} steps of the local engine")
    prof.save(args.out)
    print(prof.model_dump_json(indent=2))
    print(f"wrote {Path(args.out)}")
    return 0
