"""kvmesh.bench's arithmetic on hand-made records: percentiles, goodput under an SLO, the
summary's counts, and the arrival schedule's statistics with a fixed seed."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from kvmesh.bench import RequestRecord, arrival_times, parse_goodput, percentile, summarize
from kvmesh.bench.metrics import distribution, meets_slos


def rec(ttft: float, e2e: float, out: int, ok: bool = True, prompt: int = 10) -> RequestRecord:
    return RequestRecord(ok=ok, prompt_tokens=prompt, output_tokens=out, ttft_s=ttft, e2e_s=e2e,
                         itl_s=[(e2e - ttft) / max(out - 1, 1)] * max(out - 1, 0))


def test_percentile_matches_numpy_linear_interpolation():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.0]
    for p in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert math.isnan(percentile([], 50))
    d = distribution([0.001, 0.002, 0.003], scale=1e3)
    assert d["mean"] == pytest.approx(2.0) and d["p50"] == pytest.approx(2.0) and d["max"] == pytest.approx(3.0)


def test_tpot_is_time_after_the_first_token_per_token():
    assert rec(0.1, 1.1, 11).tpot_s == pytest.approx(0.1)
    assert rec(0.1, 0.1, 1).tpot_s == 0.0


def test_parse_goodput_takes_vllm_spelling_in_ms():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["tpot:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_goodput_counts_requests_within_every_slo():
    records = [rec(0.1, 1.1, 11),     # ttft 100 ms, tpot 100 ms: good
               rec(0.6, 1.6, 11),     # ttft over 500 ms
               rec(0.1, 3.1, 11),     # tpot 300 ms: over 150 ms
               rec(0.2, 0.2, 1),      # one token: tpot 0, good
               rec(0.0, 0.0, 0, ok=False)]
    slos = parse_goodput(["ttft:500", "tpot:150"])
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=2.0, slos=slos)
    assert s["goodput"] == pytest.approx(1.0) and s["slo_attainment"] == pytest.approx(2 / 5)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["total_output_tokens"] == 34 and s["total_input_tokens"] == 40
    assert s["output_throughput"] == pytest.approx(17.0) and s["request_throughput"] == pytest.approx(2.0)
    # over the three multi-token requests (100, 100, 300 ms): the one-token request has no TPOT
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0) and s["tpot_ms"]["mean"] == pytest.approx(500 / 3)
    assert s["slos_ms"] == {"ttft": 500.0, "tpot": 150.0}
    # no SLO: every completed request is good
    assert summarize(records, 2.0)["goodput"] == pytest.approx(2.0)


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    times = arrival_times(4000, rate=5.0, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = np.diff(times)
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.06)  # CV of an exponential
    # Fraction of 1 s windows' counts: Poisson(5) has variance = mean.
    counts = np.bincount(np.floor(times).astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)
    assert arrival_times(4000, 5.0, seed=7) == times and arrival_times(4000, 5.0, seed=8) != times


def test_burstiness_and_infinite_rate():
    bursty = np.diff(arrival_times(4000, rate=5.0, burstiness=0.25, seed=1))
    assert statistics.fmean(bursty) == pytest.approx(0.2, rel=0.1)  # same rate, burstier
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.1)  # CV 1/sqrt(k)
    assert arrival_times(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)
