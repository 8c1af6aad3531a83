"""rank_actor_options on a real local Ray: a rank actor lands in its bundle of the replica's group."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from kvmesh.config import ParallelConfig  # noqa: E402
from kvmesh.serve.config import Resources  # noqa: E402
from kvmesh.serve.placement import placement_options  # noqa: E402
from kvmesh.serve.rank_actors import rank_actor_options  # noqa: E402


@ray.remote(num_cpus=0)
class _Rank:
    def where(self) -> tuple[str | None, dict]:
        ctx = ray.get_runtime_context()
        pg = ray.util.get_current_placement_group()
        return (pg.id.hex() if pg else None), ctx.get_assigned_resources()


def test_rank_actor_runs_in_its_bundle():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=96 << 20)
    try:
        opts = placement_options(Resources(num_cpus=1), ParallelConfig(pipeline_parallel_size=2), rank_actors=True)
        pg = ray.util.placement_group(opts["placement_group_bundles"], strategy=opts["placement_group_strategy"])
        ray.get(pg.ready(), timeout=30)
        rank = _Rank.options(**rank_actor_options(1, pg)).remote()
        pg_id, assigned = ray.get(rank.where.remote(), timeout=30)
        assert pg_id == pg.id.hex() and assigned.get("CPU") == 0.5
        with pytest.raises(ValueError, match="bundles 0..1"):
            rank_actor_options(2, pg)
        with pytest.raises(RuntimeError, match="not inside a placement group"):
            rank_actor_options(1)  # the driver is in no group
        ray.kill(rank)
        ray.util.remove_placement_group(pg)
    finally:
        if started:
            ray.shutdown()
