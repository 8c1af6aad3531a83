"""benchmarks/parallel_comm.py --quick on a tiny model: it runs TP=1, TP=2 and PP=2 engines,
and the communication meter sees what each layout must move (all-reduces only with tensor
parallelism, two per layer plus the embedding's, of tokens x hidden x 4 bytes; hidden states
sent only with pipeline stages) and writes JSON, markdown and PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "parallel_comm.py"


@pytest.mark.timeout(300)
def test_parallel_comm_quick(tiny_llama, tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--model", str(tiny_llama), "--out-dir", str(tmp_path),
                          "--threads", "2"], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "parallel_comm_quick.json").read_text())
    assert (tmp_path / "parallel_comm_quick.md").read_text().startswith("# Parallel step")
    assert (tmp_path / "parallel_comm_quick.png").stat().st_size > 0
    rows = {(r["config"], r["phase"]): r for r in data["rows"]}
    assert set(rows) == {(c, p) for c in ("tp1", "tp2", "pp2") for p in ("prefill", "decode")}
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    hidden = json.loads((tiny_llama / "config.json").read_text())["hidden_size"]
    for phase, tokens in (("prefill", data["prefill_seqs"] * data["prefill_len"]), ("decode", data["decode_batch"])):
        assert "all_reduce" not in rows[("tp1", phase)] and "pp_send" not in rows[("tp1", phase)]
        ar = rows[("tp2", phase)]["all_reduce"]
        assert ar["calls"] == 2 * layers + 1
        assert ar["bytes_per_call"] == tokens * hidden * 4
        assert rows[("tp2", phase)]["all_gather"]["calls"] == 1
        pp = rows[("pp2", phase)]
        assert "all_reduce" not in pp and pp["pp_send"]["bytes"] == tokens * hidden * 4  # stage 0's micro-batches
        assert 0 < pp["comm_share"] < 1
    # The unmetered decode-stack table: TP=1, TP=2 with the stack and with the layer loop.
    stack = {(r["config"], r["batch"]): r for r in data["stack_rows"]}
    assert set(stack) == {(c, b) for c in ("tp1", "tp2-stack", "tp2-loop") for b in (1, data["decode_batch"])}
    assert all(r["steps"] == data["decode_steps"] and r["step_ms"] > 0 for r in stack.values())
    assert "the CPU decode stack at TP=2" in (tmp_path / "parallel_comm_quick.md").read_text()
