"""The Ray Serve glue of kvmesh's SLO autoscaling (kvmesh.serve.autoscale), against Ray
Serve's own config and policy machinery (no cluster: the controller's policy wrapper is
called directly) and a real engine's step outputs."""

from __future__ import annotations

import time

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from kvmesh.build import build_engine
from kvmesh.config import EngineConfig
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.serve.autoscale import (
    BUSY,
    KV_USAGE,
    OLDEST_WAIT,
    QUEUE,
    SLOT_USAGE,
    TPOT_P90,
    TTFT_P90,
    KvmeshAutoscalingPolicy,
    LatencyWindow,
    replica_metrics,
    role_signals,
)
from kvmesh.serve.config import ServingConfig

DEP = DeploymentID(name="decode", app_name="kvmesh")


def _replicas(n: int) -> list[ReplicaID]:
    return [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(n)]


def _ctx(config: AutoscalingConfig, replicas: int, per_replica: dict[str, float], now: float,
         state: dict | None = None, target: int | None = None) -> AutoscalingContext:
    ids = _replicas(replicas)
    return AutoscalingContext(
        deployment_id=DEP, deployment_name="decode", app_name="kvmesh", current_num_replicas=replicas,
        target_num_replicas=replicas if target is None else target, running_replicas=ids, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics={k: {r: v for r in ids} for k, v in per_replica.items()}, raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=config)


def _decode_config(**autoscaling) -> AutoscalingConfig:
    cfg = ServingConfig.model_validate({
        "prefill": {"replicas": 1},
        "decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 0,
                                   "downscale_delay_s": 0, **autoscaling}},
        "slo": {"ttft_s": 1.0, "tpot_s": 0.05}})
    (dec,) = [d for d in cfg.deployment_overrides() if d["name"] == "decode"]
    return AutoscalingConfig(**dec["autoscaling_config"])


