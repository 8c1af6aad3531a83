"""The experiments `kvmesh sim run` and benchmarks/fleet_sim.py run: routing policies side
by side on one trace, and an autoscaled replay against fixed fleets."""

from __future__ import annotations

from dataclasses import replace

from kvmesh.router.autoscale import SLO, Autoscaler, ScalePolicy
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.policies import build_policy
from kvmesh.sim.trace import TraceRequest


def compare(trace: list[TraceRequest], cfg: FleetConfig, policies: list[str], slo: SLO,
            progress=None) -> list[dict]:
    """One summary per policy, same trace and fleet."""
    out = []
    for name in policies:
        s = simulate(trace, cfg, build_policy(name), name).summary(slo)
        out.append(s)
        if progress is not None:
            progress(s)
    return out


def autoscale(trace: list[TraceRequest], cfg: FleetConfig, policy: str, slo: SLO, scale: ScalePolicy,
              fixed: list[int]) -> dict:
    """The autoscaled fleet (starting at scale.min_replicas) and fixed fleets of each size in
    `fixed`, on the same trace: SLO attainment against worker-seconds."""
    auto = simulate(trace, replace(cfg, num_workers=scale.min_replicas), build_policy(policy), f"autoscaled:{policy}",
                    Autoscaler(slo, scale))
    rows = [auto.summary(slo)]
    rows[0]["policy"] = "autoscaled"
    for n in fixed:
        s = simulate(trace, replace(cfg, num_workers=n), build_policy(policy), policy).summary(slo)
        s["policy"] = f"fixed {n}"
        rows.append(s)
    return {"policy": policy, "scale_policy": scale.__dict__, "timeline": auto.timeline,
            "rows": [{k: r[k] for k in ("policy", "slo_attainment", "worker_seconds", "goodput_rps", "ttft_s",
                                        "tpot_s", "cache_hit_rate")} for r in rows]}
