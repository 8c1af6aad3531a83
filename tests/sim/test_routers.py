"""Several router replicas: each keeps its own approximate prefix view, the exact index
(KV events) is shared truth."""

import pytest
from sim_traces import conversations

from kvmesh.router.autoscale import SLO
from kvmesh.sim.experiments import multi_router
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.policies import build_policy, build_replicas
from kvmesh.sim.profile import StepProfile
from kvmesh.sim.trace import TraceRequest

PROF = StepProfile(name="p", step_overhead_s=0.005, per_token_s=2e-5, attn_pair_s=0.0, decode_ctx_s=0.0,
                   kv_capacity_tokens=48 * 512)


def hit_rate(policy: str, routers: int, spread: str = "round_robin") -> float:
    # reported_hashes=2: the Stats sample covers a small part of each cache, as 128 of a
    # worker's ~830 blocks do at fleet scale; the approximate view rests on its own routing.
    cfg = FleetConfig(num_workers=4, profile=PROF, reported_hashes=2, num_routers=routers, router_spread=spread)
    return simulate(conversations(), cfg, build_replicas(policy, routers), policy).summary(SLO())["cache_hit_rate"]


@pytest.mark.parametrize("spread", ["round_robin", "random"])
def test_approximate_index_loses_hits_with_more_routers_exact_index_does_not(spread):
    approx = [hit_rate("prefix_load", n, spread) for n in (1, 2, 4)]
    exact = [hit_rate("precise_load", n, spread) for n in (1, 2, 4)]
    best = sum(k for k in range(6)) / sum(k + 1 for k in range(6))  # every earlier block a hit: 15 / 21
    assert exact == pytest.approx([best] * 3)
    assert approx[0] == pytest.approx(best)  # one router saw every placement
    assert approx[0] > approx[1] > approx[2]
    assert approx[2] < 0.75 * exact[2]


def test_replicas_see_each_others_requests_only_through_stats_polls():
    # r0 and r1 arrive before the first poll (0.5 s), r2 after it; each runs ~2 s.
    trace = [TraceRequest(0.0, 1024, 400, (1, 2)), TraceRequest(0.01, 1024, 400, (3, 4)),
             TraceRequest(1.0, 1024, 400, (5, 6))]
    one = simulate(trace, FleetConfig(num_workers=2, profile=PROF), build_policy("least_load"))
    two = simulate(trace, FleetConfig(num_workers=2, profile=PROF, num_routers=2), build_replicas("least_load", 2))
    a, b, c = (r.worker for r in one.records)
    assert a != b  # one router counts its own in-flight request
    a, b, c = (r.worker for r in two.records)
    assert a == b != c  # the second replica did not know of r0 until the poll reported it
    assert all(r.finish_s is not None for r in two.records)


def test_router_count_and_spread_are_checked():
    trace = [TraceRequest(0.0, 1024, 4, (1, 2))]
    with pytest.raises(ValueError, match="one per router replica"):
        simulate(trace, FleetConfig(num_workers=2, profile=PROF, num_routers=2), build_policy("least_load"))
    with pytest.raises(ValueError, match="spread"):
        simulate(trace, FleetConfig(num_workers=2, profile=PROF, router_spread="hash"), build_policy("least_load"))


def test_multi_router_experiment_reports_one_row_per_router_count_and_policy():
    rows = multi_router(conversations(4, 3), FleetConfig(num_workers=2, profile=PROF), ["round_robin", "precise_load"],
                        SLO(), [1, 3])
    assert [(r["routers"], r["policy"]) for r in rows] == [(1, "round_robin"), (1, "precise_load"),
                                                          (3, "round_robin"), (3, "precise_load")]
    assert all(r["requests"] == 12 and r["slo_attainment"] == 1.0 for r in rows)
