"""The experiments `kvmesh sim run` and benchmarks/fleet_sim.py run: routing policies side
by side on one trace, the same policies over a load sweep and over several router
replicas, and an autoscaled replay against fixed fleets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from kvmesh.router.autoscale import SLO, Autoscaler, ScalePolicy
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.policies import build_replicas
from kvmesh.sim.trace import TraceRequest, compress

BASELINE = "round_robin"
_SLIM = ("policy", "requests", "slo_attainment", "goodput_rps", "cache_hit_rate", "ttft_s", "tpot_s",
         "preemptions", "worker_seconds", "wall_s")


def slim(summary: dict) -> dict:
    """A summary without per-worker detail (for tables of many runs)."""
    return {k: summary[k] for k in _SLIM}


def compare(trace: list[TraceRequest], cfg: FleetConfig, policies: list[str], slo: SLO,
            progress: Callable[[dict], None] | None = None) -> list[dict]:
    """One summary per policy, same trace and fleet."""
    out = []
    for name in policies:
        s = simulate(trace, cfg, build_replicas(name, cfg.num_routers), name).summary(slo)
        out.append(s)
        if progress is not None:
            progress(s)
    return out


def load_sweep(trace: list[TraceRequest], cfg: FleetConfig, policies: list[str], slo: SLO,
               multipliers: Sequence[float], progress: Callable[[dict], None] | None = None) -> dict:
    """Every policy at every arrival-rate multiplier of `trace` (the same requests, time
    compressed), with each policy's goodput relative to round robin's at that load and
    its peak goodput over the sweep (the most it serves within the SLO at any load)."""
    rows = []
    for m in multipliers:
        scaled = compress(trace, m)
        for s in compare(scaled, cfg, policies, slo):
            rows.append({"multiplier": m, **slim(s)})
            if progress is not None:
                progress(rows[-1])
    base = {r["multiplier"]: r["goodput_rps"] for r in rows if r["policy"] == BASELINE}
    for r in rows:
        b = base.get(r["multiplier"])
        r["vs_round_robin"] = r["goodput_rps"] / b if b else None
    peak = {p: max((r for r in rows if r["policy"] == p), key=lambda r: r["goodput_rps"]) for p in policies}
    return {"multipliers": list(multipliers), "rows": rows,
            "peak": {p: {"multiplier": r["multiplier"], "goodput_rps": r["goodput_rps"]} for p, r in peak.items()}}


def ratio_range(sweep: dict, policy: str, at_least: float = 2.0) -> list[float]:
    """The multipliers at which `policy`'s goodput is >= `at_least` x round robin's."""
    return [r["multiplier"] for r in sweep["rows"]
            if r["policy"] == policy and r["vs_round_robin"] is not None and r["vs_round_robin"] >= at_least]


def multi_router(trace: list[TraceRequest], cfg: FleetConfig, policies: list[str], slo: SLO,
                 routers: Sequence[int], progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Every policy behind 1, 2, ... router replicas (`cfg.router_spread` over them): the
    approximate index of each replica sees only its own placements, the exact one
    (KV events) the workers' truth."""
    rows = []
    for n in routers:
        for s in compare(trace, replace(cfg, num_routers=n), policies, slo):
            rows.append({"routers": n, **slim(s)})
            if progress is not None:
                progress(rows[-1])
    return rows


@dataclass(frozen=True)
class ScaleTiming:
    """When the autoscaler decides and how fast replicas come. The fleet decides every
    `interval_s` on TTFT / TPOT p90 of the requests of the last 6 intervals (Ray Serve's
    10 s metrics push, slo.window_s 60); a new replica serves `startup_s` after it is asked
    for (pod start and weights loaded from the node's disk; counted in its worker-seconds)."""

    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 30.0
    startup_s: float = 60.0
    interval_s: float = 10.0


# Tuned on the diurnal replay of the Mooncake hour (benchmarks/fleet_sim.py). Why these:
# an idle fleet's TTFT p90 there is already ~1.3 s of the 2 s target (long prompts'
# own prefill), so the p90 is aimed at the SLO itself (headroom 1.0), a replica goes
# only when every signal is under 75% of target, and growth is gentle (1.25x a
# decision): the p90 of a window swings with a few long prompts, and 2x jumps on such a
# swing doubled the fleet for nothing.
TUNED_SCALE = ScalePolicy(min_replicas=4, max_replicas=32, slo_headroom=1.0, scale_down_below=0.75, max_growth=1.25)


def autoscale(trace: list[TraceRequest], cfg: FleetConfig, policy: str, slo: SLO, scale: ScalePolicy,
              fixed: list[int], timing: ScaleTiming = ScaleTiming()) -> dict:
    """The autoscaled fleet (starting at scale.min_replicas) and fixed fleets of each size in
    `fixed`, on the same trace: SLO attainment against worker-seconds."""
    cfg = replace(cfg, startup_s=timing.startup_s, scale_interval_s=timing.interval_s)
    auto = simulate(trace, replace(cfg, num_workers=scale.min_replicas), build_replicas(policy, cfg.num_routers),
                    f"autoscaled:{policy}", Autoscaler(slo, scale, timing.upscale_delay_s, timing.downscale_delay_s))
    rows = [auto.summary(slo)]
    rows[0]["policy"] = "autoscaled"
    for n in fixed:
        s = simulate(trace, replace(cfg, num_workers=n), build_replicas(policy, cfg.num_routers), policy).summary(slo)
        s["policy"] = f"fixed {n}"
        rows.append(s)
    return {"policy": policy, "scale_policy": scale.__dict__,
            "timing": asdict(timing),
            "timeline": auto.timeline,
            "rows": [{k: r[k] for k in ("policy", "slo_attainment", "worker_seconds", "goodput_rps", "ttft_s",
                                        "tpot_s", "cache_hit_rate")} for r in rows]}
