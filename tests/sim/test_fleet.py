"""The fleet simulator on hand-made traces: exact routing, latencies and hit rates."""

import random

import pytest

from kvmesh.engine.outputs import ScheduledSeq, SchedulerOutput
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.router.autoscale import SLO, Autoscaler, ScalePolicy, ScaleSignals, desired_replicas
from kvmesh.sim.fleet import FleetConfig, simulate
from kvmesh.sim.policies import build_policy
from kvmesh.sim.profile import StepProfile, fit_profile, gpu_profile
from kvmesh.sim.trace import TraceRequest, diurnal, warp

# 10 ms a step + 1 ms a token; 8 blocks of 512 tokens per worker.
FLAT = StepProfile(name="flat", step_overhead_s=0.01, per_token_s=0.001, attn_pair_s=0.0, decode_ctx_s=0.0,
                   kv_capacity_tokens=8 * 512)
TRACE = [TraceRequest(0.0, 1024, 2, (1, 2)), TraceRequest(0.1, 1024, 2, (3, 4)),
         TraceRequest(10.0, 1536, 2, (3, 4, 5))]


def run(policy, trace=TRACE, **kw):
    return simulate(trace, FleetConfig(num_workers=2, profile=FLAT, **kw), build_policy(policy), policy)


def test_round_robin_alternates_and_misses_the_shared_prefix():
    res = run("round_robin")
    assert [r.worker for r in res.records] == [1, 0, 1]
    assert [r.cached_tokens for r in res.records] == [0, 0, 0]
    # r0 alone: one 1024-token step (10 + 1024 ms), then a 1-token decode step (11 ms).
    assert res.records[0].ttft == pytest.approx(1.034)
    assert res.records[0].e2e == pytest.approx(1.045)
    assert res.records[2].ttft == pytest.approx(0.01 + 1.536)


@pytest.mark.parametrize("policy", ["precise_load", "prefix_load", "oracle_load"])
def test_prefix_aware_policies_send_the_follow_up_to_the_worker_holding_its_prefix(policy):
    res = run(policy)
    r0, r1, r2 = res.records
    assert r2.worker == r1.worker != r0.worker
    assert r2.cached_tokens == 1024 and r2.ttft == pytest.approx(0.01 + 0.512)
    s = res.summary(SLO(ttft_s=1.0, tpot_s=0.1))
    assert s["cache_hit_rate"] == pytest.approx(1024 / 3584)
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # only r2 has TTFT under 1 s
    assert s["finished"] == 3 and s["rejected"] == 0


def test_requests_longer_than_a_workers_cache_are_rejected_not_crashed():
    res = run("least_load", [TraceRequest(0.0, 5000, 10, tuple(range(10)))])
    assert res.records[0].rejected and res.records[0].finish_s is None


