"""Pipeline stages on two Ray nodes: `ray.cluster_utils.Cluster` starts two raylets on this
machine (two node ids, each with its own resources, as two hosts would be; the one machine
gives both the loopback address). The replica's placement group spreads its bundles, so
rank 1's actor runs on the other node than the driver (rank 0), and the PP=2 engine's greedy
tokens and logits equal one rank's, with chunked prefill and prefix hits; the group stops
cleanly. (A TP group spread over nodes is refused before it starts: tests/serve/test_placement_config.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import run_collecting_logits

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from kvmesh import SamplingParams  # noqa: E402
from kvmesh.build import build_engine  # noqa: E402
from kvmesh.config import ParallelConfig  # noqa: E402
from kvmesh.serve.placement import check_strategy  # noqa: E402
from kvmesh.serve.rank_actors import RankActors, RayRankLauncher  # noqa: E402

pytestmark = pytest.mark.timeout(300)
PROMPTS = [list(range(3, 20)), list(range(3, 20)), [11, 12, 13], [7, 8, 9, 10, 11, 12]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 96 << 20})
    cluster.add_node(num_cpus=1, resources={"second_node": 1}, object_store_memory=96 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_pipeline_stages_on_two_nodes_equal_one_rank(model_factory, two_nodes):
    strategy = check_strategy(ParallelConfig(pipeline_parallel_size=2), "SPREAD", rank_actors=True)
    # bundle 1 (rank 1) needs the second node's resource: it cannot share the driver's node
    pg = ray.util.placement_group([{"CPU": 1}, {"CPU": 1, "second_node": 0.01}], strategy=strategy)
    ray.get(pg.ready(), timeout=60)
    try:
        nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        driver_node = ray.get_runtime_context().get_node_id()
        assert nodes[1] != driver_node and nodes[0] != nodes[1], nodes
        path = model_factory(architecture="qwen3")
        common = {"model": str(path), "progress": False, "block_size": 4, "num_blocks": 24,
                  "max_num_batched_tokens": 8, "enable_prefix_caching": True}
        ref, ref_logits = run_collecting_logits(build_engine(**common), PROMPTS, GREEDY)
        two = build_engine(pipeline_parallel_size=2, rank_launcher=RayRankLauncher(pg), **common)
        try:
            assert isinstance(two.executor.runner.ranks, RankActors)
            got, logits = run_collecting_logits(two, PROMPTS, GREEDY)
            assert got == ref
            for rid in ref:
                torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(ref_logits[rid]),
                                           rtol=1e-4, atol=1e-4)
            assert two.num_free_blocks == two.num_usable_blocks
            assert two.executor_health() == (True, "")
        finally:
            two.close()
    finally:
        ray.util.remove_placement_group(pg)
