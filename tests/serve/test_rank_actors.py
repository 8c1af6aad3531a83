"""Ranks as Ray actors (`rank_launch: actors`, kvmesh.serve.rank_actors) on a real local Ray:
an actor lands in its bundle of the group; a TP=2 and a PP=2 engine whose rank 1 is a Ray
actor (not a child process) generate the one-rank engine's greedy tokens and logits; a
killed actor fails the next step at once and marks the group down; close() stops the actors."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
from helpers import run_collecting_logits

ray = pytest.importorskip("ray")

from kvmesh import SamplingParams  # noqa: E402
from kvmesh.build import build_engine  # noqa: E402
from kvmesh.config import ParallelConfig  # noqa: E402
from kvmesh.errors import StepFailedError  # noqa: E402
from kvmesh.serve.config import Resources  # noqa: E402
from kvmesh.serve.placement import placement_options  # noqa: E402
from kvmesh.serve.rank_actors import RankActors, RayRankLauncher, rank_actor_options  # noqa: E402

pytestmark = pytest.mark.timeout(300)
PROMPTS = [list(range(3, 20)), list(range(3, 20)), [11, 12, 13], [7, 8, 9, 10, 11, 12]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=96 << 20)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def group(local_ray):
    """A two-bundle placement group as Ray Serve makes for a 2-rank replica (rank actors)."""
    opts = placement_options(Resources(num_cpus=2), ParallelConfig(pipeline_parallel_size=2), rank_actors=True)
    pg = ray.util.placement_group(opts["placement_group_bundles"], strategy=opts["placement_group_strategy"])
    ray.get(pg.ready(), timeout=60)
    yield pg
    ray.util.remove_placement_group(pg)


@ray.remote(num_cpus=0)
class _Where:
    def where(self) -> tuple[str | None, dict]:
        ctx = ray.get_runtime_context()
        pg = ray.util.get_current_placement_group()
        return (pg.id.hex() if pg else None), ctx.get_assigned_resources()


def test_rank_actor_runs_in_its_bundle(group):
    rank = _Where.options(**rank_actor_options(1, group)).remote()
    pg_id, assigned = ray.get(rank.where.remote(), timeout=30)
    assert pg_id == group.id.hex() and assigned.get("CPU") == 1.0
    with pytest.raises(ValueError, match="bundles 0..1"):
        rank_actor_options(2, group)
    with pytest.raises(RuntimeError, match="not inside a placement group"):
        rank_actor_options(1)  # the driver is in no group
    ray.kill(rank)


def _engine(path, group, **kwargs):
    return build_engine(model=str(path), progress=False, block_size=4, num_blocks=24, max_num_batched_tokens=8,
                        enable_prefix_caching=True, rank_launcher=RayRankLauncher(group), **kwargs)


@pytest.mark.parametrize("shape", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_rank_actor_group_equals_one_rank(model_factory, group, shape):
    """Chunked prefill (8-token budget), prefix hits (a repeated prompt), every parameter
    randomized (the tiny Qwen3: q / k norms too)."""
    path = model_factory(architecture="qwen3")
    one = build_engine(model=str(path), progress=False, block_size=4, num_blocks=24, max_num_batched_tokens=8,
                       enable_prefix_caching=True)
    ref, ref_logits = run_collecting_logits(one, PROMPTS, GREEDY)
    two = _engine(path, group, **{shape: 2})
    try:
        ranks = two.executor.runner.ranks
        assert isinstance(ranks, RankActors)
        (pid,) = ranks.pids()
        assert "RankActor" in " ".join(psutil.Process(pid).cmdline())  # a Ray worker running the actor
        got, logits = run_collecting_logits(two, PROMPTS, GREEDY)
        assert got == ref
        for rid in ref:
            torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(ref_logits[rid]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(two.executor.read_blocks([1, 2]), one.executor.read_blocks([1, 2]))
        assert two.num_free_blocks == two.num_usable_blocks
    finally:
        two.close()
    _wait_gone(pid)


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    """The actor's worker process exits (Ray reaps it a moment after the actor is killed)."""
    deadline = time.monotonic() + timeout_s
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"rank actor process {pid} still running {timeout_s:g}s after close()"
        time.sleep(0.2)


def test_dead_rank_actor_fails_the_step_at_once_and_marks_the_group_down(model_factory, group):
    engine = _engine(model_factory(), group, tensor_parallel_size=2)
    try:
        assert engine.executor_health() == (True, "")
        (pid,) = engine.executor.runner.ranks.pids()
        os.kill(pid, signal.SIGKILL)
        engine.add_request("r", [5, 6, 7], GREEDY)
        t0 = time.monotonic()
        with pytest.raises(StepFailedError) as err:
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 10
        assert "tensor parallel" in str(err.value.cause)
        ok, why = engine.executor_health()
        assert not ok and "rank 1" in why and "Ray actor" in why
        assert engine.num_free_blocks == engine.num_usable_blocks
    finally:
        engine.close()
