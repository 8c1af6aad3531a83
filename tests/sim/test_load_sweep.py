"""The load sweep: the same requests time-compressed; prefix-aware routing pays off as
the fleet saturates."""

import pytest
from sim_traces import conversations

from kvmesh.router.autoscale import SLO
from kvmesh.sim import report
from kvmesh.sim.experiments import load_sweep, ratio_range
from kvmesh.sim.fleet import FleetConfig
from kvmesh.sim.profile import StepProfile
from kvmesh.sim.trace import compress

# 0.2 ms a prompt token: a 3072-token prefill takes 0.6 s, near the 1 s TTFT target.
PROF = StepProfile(name="p", step_overhead_s=0.005, per_token_s=2e-4, attn_pair_s=0.0, decode_ctx_s=0.0,
                   kv_capacity_tokens=48 * 512)


def test_compress_keeps_requests_and_divides_arrival_times():
    trace = conversations(2, 2)
    fast = compress(trace, 4.0)
    assert [r.arrival_s for r in fast] == [0.0, 0.25, 0.5, 0.75]
    assert [r.hash_ids for r in fast] == [r.hash_ids for r in trace]
    with pytest.raises(ValueError, match="> 0"):
        compress(trace, 0)


def test_prefix_aware_goodput_pulls_ahead_of_round_robin_as_load_grows():
    sweep = load_sweep(conversations(), FleetConfig(num_workers=2, profile=PROF), ["round_robin", "prefix_load"],
                       SLO(ttft_s=1.0, tpot_s=0.1), [1, 4, 16])
    cell = {(r["multiplier"], r["policy"]): r for r in sweep["rows"]}
    # 1x: the fleet is idle between requests; every request meets the SLO either way.
    assert cell[1, "round_robin"]["slo_attainment"] == cell[1, "prefix_load"]["slo_attainment"] == 1.0
    assert cell[1, "prefix_load"]["vs_round_robin"] == 1.0
    # Prefix-aware routing computes less (15 of 21 blocks are hits) and keeps up longer.
    assert cell[16, "prefix_load"]["cache_hit_rate"] > 3 * cell[16, "round_robin"]["cache_hit_rate"]
    ratios = [cell[m, "prefix_load"]["vs_round_robin"] for m in (1, 4, 16)]
    assert ratios == sorted(ratios) and ratios[-1] >= 2.0
    assert ratio_range(sweep, "prefix_load") == [16]
    assert sweep["peak"]["prefix_load"]["goodput_rps"] > sweep["peak"]["round_robin"]["goodput_rps"]
    row = next(line for line in report.sweep_markdown(sweep).splitlines() if line.startswith("| 16x |"))
    assert f"({ratios[-1]:.2f}x, " in row
