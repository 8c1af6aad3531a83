"""Placement of multi-rank worker replicas: bundles and strategy from the engine's parallel config."""

from __future__ import annotations

import pytest

from kvmesh.serve.config import ServingConfig


def _cfg(tp: int = 1, pp: int = 1, **decode) -> ServingConfig:
    decode.setdefault("resources", {"num_cpus": 4, "num_gpus": 0, "custom": {"kvmesh-decode": 1}})
    return ServingConfig.model_validate({
        "engine": {"parallel": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}}, "decode": decode})


def _unified(cfg: ServingConfig) -> dict:
    [d] = [d for d in cfg.deployment_overrides() if d["name"] == "unified"]
    return d


def test_one_rank_gets_no_placement_group():
    d = _unified(_cfg())
    assert "placement_group_bundles" not in d and "placement_group_strategy" not in d
    assert d["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 0, "resources": {"kvmesh-decode": 1}}


@pytest.mark.parametrize("tp, pp, launch, strategy", [
    (2, 1, "processes", "STRICT_PACK"), (1, 2, "processes", "STRICT_PACK"), (2, 2, "processes", "STRICT_PACK"),
    (2, 1, "actors", "STRICT_PACK"), (1, 2, "actors", "PACK"), (2, 2, "actors", "STRICT_PACK")])
def test_bundles_split_the_replica_over_its_ranks(tp, pp, launch, strategy):
    d = _unified(_cfg(tp, pp, rank_launch=launch))
    world = tp * pp
    share = {"CPU": 4 / world, "kvmesh-decode": round(1 / world, 4)}
    assert d["placement_group_bundles"] == [share] * world
    assert d["placement_group_strategy"] == strategy
    # Ray Serve puts the replica actor in bundle 0: its options are that bundle.
    assert d["ray_actor_options"] == {"num_cpus": 4 / world, "num_gpus": 0.0, "resources": {"kvmesh-decode": share["kvmesh-decode"]}}


def test_gpu_bundles_rank_processes_see_the_replicas_gpus():
    # Ranks as the replica's processes: Ray shows a process only its actor's GPUs, so the replica holds them all.
    d = _unified(_cfg(2, 1, resources={"num_cpus": 8, "num_gpus": 2}))
    assert d["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 2.0}, {"CPU": 4.0}]
    assert d["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 2.0}
    # Ranks as Ray actors: one GPU per bundle, the replica claims bundle 0's.
    d = _unified(_cfg(2, 2, resources={"num_cpus": 8, "num_gpus": 4}, rank_launch="actors"))
    assert d["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}] * 4
    assert d["ray_actor_options"]["num_gpus"] == 1.0
    with pytest.raises(ValueError, match="decode: num_gpus 1 for 2 ranks: each rank needs its own whole GPU"):
        _cfg(2, 1, resources={"num_cpus": 8, "num_gpus": 1}).deployment_overrides()


def test_strategy_override():
    assert _unified(_cfg(1, 2, placement_strategy="SPREAD", rank_launch="actors"))["placement_group_strategy"] == \
        "SPREAD"
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs all ranks on one node"):
        _cfg(2, 2, placement_strategy="PACK", rank_launch="actors").deployment_overrides()
    with pytest.raises(ValueError, match="needs rank_launch: actors"):
        _cfg(1, 2, placement_strategy="PACK").deployment_overrides()
    with pytest.raises(ValueError, match="only a replica with more than one rank"):
        _cfg(placement_strategy="STRICT_PACK").deployment_overrides()


def test_role_override_and_disaggregated_roles():
    cfg = ServingConfig.model_validate({
        "engine": {"parallel": {"tensor_parallel_size": 2}},
        "prefill": {"resources": {"num_cpus": 2}, "engine_overrides": {"tensor_parallel_size": 1}},
        "decode": {"resources": {"num_cpus": 2}}})
    by_name = {d["name"]: d for d in cfg.deployment_overrides()}
    assert "placement_group_bundles" not in by_name["prefill"]
    assert len(by_name["decode"]["placement_group_bundles"]) == 2
    assert "placement_group_bundles" not in by_name["router"]
    # The runtime args carry no placement: a strategy change restarts no replica's config.
    assert "placement_strategy" not in str(cfg.runtime_dict()["decode"])


@pytest.mark.parametrize("launch", ["processes", "actors"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_ray_serve_accepts_the_placement(tp, pp, launch):
    """Ray Serve's own validation: the replica's options fit bundle 0, the config file parses."""
    config = pytest.importorskip("ray.serve._private.config")
    schema = pytest.importorskip("ray.serve.schema")
    cfg = _cfg(tp, pp, resources={"num_cpus": 4, "num_gpus": tp * pp, "memory_gb": 8, "custom": {"kvmesh-decode": 1}},
               rank_launch=launch)
    opts = cfg.placement("unified")
    replica = config.ReplicaConfig.create(object, **opts)
    assert replica.placement_group_strategy == opts.get("placement_group_strategy")
    schema.ServeDeploySchema.model_validate({"applications": [cfg.ray_serve_application()]})
