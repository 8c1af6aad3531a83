"""`--model` as a GGUF file, a folder holding one, or a packaged name (checkpoint/files.py
resolve_model_path, checkpoint/gguf_convert.py): what is refused and how, that a failed
conversion leaves nothing behind, and that the generic llama path gives the embedded
model's folder byte for byte."""

import filecmp

import numpy as np
import pytest

from kvmesh.checkpoint import embedded
from kvmesh.checkpoint.files import resolve_model_path
from kvmesh.checkpoint.gguf_convert import converted_source
from kvmesh.errors import ModelNotFoundError


def _tiny_gguf(path, arch: str) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_folder_with_two_ggufs_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        _tiny_gguf(tmp_path / name, "llama")
    with pytest.raises(ModelNotFoundError, match=r"2 \*\.gguf files: pass one of them"):
        resolve_model_path(str(tmp_path))


def test_unknown_name_lists_the_packaged_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="gemma-3-270m"):
        resolve_model_path("no-such-model")


def test_not_a_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelNotFoundError, match="is not a GGUF"):
        resolve_model_path(str(tmp_path / "x.gguf"), progress=False)


def test_unsupported_architecture_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "q.gguf", "qwen2")
    with pytest.raises(ModelNotFoundError, match=r"'qwen2' GGUF; kvmesh converts \['gemma3', 'llama'\]"):
        resolve_model_path(str(tmp_path / "q.gguf"), progress=False)
    left = [p.name for p in (tmp_path / "cache" / "models" / "gguf").iterdir()]
    assert all(name.endswith(".lock") for name in left), left  # no folder, no temp sibling


@pytest.mark.slow
def test_llama_gguf_by_path_converts_as_the_embedded_model(tmp_path, monkeypatch):
    """`--model .../SmolLM2-135M-Instruct.Q4_1.gguf` (the generic path: q/k rows un-permuted)
    writes the very files of the embedded model's folder, and `--quantization gguf` finds
    the file the folder came from."""
    reference = embedded.ensure_embedded_model(progress=False)
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    src = embedded.gguf_path()
    folder = resolve_model_path(str(src), progress=False)
    assert folder.is_relative_to(tmp_path)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert filecmp.cmp(reference / name, folder / name, shallow=False), name
    assert converted_source(folder) == src.resolve()
    copy = tmp_path / "elsewhere" / src.name  # the same file at another path: the same folder, kept
    copy.parent.mkdir()
    copy.write_bytes(src.read_bytes())
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(str(copy), progress=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