def test_worker_roles_get_the_kvmesh_policy_router_keeps_rays():
    cfg = ServingConfig.model_validate({
        "router": {"autoscaling": {"min_replicas": 1, "max_replicas": 2}},
        "decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 2}},
        "slo": {"ttft_s": 1.5, "tpot_s": 0.07}})
    by_name = {d["name"]: d["autoscaling_config"] for d in cfg.deployment_overrides()}
    assert by_name["unified"]["policy"] == {"policy_function": "kvmesh.serve.autoscale:KvmeshAutoscalingPolicy",
                                            "policy_kwargs": {"role": "unified", "ttft_s": 1.5, "tpot_s": 0.07}}
    assert by_name["unified"]["aggregation_function"] == "max"  # the window's peak, not its mean
    assert "policy" not in by_name["router"] and "aggregation_function" not in by_name["router"]
    ray_default = ServingConfig.model_validate(
        {"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "signals": "ongoing_requests"}}})
    assert "policy" not in ray_default.deployment_overrides()[1]["autoscaling_config"]
    # Ray accepts it: the import path resolves and the class is built with the kwargs.
    policy = _resolve_policy_callable(_decode_config().policy)
    assert isinstance(policy, KvmeshAutoscalingPolicy)
    assert (policy.role, policy.slo.ttft_s, policy.slo.tpot_s) == ("decode", 1.0, 0.05)
    assert policy.knobs["busy_high"] is None  # busy is no signal unless the config asks
    busy = _resolve_policy_callable(_decode_config(busy_high=0.8).policy)
    assert busy.knobs["busy_high"] == 0.8


def test_decode_scales_up_on_tpot_over_slo_then_back_down_through_rays_wrapper():
    config = _decode_config()
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    hot = {QUEUE: 0.0, KV_USAGE: 0.3, TTFT_P90: 0.2, TPOT_P90: 0.08}  # TPOT 0.08 > 0.05 * 0.8
    want, state = policy(_ctx(config, 1, hot, now=100.0))
    assert want == 2
    want, state = policy(_ctx(config, 2, hot, now=101.0, state=state))
    assert want == 3  # still over: grows again, clamped to max_replicas
    assert policy(_ctx(config, 3, hot, now=102.0, state=state))[0] == 3
    idle = {QUEUE: 0.0, KV_USAGE: 0.05, TTFT_P90: -1.0, TPOT_P90: -1.0}  # nothing finished lately
    want, state = policy(_ctx(config, 3, idle, now=103.0, state=state))
    assert want == 2  # one at a time
    assert policy(_ctx(config, 1, idle, now=104.0, state=state))[0] == 1  # min_replicas holds


def test_queue_and_kv_pressure_scale_without_latency_samples():
    sig = role_signals("decode", 2, {QUEUE: {"a": 9.0, "b": 8.0}, KV_USAGE: {"a": 0.5, "b": 0.7},
                                     TTFT_P90: {"a": -1.0, "b": -1.0}, TPOT_P90: {"a": -1.0, "b": 0.04}})
    assert (sig.queue_depth, sig.kv_usage, sig.ttft_p90_s, sig.tpot_p90_s) == (17, pytest.approx(0.6), None, 0.04)
    config = _decode_config(max_replicas=8)
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    # 17 waiting over 2 replicas at 4 per replica: pressure 2.1 -> double (max_growth 2).
    want, _ = policy(_ctx(config, 2, {QUEUE: 8.5, KV_USAGE: 0.6, TTFT_P90: -1.0, TPOT_P90: -1.0}, now=5.0))
    assert want == 4
    want, _ = policy(_ctx(config, 2, {QUEUE: 0.0, KV_USAGE: 0.99, TTFT_P90: -1.0, TPOT_P90: -1.0}, now=6.0))
    assert want == 3  # KV almost full: 0.99 / 0.9 = 1.1x


def test_latency_window_reads_a_real_engines_finished_requests(tiny_llama):
    engine = build_engine(EngineConfig.model_validate(
        {"model": {"model": str(tiny_llama)}, "cache": {"block_size": 4, "num_blocks": 64}}))
    now = [0.0]
    window = LatencyWindow(window_s=10.0, clock=lambda: now[0])
    assert replica_metrics(engine.stats(), window)[TTFT_P90] == -1.0
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        window.observe(engine.step())  # what AsyncLLMEngine(on_outputs=window.observe) does
        if engine.has_unfinished():  # TTFT counts from the first token, before the request ends
            assert window.p90()[0] is not None and window.p90()[1] is None
    m = replica_metrics(engine.stats(), window)
    assert m[QUEUE] == 0.0 and 0.0 <= m[KV_USAGE] < 1.0 and m[OLDEST_WAIT] == 0.0
    assert 0.0 < m[TTFT_P90] and 0.0 < m[TPOT_P90]
    now[0] = 11.0  # the samples age out of the window
    assert window.p90() == (None, None)


def test_a_scale_up_still_starting_is_kept_while_the_load_holds():
    """1 running + 1 starting: a queue in the hold band keeps the target of 2 (answering with
    the running count made Ray cancel the starting replica and the deployment flap)."""
    config = _decode_config()
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    hot = {QUEUE: 5.0, KV_USAGE: 0.1, TTFT_P90: -1.0, TPOT_P90: -1.0}  # 5 waiting / 4 per replica
    want, state = policy(_ctx(config, 1, hot, now=10.0))
    assert want == 2
    steady = {QUEUE: 3.0, KV_USAGE: 0.1, TTFT_P90: -1.0, TPOT_P90: -1.0}  # pressure 0.75: hold
    want, state = policy(_ctx(config, 1, steady, now=11.0, state=state, target=2))
    assert want == 2
    idle = {QUEUE: 0.0, KV_USAGE: 0.0, TTFT_P90: -1.0, TPOT_P90: -1.0}  # the load went away: shrink
    assert policy(_ctx(config, 1, idle, now=12.0, state=state, target=2))[0] == 1


def test_a_request_waiting_past_the_slo_scales_up_before_any_ttft_is_measured(tiny_llama):
    """The oldest wait of a request without a first token is a TTFT known early: a queue too
    short to count as pressure, with no TTFT sample yet, still scales up once it waited
    longer than the SLO (with headroom)."""
    engine = build_engine(EngineConfig.model_validate(
        {"model": {"model": str(tiny_llama)}, "cache": {"block_size": 4, "num_blocks": 64},
         "scheduler": {"max_num_seqs": 1}}))
    for i in range(3):  # one runs, two wait
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=40, ignore_eos=True),
                           arrival_time=time.monotonic() - 5.0)
    engine.step()
    window = LatencyWindow(window_s=10.0)
    m = replica_metrics(engine.stats(), window)
    assert m[QUEUE] == 2.0 and m[OLDEST_WAIT] >= 5.0  # the running one has its first token
    config = _decode_config()  # decode SLO TTFT 1.0 s; unified answers for TTFT too
    policy = KvmeshAutoscalingPolicy("unified", ttft_s=1.0, tpot_s=0.05)
    sig = role_signals("unified", 1, {k: {"a": v} for k, v in m.items()})
    assert sig.oldest_wait_s == m[OLDEST_WAIT] and sig.ttft_p90_s is None
    assert policy(_ctx(config, 1, m, now=1.0))[0] == 2
    # A decode-only role does not answer for TTFT: the same wait does not move it.
    assert KvmeshAutoscalingPolicy("decode", ttft_s=1.0, tpot_s=0.05)(_ctx(config, 1, m, now=1.0))[0] == 1
    engine.abort([f"r{i}" for i in range(3)])
    engine.step()
    assert engine.stats()["oldest_wait_s"] == 0.0


