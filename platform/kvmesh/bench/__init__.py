"""`kvmesh bench`: load a running server (`serve`) or the offline engine (`throughput`,
`latency`) and report latency percentiles, throughput and goodput, as `vllm bench` does.

The library API is what benchmarks/serving_peers.py drives every server with:
`ServeConfig` + a list of `Sample` (datasets.py) -> `run_serve` -> `ServeResult` (records
and the summary of metrics.py); report.py writes JSON + markdown + PNG.
"""

from kvmesh.bench.clients import BACKENDS, RequestOptions
from kvmesh.bench.datasets import (
                                   DATASETS,
                                   Sample,
                                   mooncake_samples,
                                   prefix_samples,
                                   random_samples,
                                   sharegpt_samples,
                                   with_text,
)
from kvmesh.bench.loadgen import ServeConfig, ServeResult, arrival_times, run_serve, run_serve_async
from kvmesh.bench.metrics import RequestRecord, distribution, parse_goodput, percentile, summarize

__all__ = ["BACKENDS", "DATASETS", "RequestOptions", "RequestRecord", "Sample", "ServeConfig", "ServeResult",
           "arrival_times", "distribution", "mooncake_samples", "parse_goodput", "percentile", "prefix_samples",
           "random_samples", "run_serve", "run_serve_async", "sharegpt_samples", "summarize", "with_text"]
