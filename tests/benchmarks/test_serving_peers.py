"""benchmarks/serving_peers: `--rate auto` offers each Poisson workload a load relative to
what the offline engine sustains on this machine, a fixed `--rate` stays fixed; rounds
rotate the servers; the kvmesh / vLLM ratios are medians of per-round ratios with their
spread; greedy outputs are counted equal request by request; the report says all that."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
from tiny_models import build_tokenizer

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import serving_peers as sp  # noqa: E402

TOK = build_tokenizer(384)


def _args(rate: str) -> Namespace:
    return Namespace(rate=rate, num_requests=6, burst_requests=4, prefix_tokens=32, load=0.6)


def _workloads(rate: str) -> dict:
    args = _args(rate)
    return {w: sp.make_workload(w, args, TOK) for w in ("random", "prefix", "burst")}


def test_workloads_are_kvmesh_bench_datasets():
    wls = _workloads("2.0")
    rnd, prefix, burst = wls["random"][0], wls["prefix"][0], wls["burst"][0]
    assert len(rnd) == 6 and all(128 <= s.prompt_len <= 384 and 64 <= s.output_len <= 192 for s in rnd)
    assert len({tuple(s.prompt_ids[:32]) for s in prefix}) == 4 and all(s.prompt_len == 96 for s in prefix)
    assert len(burst) == 4 and wls["burst"][1] == float("inf")
    assert [s.prompt_ids for s in _workloads("2.0")["random"][0]] == [s.prompt_ids for s in rnd]  # seeded


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


def test_rounds_rotate_the_server_order():
    servers = ["kvmesh-ray", "kvmesh-local", "vllm"]
    assert [sp.round_order(servers, r)[0] for r in range(4)] == ["kvmesh-ray", "kvmesh-local", "vllm", "kvmesh-ray"]
    assert sorted(sp.round_order(servers, 1)) == sorted(servers)


def _summary(tok_s: float, ttft_ms: float) -> dict:
    d = {"mean": ttft_ms, "p50": ttft_ms, "p90": ttft_ms, "p99": ttft_ms, "max": ttft_ms}
    return {"output_throughput": tok_s, "goodput": 1.0, "failed": 0, "ttft_ms": d, "tpot_ms": d,
            "itl_ms": d, "e2e_ms": d, "load_before": {"1min": 0.1}, "ttft_all_ms": [ttft_ms]}


def test_ratios_are_medians_of_per_round_ratios_with_spread():
    ours = {0: _summary(100, 10), 1: _summary(90, 20), 2: _summary(120, 30)}
    theirs = {0: _summary(100, 20), 1: _summary(100, 20), 2: _summary(100, 20), 3: _summary(1, 1)}
    r = sp.ratio_spread(ours, theirs, "output_throughput")
    assert r["rounds"] == pytest.approx([1.0, 0.9, 1.2]) and r["median"] == pytest.approx(1.0)
    assert (r["min"], r["max"]) == (pytest.approx(0.9), pytest.approx(1.2))
    assert sp.ratio_spread(ours, theirs, "ttft_ms.p50")["median"] == pytest.approx(1.0)  # 0.5, 1.0, 1.5
    assert sp.ratio_spread(ours, {}, "goodput") is None


def test_greedy_outputs_are_compared_request_by_request():
    ours = {0: ["a", "b", None], 1: ["a", "x", "c"]}
    theirs = {0: ["a", "b", "c"], 1: ["a", "b", "c"], 2: ["z"]}
    c = sp.compare_texts(ours, theirs)
    assert (c["compared"], c["equal"]) == (5, 4)
    assert c["mismatches"] == [{"round": 1, "request": 1, "first_mismatch_char": 0, "chars": [1, 1], "ours": "x",
                                "theirs": "b"}]


def test_report_names_rates_rounds_ratios_and_output_match():
    load = {"1min": 0.1}
    data = {"date": "d", "cpu": "c", "model": "m", "slos_ms": {"ttft": 2000.0}, "load_start": load,
            "workloads": ["random"], "rates": {"random": 0.3, "prefix": 0.75},
            "args": {"rate": "auto", "load": 0.6, "rounds": 2},
            "results": {"kvmesh-local": {"rounds": [{"round": 0, "random": _summary(110, 10)},
                                                    {"round": 1, "random": _summary(90, 12)}]},
                        "vllm": {"rounds": [{"round": 0, "random": _summary(100, 20)},
                                            {"round": 1, "random": _summary(100, 20)}]}}}
    texts = {"kvmesh-local": {"random": {0: ["a", "b"], 1: ["a", "b"]}},
             "vllm": {"random": {0: ["a", "b"], 1: ["a", "c"]}}}
    data["vs_vllm"] = sp.compare(data, texts)
    text = sp.render(data)
    assert "0.6 x the offline engine's request rate" in text and "random 0.300 req/s, prefix 0.750 req/s" in text
    assert "2 rounds" in text and "greedy outputs equal: 3/4" in text
    assert "1.00 (0.90-1.10)" in text  # out tok/s: rounds 1.1 and 0.9
    assert "| kvmesh-local | 100 | 11.00 |" in text  # medians over rounds: 110 and 90, 10 and 12 ms
    data["args"] = {"rate": "2.0", "load": 0.6}
    assert "fixed (--rate): random 0.300 req/s" in sp.render(data)


def test_ab_server_is_kvmesh_local_plus_the_b_flags():
    args = sp.parse_args(["--rate", "2", "--no-offline", "--servers", "kvmesh-local,kvmesh-local-b,vllm",
                          "--kvmesh-args", "--max-num-seqs 32", "--kvmesh-args-b", "--max-num-batched-tokens 2048"])
    a, _ = sp.server_cmd("kvmesh-local", Path("/m"), 8400, 50400, args)
    b, _ = sp.server_cmd("kvmesh-local-b", Path("/m"), 8400, 50400, args)
    assert b[:len(a)] == a and b[len(a):] == ["--max-num-batched-tokens", "2048"]
    assert "--local" in a and "--max-num-seqs" in a
    with pytest.raises(SystemExit):  # a B side without flags would compare kvmesh-local with itself
        sp.parse_args(["--rate", "2", "--no-offline", "--servers", "kvmesh-local,kvmesh-local-b"])
