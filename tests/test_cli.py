"""`kvmesh generate` as a user runs it: a real subprocess."""

import subprocess
import sys

import pytest


def kvmesh(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_tiny_model_streams_text(tiny_llama):
    r = kvmesh("generate", "The quick brown", "--model", str(tiny_llama), "--max-tokens", "6",
               "--ignore-eos", "--threads", "1", "-v")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "6 tokens, finish_reason=length" in r.stderr


def test_unknown_model_path_is_a_clear_error(tmp_path):
    r = kvmesh("generate", "hi", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert "model:" in r.stderr and "not a folder" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_sampling_flag_is_a_clear_error(tiny_llama):
    r = kvmesh("generate", "hi", "--model", str(tiny_llama), "--top-p", "1.5")
    assert r.returncode == 2 and "top_p" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_embedded_model():
    r = kvmesh("generate", "The capital of France is", "--max-tokens", "4", "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris")
    r = kvmesh("generate", "What is the capital of France?", "--chat", "--max-tokens", "20", "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
