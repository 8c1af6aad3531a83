"""Scheduling a multi-rank replica's rank *actors* into the replica's placement group.

Not used yet (see `rank_actor_options`); `kvmesh.serve.placement` builds the group itself.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def rank_actor_options(rank: int, placement_group: Any = None) -> dict[str, Any]:
    """`.options(...)` for a Ray actor running rank `rank` (>= 1) inside the replica's placement group.

    Not used yet: the engine starts ranks 1.. as child processes of the replica, which run on
    the replica's node and inside its reservation (STRICT_PACK puts every bundle there). An
    engine that makes ranks Ray actors instead (needed for pipeline stages on other nodes, PACK
    / SPREAD) calls this from the replica: it pins rank r to bundle r, with that bundle's
    resources, and keeps the actor's own children in the group. Call it from inside the
    replica (the group is `ray.util.get_current_placement_group()` there)."""
    pg = placement_group if placement_group is not None else ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("rank_actor_options: not inside a placement group (a replica with world_size 1, or "
                           "called outside a Ray Serve replica)")
    specs = pg.bundle_specs
    if not 1 <= rank < len(specs):
        raise ValueError(f"rank {rank}: the replica's placement group has bundles 0..{len(specs) - 1} "
                         "(bundle 0 is the replica itself)")
    bundle = specs[rank]
    opts: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=True),
    }
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory") and not k.startswith("bundle_group")}
    if custom:
        opts["resources"] = custom
    if "memory" in bundle:
        opts["memory"] = bundle["memory"]
    return opts
