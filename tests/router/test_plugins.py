"""Routing plugins and config, with no network: scores, picks and P/D decisions."""

import pytest

from kvmesh._proto import llm_pb2, worker_pb2
from kvmesh.engine.hashing import block_hashes
from kvmesh.errors import InvalidRequestError
from kvmesh.router.config import RouterConfig, ScorerWeight
from kvmesh.router.plugins import RouteRequest, WorkerScheduler
from kvmesh.router.registry import WorkerHandle
from kvmesh.rpc import params_from_proto, params_to_proto

FP, BS = "fp", 4


def worker(addr, role="unified", free=100, waiting=0, cached=()):
    w = WorkerHandle(addr, affinity_capacity=1000)
    w.update(worker_pb2.StatsResponse(role=role, address=addr, model_fingerprint=FP, block_size=BS,
                                      num_free_blocks=free, num_usable_blocks=100, num_waiting=waiting,
                                      cached_block_hashes=list(cached)))
    return w


def request(ids):
    return RouteRequest("r", ids, block_hashes(ids, BS, FP), BS)


def test_prefix_from_reported_hashes_beats_load():
    ids = list(range(3, 43))  # 10 blocks
    hot = worker("a:1", waiting=3, cached=block_hashes(ids, BS, FP)[:8])
    cold = worker("b:1")
    sched = WorkerScheduler.from_config(RouterConfig())
    assert sched.pick(request(ids), [hot, cold]) is hot
    # A different prompt has no affinity: the idle worker wins on load.
    assert sched.pick(request(list(range(50, 90))), [hot, cold]) is cold


def test_routed_history_is_affinity_and_only_leading_blocks_count():
    ids = list(range(3, 43))
    a, b = worker("a:1"), worker("b:1")
    hashes = block_hashes(ids, BS, FP)
    a.remember(hashes[1:])  # everything but the first block: no usable prefix
    b.remember(hashes[:2])
    assert (a.prefix_blocks(hashes), b.prefix_blocks(hashes)) == (0, 2)
    assert WorkerScheduler.from_config(RouterConfig()).pick(request(ids), [a, b]) is b


def test_ties_rotate_and_round_robin_ignores_scores():
    ws = [worker("a:1"), worker("b:1")]
    sched = WorkerScheduler.from_config(RouterConfig())
    assert {sched.pick(request([5] * 8), ws).address for _ in range(2)} == {"a:1", "b:1"}
    ws[0].remember(block_hashes([5] * 8, BS, FP))
    rr = WorkerScheduler.from_config(RouterConfig(picker="round_robin", scorers=[]))
    assert [rr.pick(request([5] * 8), ws).address for _ in range(4)] == ["b:1", "a:1", "b:1", "a:1"]


def test_filters_roles_health_and_exclusions():
    p, d = worker("p:1", role="prefill"), worker("d:1", role="decode")
    sched = WorkerScheduler.from_config(RouterConfig())
    req = request([5] * 8)
    req.stage = "prefill"
    assert sched.pick(req, [p, d]) is p
    req.stage = "decode"
    assert sched.pick(req, [p, d]) is d
    req.exclude.add("d:1")  # the decode worker failed this request: any worker beats none
    assert sched.pick(req, [p, d]) is p
    p.mark_unhealthy(60)
    assert sched.pick(req, [p, d]) is None


def test_pd_decider_skips_short_or_cached_prompts():
    p, d = worker("p:1", role="prefill"), worker("d:1", role="decode")
    sched = WorkerScheduler.from_config(RouterConfig(pd_threshold_tokens=16))
    long_ids = list(range(3, 43))
    assert sched.use_pd(request(long_ids), [p, d])
    assert not sched.use_pd(request(long_ids[:10]), [p, d])
    d.remember(block_hashes(long_ids, BS, FP)[:8])  # 32 of 40 tokens cached at decode
    assert not sched.use_pd(request(long_ids), [p, d])
    assert not sched.use_pd(request(long_ids), [d])  # no prefill worker at all


def test_config_rejects_unknown_plugins_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown scorer 'prefixx'.*'prefix'"):
        RouterConfig(scorers=[ScorerWeight(name="prefixx")])
    with pytest.raises(ValueError, match="weight"):
        ScorerWeight(name="prefix", weight=-1)


def test_sampling_params_roundtrip_and_field_errors():
    msg = llm_pb2.SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["x"], logprobs=2)
    p = params_from_proto(msg)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.logprobs) == (7, 0.5, 0.9, 3, ["x"], 2)
    assert params_from_proto(params_to_proto(p)) == p
    assert params_from_proto(llm_pb2.SamplingParams()).max_tokens == 16  # unset = engine default
    with pytest.raises(InvalidRequestError) as err:
        params_from_proto(llm_pb2.SamplingParams(temperature=-1))
    assert err.value.field == "temperature"
