"""Quantized models through the engine, the model fingerprint, and `kvmesh quantize`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvmesh.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.models.loader import model_fingerprint
from kvmesh.quant import kernels
from kvmesh.quant.loader import quantization_id, weight_bytes
from kvmesh.quant.modules import QuantEmbedding, QuantLinear

torch.set_num_threads(1)
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41], list(range(3, 40))]
METHODS = [("int8", None), ("int4", 32), ("int4", 64)]


def greedy(model, **kw) -> list[list[int]]:
    llm = LLM(str(model), progress=False, num_blocks=64, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("method,group", METHODS)
def test_quantized_engine_equals_dequantize_then_matmul(method, group, tied, model_factory, monkeypatch):
    model = model_factory(tie_word_embeddings=tied)
    llm = LLM(str(model), progress=False, num_blocks=64, quantization=method, quantization_group_size=group)
    m = llm.engine.executor.model
    assert isinstance(m.model.embed_tokens, QuantEmbedding)
    assert isinstance(m.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert (m.lm_head is m.model.embed_tokens.head) == tied
    fast = greedy(model, quantization=method, quantization_group_size=group)
    monkeypatch.setattr(kernels, "NATIVE_MAX_ROWS", -1)  # every matmul: dequantize, then float matmul
    assert fast == greedy(model, quantization=method, quantization_group_size=group)


def test_weight_bytes_shrink(tiny_llama):
    sizes = {q: weight_bytes(LLM(str(tiny_llama), progress=False, num_blocks=16, quantization=q).engine.executor.model)
             for q in (None, "int8", "int4")}
    assert sizes["int8"] < 0.3 * sizes[None]
    assert sizes["int4"] < sizes["int8"]


def test_fingerprint_differs_per_method(tiny_llama):
    ids = [quantization_id(tiny_llama, q, g) for q, g in [(None, None), ("int8", None), ("int4", 32), ("int4", 64)]]
    fps = {model_fingerprint(tiny_llama, {"dtype": "float32", "block_size": 16, "quantization": i}) for i in ids}
    assert ids[0] is None and len(fps) == 4


def _kvmesh(*args):
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True, timeout=300)


def test_quantize_cli_round_trip(tiny_llama, tmp_path):
    out = tmp_path / "int4"
    r = _kvmesh("quantize", str(tiny_llama), str(out), "--method", "int4", "--group-size", "32")
    assert r.returncode == 0, r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "kvmesh", "method": "int4", "group_size": 32}
    assert (out / "tokenizer.json").is_file()
    gen = ["generate", "The quick brown", "--max-tokens", "6", "--ignore-eos", "--threads", "1"]
    saved = _kvmesh(*gen, "--model", str(out))
    at_load = _kvmesh(*gen, "--model", str(tiny_llama), "--quantization", "int4", "--group-size", "32")
    assert saved.returncode == 0 and at_load.returncode == 0, saved.stderr + at_load.stderr
    assert saved.stdout == at_load.stdout and saved.stdout.strip()
    # A saved checkpoint is already quantized: asking again is a clear error, not a double quantization.
    again = _kvmesh(*gen, "--model", str(out), "--quantization", "int8")
    assert again.returncode == 2 and "model.quantization" in again.stderr and "Traceback" not in again.stderr


def test_unknown_quantization_flag_lists_valid_values(tiny_llama):
    r = _kvmesh("generate", "hi", "--model", str(tiny_llama), "--quantization", "int3")
    assert r.returncode == 2 and "int8" in r.stderr and "int4" in r.stderr
