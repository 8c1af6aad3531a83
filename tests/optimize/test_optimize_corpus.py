"""The offline corpus: three splits with no shared paragraph, LICENSE.txt held out, windows shaped for training."""

import subprocess
import sys
from pathlib import Path

from tiny_models import build_tokenizer
from kvmesh.optimize.corpus import (CHAT_TEMPLATES, SPLITS, _norm, _paragraphs, chat_prompts, split_documents,
                                    token_windows)


def test_splits_do_not_overlap_and_license_is_held_out():
    paras = {s: {_norm(p) for d in split_documents(s) for p in _paragraphs(d.text)} for s in SPLITS}
    assert all(paras[s] for s in SPLITS)
    assert not paras["train"] & paras["eval"]
    assert not paras["calibration"] & paras["eval"]
    assert not paras["calibration"] & paras["train"]
    assert any(d.source.startswith("CPython LICENSE") for d in split_documents("eval"))
    assert sum(len(d.text) for d in split_documents("train")) > 500_000  # enough for the benchmark's steps


def test_windows_start_with_bos_and_have_seq_len():
    tok = build_tokenizer(384)
    windows = token_windows(tok, "calibration", 32, max_windows=5)
    assert len(windows) == 5 and all(len(w) == 32 and w[0] == tok.bos_token_id for w in windows)


def test_windows_spread_over_the_split_or_take_its_start():
    tok = build_tokenizer(384)
    everything = token_windows(tok, "calibration", 32)
    spread = token_windows(tok, "calibration", 32, max_windows=4)
    first = token_windows(tok, "calibration", 32, max_windows=4, spread=False)
    assert first == everything[:4]
    step = len(everything) // 4
    assert spread == [everything[i * len(everything) // 4] for i in range(4)] and step > 1
    assert spread[-1] in everything[len(everything) // 2:]  # reaches the second half of the split


def test_chat_prompts_are_deterministic_instructions_about_prose():
    a, b = chat_prompts("train", 12), chat_prompts("train", 12)
    assert a == b and len(a) == 12 and len(set(a)) == 12
    templates = [t.split("{p}")[0] for t in CHAT_TEMPLATES]
    assert all(any(p.startswith(t) for t in templates) for p in a)
    eval_paras = {" ".join(p.split()) for d in split_documents("eval") for p in _paragraphs(d.text)}
    assert not any(p.split("\n\n", 1)[1] in eval_paras for p in a)  # never the held-out text


def test_benchmark_quick_runs_on_a_tiny_model(model_factory, tmp_path):
    model = model_factory(num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "optimize.py"
    r = subprocess.run([sys.executable, str(script), "--quick", "--threads", "1", "--model", str(model),
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    md = (tmp_path / "optimize_quick.md").read_text()
    assert "pruned-50%+distilled" in md and "first-2+distilled" in md
    assert "| NO |" not in md  # speculative output identical to no speculation
    assert (tmp_path / "optimize_quick.json").is_file()
