"""The `kvmesh bench` command: help for every subcommand, flag errors that say what to
change, and `bench throughput` / `bench latency` on the tiny model, a few tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.cli import build_parser, main
from kvmesh.cli.bench import serve_target

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def kvmesh(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT / "operator")])}
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_bench_help_lists_the_subcommands_and_serve_flags():
    r = kvmesh("bench", "--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("serve", "throughput", "latency"))
    r = kvmesh("bench", "serve", "--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--backend", "--request-rate", "--burst", "--max-concurrency", "--num-prompts", "--seed",
                 "--model", "--base-url", "--goodput", "--result-dir", "--dataset-name", "--dataset-path"):
        assert flag in r.stdout, flag


@pytest.mark.parametrize("sub, flags", [("throughput", ("--dataset-name", "--num-prompts", "--model")),
                                        ("latency", ("--batch-size", "--input-len", "--num-iters-warmup"))])
def test_offline_help(sub, flags, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f in out for f in flags)


def test_targets_from_flags():
    p = build_parser()
    assert serve_target(p.parse_args(["bench", "serve"])) == "http://127.0.0.1:8000"
    assert serve_target(p.parse_args(["bench", "serve", "--backend", "grpc"])) == "127.0.0.1:50051"
    assert serve_target(p.parse_args(["bench", "serve", "--backend", "grpc", "--base-url", "http://h:1/"])) == "h:1"
    assert serve_target(p.parse_args(["bench", "serve", "--base-url", "h:2", "--port", "9"])) == "http://h:2"
    assert serve_target(p.parse_args(["bench", "serve", "--host", "0.0.0.0", "--port", "9"])) == "http://0.0.0.0:9"


def test_flag_errors_say_what_to_change(tiny_llama, capsys):
    assert main(["bench", "serve", "--tokenizer", str(tiny_llama), "--dataset-name", "sharegpt"]) == 2
    assert "needs --dataset-path" in capsys.readouterr().err
    assert main(["bench", "serve", "--tokenizer", str(tiny_llama), "--goodput", "ttft"]) == 2
    assert "NAME:MS" in capsys.readouterr().err


def test_throughput_and_latency_on_the_tiny_model(tiny_llama, tmp_path, capsys):
    engine = ["--model", str(tiny_llama), "--threads", "1", "--block-size", "4", "--num-blocks", "128",
              "--max-model-len", "64", "--disable-tqdm"]
    assert main(["bench", "throughput", "--num-prompts", "4", "--input-len", "12", "--output-len", "3",
                 "--result-dir", str(tmp_path), "--result-filename", "tp", *engine]) == 0
    tp = json.loads((tmp_path / "tp.json").read_text())
    assert tp["num_requests"] == 4 and tp["total_input_tokens"] == 48 and tp["total_output_tokens"] == 12
    assert tp["output_tokens_per_s"] == pytest.approx(12 / tp["elapsed_s"])
    assert "Throughput:" in capsys.readouterr().out
    assert main(["bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "3",
                 "--num-iters", "3", "--num-iters-warmup", "1", "--result-dir", str(tmp_path),
                 "--result-filename", "lat", *engine]) == 0
    lat = json.loads((tmp_path / "lat.json").read_text())
    assert lat["batch_size"] == 2 and len(lat["latencies_s"]) == 3
    p = lat["percentiles_s"]
    assert 0 < p["p10"] <= p["p50"] <= p["p90"] <= p["p99"] and "Avg latency" in (tmp_path / "lat.md").read_text()
