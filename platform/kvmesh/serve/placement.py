"""Ray placement of a multi-rank worker replica (tensor / pipeline parallelism).

One worker replica drives `world_size = tensor_parallel_size * pipeline_parallel_size`
ranks: rank 0 runs in the replica's own actor, ranks 1.. are processes the engine spawns
(or Ray actors, see `kvmesh.serve.rank_actors`). Ray must reserve all of them together, or a
replica could start with half its GPUs and wait forever for the rest. So such a replica
gets a Ray Serve placement group, as Ray Serve LLM does: one bundle per rank, the replica
actor in bundle 0 (Ray Serve schedules it there, so its `ray_actor_options` must fit that
bundle).

`Workload.resources` stays what one *replica* asks for in total (the operator sizes one
Ray pod per replica from the same numbers); it is split evenly over the bundles. Custom
resources are split too, so every bundle lands on a node of the role's group (the
operator's `kvmesh-<role>: 1` per pod) and one replica still takes exactly one pod.

Strategy: tensor-parallel ranks all-reduce twice per layer and must share a node
(STRICT_PACK: NVLink / shared memory, never the network); pipeline-only ranks exchange one
activation per stage and may cross nodes (PACK: one node when it fits, else several;
SPREAD on request).

    placement_options(Resources(num_cpus=4, num_gpus=2), ParallelConfig(tensor_parallel_size=2))
    # {'ray_actor_options': {'num_cpus': 2.0, 'num_gpus': 1.0},
    #  'placement_group_bundles': [{'CPU': 2.0, 'GPU': 1.0}, {'CPU': 2.0, 'GPU': 1.0}],
    #  'placement_group_strategy': 'STRICT_PACK'}

No Ray import here: the operator renders these options (through ServingConfig) and never
imports Ray; what needs Ray at run time is `kvmesh.serve.rank_actors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from kvmesh.config import ParallelConfig

if TYPE_CHECKING:
    from kvmesh.serve.config import Resources

Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


def default_strategy(parallel: ParallelConfig) -> Strategy:
    """STRICT_PACK when any tensor parallelism is in the group, else PACK (pipeline only)."""
    return "STRICT_PACK" if parallel.tensor_parallel_size > 1 else "PACK"


def check_strategy(parallel: ParallelConfig, strategy: Strategy | None) -> Strategy:
    """The strategy to use; refuses one that would put tensor-parallel ranks on different nodes.

    A placement group has one strategy for all its bundles: with TP x PP it cannot keep each
    stage's TP group on a node while spreading the stages, so any TP > 1 means STRICT_PACK."""
    if strategy is None:
        return default_strategy(parallel)
    if parallel.tensor_parallel_size > 1 and strategy != "STRICT_PACK":
        raise ValueError(f"placement_strategy {strategy}: tensor_parallel_size {parallel.tensor_parallel_size} "
                         "needs all ranks on one node (STRICT_PACK): its all-reduces would cross the network. "
                         "Use pipeline parallelism alone to split a model across nodes")
    return strategy


def _split(value: float, n: int) -> float:
    # Ray keeps 4 decimals of a resource; rounding down keeps n bundles within the total.
    return int(value / n * 10_000) / 10_000


def check_gpus(num_gpus: float, world_size: int) -> None:
    """One whole GPU (or several) per rank: NCCL refuses two ranks on one device."""
    if num_gpus <= 0 or world_size <= 1:
        return
    per_rank = num_gpus / world_size
    if per_rank < 1 or per_rank != int(per_rank):
        raise ValueError(f"num_gpus {num_gpus:g} for {world_size} ranks: each rank needs its own whole GPU(s), so "
                         f"give a multiple of {world_size} GPUs per replica (e.g. num_gpus: {world_size}), or 0 "
                         "for CPU ranks")


def bundles(resources: "Resources", world_size: int) -> list[dict[str, float]]:
    """One bundle per rank, each an equal share of the replica's resources."""
    check_gpus(resources.num_gpus, world_size)
    bundle: dict[str, float] = {"CPU": _split(resources.num_cpus, world_size)}
    if resources.num_gpus:
        bundle["GPU"] = resources.num_gpus / world_size
    if resources.memory_gb is not None:
        bundle["memory"] = float(int(resources.memory_gb * (1 << 30)) // world_size)
    for name, amount in resources.custom.items():
        bundle[name] = _split(amount, world_size)
    return [dict(bundle) for _ in range(world_size)]


def placement_options(resources: "Resources", parallel: ParallelConfig,
                      strategy: Strategy | None = None) -> dict[str, Any]:
    """Ray Serve deployment options for one worker role: `ray_actor_options`, and with more
    than one rank `placement_group_bundles` / `placement_group_strategy`. The actor's options
    are bundle 0 (Ray Serve requires them to fit it)."""
    world = parallel.world_size
    if world <= 1:
        if strategy is not None:
            raise ValueError(f"placement_strategy {strategy}: only a replica with more than one rank "
                             "(tensor / pipeline parallelism) gets a placement group")
        return {"ray_actor_options": resources.ray_actor_options()}
    chosen = check_strategy(parallel, strategy)
    groups = bundles(resources, world)
    first = groups[0]
    actor: dict[str, Any] = {"num_cpus": first["CPU"], "num_gpus": first.get("GPU", 0.0)}
    if "memory" in first:
        actor["memory"] = int(first["memory"])
    custom = {k: v for k, v in first.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        actor["resources"] = custom
    return {"ray_actor_options": actor, "placement_group_bundles": groups, "placement_group_strategy": chosen}
