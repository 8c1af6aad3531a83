"""benchmarks/serving_peers's arrival rates: `--rate auto` offers each Poisson workload a load
relative to what the offline engine sustains on this machine, a fixed `--rate` stays fixed,
and the report says which rates ran."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import serving_peers as sp  # noqa: E402


def _args(rate: str) -> Namespace:
    return Namespace(rate=rate, num_requests=6, burst_requests=4, prefix_tokens=32, load=0.6)


def _workloads(rate: str) -> dict:
    args = _args(rate)
    return {w: sp.make_workload(w, args, vocab=1000) for w in ("random", "prefix", "burst")}


def test_auto_rate_is_load_times_the_offline_request_rate():
    wls = _workloads("auto")
    assert wls["random"][1] is None and wls["prefix"][1] is None  # set once the offline engine ran
    assert wls["burst"][1] == float("inf")
    offline = {"random": {"req_s": 0.5}, "prefix": {"req_s": 1.25}, "burst": {"req_s": 0.5}}
    rates = sp.calibrate_rates(wls, offline, 0.6)
    assert rates == {"random": 0.3, "prefix": 0.75}
    assert wls["random"][1] == 0.3 and wls["prefix"][1] == 0.75 and wls["burst"][1] == float("inf")
    assert len(wls["random"][0]) == 6  # the requests themselves are untouched


def test_fixed_rate_is_kept():
    wls = _workloads("2.0")
    assert wls["random"][1] == 2.0 and wls["prefix"][1] == 2.0
    assert sp.calibrate_rates(wls, {}, 0.6) == {}
    assert wls["random"][1] == 2.0


def test_report_names_the_rates():
    load = {"1min": 0.1}
    data = {"date": "d", "cpu": "c", "model": "m", "slo_ttft_s": 2.0, "slo_tpot_s": 0.2, "load_start": load,
            "workloads": [], "results": {}, "rates": {"random": 0.3, "prefix": 0.75},
            "args": {"rate": "auto", "load": 0.6}}
    text = sp.render(data)
    assert "0.6 x the offline engine's request rate" in text and "random 0.300 req/s, prefix 0.750 req/s" in text
    data["args"] = {"rate": "2.0", "load": 0.6}
    assert "fixed (--rate): random 0.300 req/s" in sp.render(data)