def synthetic(n: int, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(4.0)
        conv = rng.randrange(12)
        shared = [1000 * conv + j for j in range(rng.randrange(1, 5))]
        tail = [10**6 + 10 * i + j for j in range(rng.randrange(0, 3))]
        ids = tuple(shared + tail)
        out.append(TraceRequest(t, len(ids) * 512 - rng.randrange(0, 400), rng.randrange(1, 700), ids))
    return out


def test_decode_fast_forward_gives_the_same_records_as_stepping():
    trace = synthetic(150)
    prof = StepProfile(name="p", step_overhead_s=0.005, per_token_s=2e-5, attn_pair_s=1e-9, decode_ctx_s=4e-8,
                       kv_capacity_tokens=10 * 512)
    runs = [simulate(trace, FleetConfig(num_workers=2, profile=prof, fast_forward=ff), build_policy("precise_load"))
            for ff in (False, True)]
    slow, fast = runs
    assert [r.worker for r in slow.records] == [r.worker for r in fast.records]
    assert [r.cached_tokens for r in slow.records] == [r.cached_tokens for r in fast.records]
    assert [r.finish_s for r in fast.records] == pytest.approx([r.finish_s for r in slow.records], rel=1e-9)
    assert [r.first_token_s for r in fast.records] == pytest.approx([r.first_token_s for r in slow.records], rel=1e-9)
    assert sum(w["steps"] for w in fast.workers) == sum(w["steps"] for w in slow.workers)
    assert sum(w["preemptions"] for w in slow.workers) > 0  # the small caches made it preempt too


def test_step_time_model_and_fit():
    p = StepProfile(name="p", step_overhead_s=0.01, per_token_s=0.001, attn_pair_s=1e-6, decode_ctx_s=1e-5,
                    kv_capacity_tokens=100)
    seq = lambda n, start: ScheduledSeq("r", [0] * n, start, [], True, SamplingParams(), [], [])  # noqa: E731
    # prefill chunk of 4 after 10 cached: pairs = 4 * (10 + 2.5) = 50; decode at position 99: context 100
    sched = SchedulerOutput([seq(4, 10), seq(1, 99)])
    assert p.step_time(sched) == pytest.approx(0.01 + 0.005 + 50e-6 + 100e-5)
    samples = [(t, pr, c, 0.01 + 0.001 * t + 1e-6 * pr + 1e-5 * c)
               for t, pr, c in [(1, 0, 10), (4, 50, 0), (8, 200, 30), (16, 900, 0), (2, 0, 500), (32, 3000, 70)]]
    fit = fit_profile(samples, "fit", 100)
    assert fit.per_token_s == pytest.approx(0.001, rel=1e-6) and fit.decode_ctx_s == pytest.approx(1e-5, rel=1e-6)
    assert gpu_profile("h100-sxm", "llama3-8b").kv_capacity_tokens > 100_000
    with pytest.raises(ValueError, match="raise tp"):
        gpu_profile("l4", "llama3-70b")


def test_autoscale_policy_grows_with_pressure_and_shrinks_one_at_a_time():
    slo, pol = SLO(ttft_s=1.0, tpot_s=0.1), ScalePolicy(min_replicas=1, max_replicas=8, target_queue_per_replica=4)
    sig = lambda **kw: ScaleSignals(**{"role": "unified", "replicas": 2, "queue_depth": 0, "kv_usage": 0.1, **kw})  # noqa: E731
    assert desired_replicas(sig(queue_depth=12), slo, pol) == 3  # 12 / (4 * 2) = 1.5x
    assert desired_replicas(sig(ttft_p90_s=4.0), slo, pol) == 4  # 5x over, growth capped at 2x
    assert desired_replicas(sig(replicas=6, ttft_p90_s=4.0), slo, pol) == 8  # max_replicas
    assert desired_replicas(sig(ttft_p90_s=0.5), slo, pol) == 2  # 0.625 of target: hold
    assert desired_replicas(sig(ttft_p90_s=0.1), slo, pol) == 1  # idle: one fewer
    # prefill replicas ignore TPOT, decode replicas ignore TTFT
    assert desired_replicas(sig(role="prefill", tpot_p90_s=1.0), slo, pol) == 1
    assert desired_replicas(sig(role="decode", ttft_p90_s=9.0, tpot_p90_s=0.05), slo, pol) == 2
    a = Autoscaler(slo, pol, upscale_delay_s=10, downscale_delay_s=60)
    assert a.decide(sig(queue_depth=12), now=0) == 2 and a.decide(sig(queue_depth=12), now=9) == 2
    assert a.decide(sig(queue_depth=12), now=10) == 3


def test_autoscaled_fleet_adds_replicas_under_a_burst_and_retires_them_after():
    base = synthetic(400, seed=1)
    burst = warp(base, diurnal(base[-1].arrival_s / 1.5, 0.3, 3.0))
    end = burst[-1].arrival_s
    burst += [TraceRequest(end + 4.0 * i, 600, 20, (7, 10**7 + i)) for i in range(1, 20)]  # a quiet minute after
    prof = FLAT.model_copy(update={"per_token_s": 2e-4, "kv_capacity_tokens": 64 * 512})
    cfg = FleetConfig(num_workers=1, profile=prof, startup_s=5.0, scale_interval_s=2.0)
    auto = Autoscaler(SLO(ttft_s=1.0, tpot_s=0.1), ScalePolicy(min_replicas=1, max_replicas=6),
                      upscale_delay_s=2.0, downscale_delay_s=10.0)
    res = simulate(burst, cfg, build_policy("precise_load"), "auto", auto)
    peak = max(p["replicas"] for p in res.timeline)
    assert peak > 1 and res.timeline[-1]["replicas"] < peak
    assert all(r.finish_s is not None for r in res.records)  # no request lost to scaling
    assert res.worker_seconds < peak * res.makespan_s
