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

GPUs depend on who runs ranks 1..: the engine's child processes (the default, `rank_launch:
processes`) see only the GPUs the replica actor holds (Ray sets CUDA_VISIBLE_DEVICES per
actor), so all GPUs go in bundle 0 and the replica claims them; Ray actors (`rank_launch:
actors`) each claim one bundle's share, one bundle per rank, as Ray Serve LLM does for vLLM.

Strategy: tensor-parallel ranks all-reduce twice per layer and must share a node
(STRICT_PACK: NVLink / shared memory, never the network), and so do rank processes (they
run where the replica runs); pipeline-only rank actors exchange one activation per stage
and may cross nodes (PACK: one node when it fits, else several; SPREAD on request).

    placement_options(Resources(num_cpus=4, num_gpus=2), ParallelConfig(tensor_parallel_size=2))
    # {'ray_actor_options': {'num_cpus': 2.0, 'num_gpus': 2.0},
    #  'placement_group_bundles': [{'CPU': 2.0, 'GPU': 2.0}, {'CPU': 2.0}],
    #  'placement_group_strategy': 'STRICT_PACK'}
    # rank_actors=True: [{'CPU': 2.0, 'GPU': 1.0}, {'CPU': 2.0, 'GPU': 1.0}], the replica claims 1 GPU

No Ray import here: the operator renders these options (through ServingConfig) and never
imports Ray; what needs Ray at run time is `kvmesh.serve.rank_actors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from kvmesh.config import ParallelConfig

if TYPE_CHECKING:
    from kvmesh.serve.config import Resources

Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


def default_strategy(parallel: ParallelConfig, rank_actors: bool = False) -> Strategy:
    """STRICT_PACK when any tensor parallelism is in the group or the ranks are the replica's
    own processes (they run on its node); PACK for pipeline-only rank actors."""
    return "STRICT_PACK" if parallel.tensor_parallel_size > 1 or not rank_actors else "PACK"


def check_strategy(parallel: ParallelConfig, strategy: Strategy | None, rank_actors: bool = False) -> Strategy:
    """The strategy to use; refuses one that would put tensor-parallel ranks, or the
    replica's rank processes, on other nodes than the replica.

    A placement group has one strategy for all its bundles: with TP x PP it cannot keep each
    stage's TP group on a node while spreading the stages, so any TP > 1 means STRICT_PACK."""
    if strategy is None:
        return default_strategy(parallel, rank_actors)
    if strategy != "STRICT_PACK":
        if parallel.tensor_parallel_size > 1:
            raise ValueError(f"placement_strategy {strategy}: tensor_parallel_size {parallel.tensor_parallel_size} "
                             "needs all ranks on one node (STRICT_PACK): its all-reduces would cross the network. "
                             "Use pipeline parallelism alone to split a model across nodes")
        if not rank_actors:
            raise ValueError(f"placement_strategy {strategy}: ranks started as the replica's processes "
                             "(rank_launch: processes) run on its node; spreading pipeline stages over nodes "
                             "needs rank_launch: actors")
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


def bundles(resources: "Resources", world_size: int, rank_actors: bool = False) -> list[dict[str, float]]:
    """One bundle per rank, each an equal share of the replica's CPUs, memory and custom
    resources. GPUs: with `rank_actors` one share per bundle (each rank actor claims its own);
    otherwise all of them in bundle 0, which the replica actor claims, because Ray exposes
    to a process only the GPUs its actor holds (CUDA_VISIBLE_DEVICES) and the engine's rank
    processes inherit the replica's view."""
    check_gpus(resources.num_gpus, world_size)
    bundle: dict[str, float] = {"CPU": _split(resources.num_cpus, world_size)}
    if resources.num_gpus and rank_actors:
        bundle["GPU"] = resources.num_gpus / world_size
    if resources.memory_gb is not None:
        bundle["memory"] = float(int(resources.memory_gb * (1 << 30)) // world_size)
    for name, amount in resources.custom.items():
        bundle[name] = _split(amount, world_size)
    out = [dict(bundle) for _ in range(world_size)]
    if resources.num_gpus and not rank_actors:
        out[0] = {"CPU": bundle["CPU"], "GPU": float(resources.num_gpus),
                  **{k: v for k, v in bundle.items() if k != "CPU"}}
    return out


def placement_options(resources: "Resources", parallel: ParallelConfig,
                      strategy: Strategy | None = None, rank_actors: bool = False) -> dict[str, Any]:
    """Ray Serve deployment options for one worker role: `ray_actor_options`, and with more
    than one rank `placement_group_bundles` / `placement_group_strategy`. The actor's options
    are bundle 0 (Ray Serve requires them to fit it). `rank_actors`: ranks 1.. are Ray actors
    in bundles 1.. (`kvmesh.serve.rank_actors`), not the replica's child processes."""
    world = parallel.world_size
    if world <= 1:
        if strategy is not None:
            raise ValueError(f"placement_strategy {strategy}: only a replica with more than one rank "
                             "(tensor / pipeline parallelism) gets a placement group")
        return {"ray_actor_options": resources.ray_actor_options()}
    chosen = check_strategy(parallel, strategy, rank_actors)
    groups = bundles(resources, world, rank_actors)
    first = groups[0]
    actor: dict[str, Any] = {"num_cpus": first["CPU"], "num_gpus": first.get("GPU", 0.0)}
    if "memory" in first:
        actor["memory"] = int(first["memory"])
    custom = {k: v for k, v in first.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        actor["resources"] = custom
    return {"ray_actor_options": actor, "placement_group_bundles": groups, "placement_group_strategy": chosen}
