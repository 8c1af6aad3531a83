"""benchmarks/_loadgen.py (fleet_real's and autoscale_ramp's load generator) is a thin
spelling of kvmesh.bench: trace arrival times are honoured and its flat summary agrees."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _loadgen  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_run_load_and_summary(server):
    reqs = [_loadgen.Request(list(range(10 + i, 30 + i)), 3) for i in range(4)]
    arrivals = [0.0, 0.05, 0.1, 0.15]
    results, wall = asyncio.run(_loadgen.run_load(server.http + "/v1", "kvmesh", reqs, 0.0, arrivals_s=arrivals))
    assert [r.ok for r in results] == [True] * 4 and all(r.output_tokens == 3 for r in results)
    assert all(a - 1e-3 <= r.start_s for a, r in zip(arrivals, results)) and wall >= 0.15
    s = _loadgen.summarize(results, wall, slo_ttft_s=60.0, slo_tpot_s=60.0)
    assert (s["requests"], s["failed"], s["output_tokens"]) == (4, 0, 12)
    assert s["slo_attainment"] == 1.0 and s["ttft_p50_s"] <= s["ttft_p99_s"] and len(s["ttft_all_s"]) == 4