def test_busy_and_slot_usage_cover_the_window():
    now = [0.0]
    window = LatencyWindow(window_s=6.0, clock=lambda: now[0])
    assert window.usage(0.0, 0.0, 4) == (0.0, 0.0)  # one reading: nothing to compare yet
    now[0] = 5.0
    # 4 s of steps holding 10 seq-seconds over 5 s: busy 0.8, 10 / (5 s x 4 slots) = 0.5
    assert window.usage(4.0, 10.0, 4) == pytest.approx((0.8, 0.5))
    now[0] = 10.0
    assert window.usage(4.0, 10.0, 4) == pytest.approx((0.4, 0.25))  # idle since 5 s; t=0 still anchors
    now[0] = 12.0
    assert window.usage(4.0, 10.0, 4) == (0.0, 0.0)  # the busy reading left the window


def test_a_full_batch_scales_up_before_any_queue_or_latency_shows(tiny_llama):
    """Slot usage leads under a rising load: a replica whose batch runs full has no queue
    and meets its SLO, but the next arrivals will wait, so a unified or decode role grows;
    a half-full batch holds."""
    engine = build_engine(EngineConfig.model_validate(
        {"model": {"model": str(tiny_llama)}, "cache": {"block_size": 4, "num_blocks": 64},
         "scheduler": {"max_num_seqs": 2}}))
    config = _decode_config()

    def run(n_requests: int) -> dict[str, float]:
        window = LatencyWindow(window_s=60.0)  # each case measured from its own start
        replica_metrics(engine.stats(), window)
        for i in range(n_requests):
            engine.add_request(f"{n_requests}-{i}", [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=40, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()  # what the step loop does: back to back while requests run
        return replica_metrics(engine.stats(), window)

    full = run(2)
    assert full[QUEUE] == 0.0 and full[OLDEST_WAIT] == 0.0 and full[TTFT_P90] == -1.0
    assert full[SLOT_USAGE] > 0.7  # each step holds both sequences
    for role in ("unified", "decode"):
        assert KvmeshAutoscalingPolicy(role, ttft_s=1.0, tpot_s=10.0)(_ctx(config, 1, full, now=1.0))[0] == 2
    half = run(1)
    assert 0.3 < half[SLOT_USAGE] < 0.6
    assert KvmeshAutoscalingPolicy("unified", ttft_s=1.0, tpot_s=10.0)(_ctx(config, 1, half, now=2.0))[0] == 1
    assert engine.stats()["seq_seconds"] > 0.0 and engine.stats()["max_num_seqs"] == 2
    # Busy: both cases stepped back to back, so each was ~fully busy. It is no signal by
    # default (a large-batch GPU engine steps whenever any request runs) ...
    assert full[BUSY] > 0.7 and half[BUSY] > 0.7
    assert KvmeshAutoscalingPolicy("unified", ttft_s=1.0, tpot_s=10.0)(_ctx(config, 1, half, now=3.0))[0] == 1
    # ... and scales a compute-bound replica up where the config asks for it (busy_high).
    busy_policy = KvmeshAutoscalingPolicy("unified", ttft_s=1.0, tpot_s=10.0, busy_high=0.6)
    assert busy_policy(_ctx(config, 1, half, now=4.0))[0] == 2
    assert busy_policy(_ctx(config, 1, {**half, BUSY: 0.3}, now=5.0))[0] == 1
