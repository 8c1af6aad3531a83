"""`bench serve` against a real kvmesh server in this process (tests/bench/conftest.py),
over OpenAI HTTP (completions, chat) and gRPC: the report agrees with what the server
returned (counts, token totals from its usage records, ordered percentiles), greedy
outputs agree across protocols, --max-concurrency and trace timestamps are honoured, and
the `kvmesh bench serve` command writes its JSON / markdown / PNG."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench import RequestOptions, ServeConfig, mooncake_samples, random_samples, run_serve, with_text

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_200.jsonl"


def check_report(result, samples) -> None:
    s, recs = result.summary, result.records
    assert (s["num_requests"], s["completed"], s["failed"]) == (len(samples), len(samples), 0), s["errors"]
    for r, sample in zip(recs, samples):
        assert r.ok and r.output_tokens == sample.output_len  # EOS ignored: exactly what was asked
        assert 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) <= r.output_tokens - 1
    assert s["total_output_tokens"] == sum(r.output_tokens for r in recs) == sum(x.output_len for x in samples)
    assert s["total_input_tokens"] == sum(r.prompt_tokens for r in recs)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert result.model == "kvmesh"


def test_http_and_grpc_report_what_the_server_returned(server):
    samples = random_samples(server.tokenizer, 6, 16, 8, 0.5, seed=1)
    http = run_serve(ServeConfig(backend="openai", target=server.http, request_rate=50.0, progress=False), samples)
    check_report(http, samples)
    # token-id prompts: the server counted exactly the tokens sent
    assert [r.prompt_tokens for r in http.records] == [x.prompt_len for x in samples]
    grpc = run_serve(ServeConfig(backend="grpc", target=server.grpc, request_rate=50.0, progress=False), samples)
    check_report(grpc, samples)
    assert all(len(r.token_ids) == r.output_tokens for r in grpc.records)  # streamed ids == usage count
    assert [r.prompt_tokens for r in grpc.records] == [x.prompt_len for x in samples]
    # greedy: the same text over both protocols, request by request
    assert [r.text for r in http.records] == [r.text for r in grpc.records]


def test_chat_backend_and_goodput(server):
    samples = with_text(random_samples(server.tokenizer, 4, 12, 5, seed=2), server.tokenizer)
    res = run_serve(ServeConfig(backend="openai-chat", target=server.http, slos={"ttft": 30.0, "tpot": 1e-9},
                                progress=False), samples)
    s = res.summary
    assert s["completed"] == 4 and s["total_output_tokens"] == 20
    # the chat template adds tokens around the text: the server's count, not the ids sent
    assert all(r.prompt_tokens > 0 for r in res.records)
    assert s["goodput"] == 0.0 and s["slo_attainment"] == 0.0  # nobody makes a 1 ns TPOT
    relaxed = run_serve(ServeConfig(backend="openai-chat", target=server.http, slos={"ttft": 30.0},
                                    progress=False), samples)
    assert relaxed.summary["goodput"] == pytest.approx(relaxed.summary["request_throughput"])


def test_max_concurrency_one_serializes_requests(server):
    samples = random_samples(server.tokenizer, 4, 8, 4, seed=3)
    res = run_serve(ServeConfig(backend="grpc", target=server.grpc, max_concurrency=1, progress=False), samples)
    spans = sorted((r.start_s, r.start_s + r.e2e_s) for r in res.records)
    assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_trace_replay_sends_at_the_timestamps(server):
    samples = mooncake_samples(TRACE, len(server.tokenizer), 8, block_size=4, time_scale=60.0,
                               start_s=30.0, max_input_len=120, max_output_len=4)
    assert samples[-1].arrival_s > 0.05  # a spread worth checking
    res = run_serve(ServeConfig(backend="grpc", target=server.grpc, progress=False), samples)
    assert res.summary["completed"] == len(samples)
    assert res.arrivals_s == [s.arrival_s for s in samples]
    for r, s in zip(res.records, samples):
        assert s.arrival_s - 1e-3 <= r.start_s <= s.arrival_s + 0.5


def test_bad_target_is_a_failed_record_not_a_crash(server):
    samples = random_samples(server.tokenizer, 2, 8, 2, seed=4)
    res = run_serve(ServeConfig(backend="openai", target=server.http, model="no-such-model", progress=False,
                                options=RequestOptions(timeout_s=30)), samples)
    assert res.summary["failed"] == 2 and "HTTP 4" in res.summary["errors"][0]
    assert math.isnan(res.summary["ttft_ms"]["p50"])


def test_cli_writes_json_markdown_and_png(server, tmp_path):
    out = tmp_path / "res"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT / "operator")])}
    cmd = [sys.executable, "-m", "kvmesh.cli", "bench", "serve", "--backend", "openai", "--base-url", server.http,
           "--tokenizer", str(server.model), "--dataset-name", "prefix", "--num-prompts", "6",
           "--prefix-num-prefixes", "2", "--prefix-len", "16", "--prefix-suffix-len", "4", "--prefix-output-len", "3",
           "--request-rate", "20", "--goodput", "ttft:30000", "--result-dir", str(out), "--result-filename", "run",
           "--disable-tqdm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "successful requests | 6 / 6" in r.stdout and "TTFT" in r.stdout
    data = json.loads((out / "run.json").read_text())
    s = data["summary"]
    assert s["completed"] == 6 and s["total_output_tokens"] == 18 and s["total_input_tokens"] == 6 * 20
    assert len(data["requests"]) == 6 and s["goodput"] == pytest.approx(s["request_throughput"])
    assert (out / "run.md").read_text().startswith("# kvmesh bench serve")
    assert (out / "run.png").stat().st_size > 1000
