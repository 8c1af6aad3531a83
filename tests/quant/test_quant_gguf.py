"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept quantized (`quantization="gguf"`).

Oracle: `gguf.quants.dequantize` on the same bytes. Tensors are quantized with the gguf
package's own `quantize` and written with its `GGUFWriter`, so the block layouts are
ggml's, not ours.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from helpers import stack_then_loop

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import ConfigError
from kvmesh.layers import native
from kvmesh.llm import LLM
from kvmesh.models.loader import model_fingerprint
from kvmesh.quant import kernels
from kvmesh.quant.gguf_weights import _Header, convert_tensor, read_gguf
from kvmesh.quant.loader import quantization_id
from kvmesh.quant.modules import QuantEmbedding, QuantLinear

torch.set_num_threads(1)
T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def _write(path, tensors: dict[str, tuple[np.ndarray, T]], meta: dict | None = None) -> None:
    """A GGUF with `tensors` {name: (float array, type)} quantized by the gguf package."""
    w = GGUFWriter(str(path), "llama")
    for key, value in (meta or {}).items():
        getattr(w, key)(value)
    for name, (arr, qtype) in tensors.items():
        if qtype == T.F32:
            w.add_tensor(name, arr.astype(np.float32))
        else:
            w.add_tensor(name, quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _linear_from(type_name: str, data: np.ndarray, shape) -> QuantLinear:
    canon = convert_tensor(type_name, data, shape)
    m = QuantLinear("int8" if type_name == "Q8_0" else "int4", shape[1], shape[0], bias=False)
    m.load(canon)
    m.finalize(torch.float32)
    return m


@pytest.mark.parametrize("path", ["native", "dequant"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kept_quantized_linear_equals_gguf_dequantize(qtype, path, tmp_path, monkeypatch):
    if path == "native" and not native.has_quant_gemm():
        pytest.skip("native kernel unavailable on this CPU / without a C compiler")
    if path == "dequant":
        monkeypatch.setattr(kernels, "NATIVE_MAX_ROWS", -1)
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((48, 96)) * 0.1 + rng.uniform(-0.2, 0.2, (48, 1))).astype(np.float32)
    _write(tmp_path / "t.gguf", {"w": (w, qtype)})
    header = _Header(tmp_path / "t.gguf")
    (name, ttype, shape, offset), = header.tensors
    assert (name, shape) == ("w", (48, 96))
    data = header.data(qtype.name, shape, offset)
    ref_w = torch.from_numpy(dequantize(np.asarray(data).reshape(48, -1), qtype))
    m = _linear_from(qtype.name, data, shape)
    assert torch.equal(m.dequantized_weight(), ref_w)  # the same numbers, bit for bit
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 5, 40):
        x = torch.randn(rows, 96, generator=g)
        ref = x.double() @ ref_w.double().t()
        err = (m(x).double() - ref).abs().max().item()
        assert err <= 1e-5 * max(ref.abs().max().item(), 1.0), (rows, err)


def test_quantized_embedding_gathers_gguf_rows(tmp_path):
    rng = np.random.default_rng(1)
    for qtype in TYPES:
        w = rng.standard_normal((40, 64)).astype(np.float32)
        _write(tmp_path / f"{qtype.name}.gguf", {"e": (w, qtype)})
        header = _Header(tmp_path / f"{qtype.name}.gguf")
        (_, _, shape, offset), = header.tensors
        data = header.data(qtype.name, shape, offset)
        emb = QuantEmbedding(40, 64, scheme="int8" if qtype == T.Q8_0 else "int4")
        emb.head.load(convert_tensor(qtype.name, data, shape))
        emb.finalize(torch.float32)
        ids = torch.tensor([7, 0, 39, 7])
        ref = torch.from_numpy(dequantize(np.asarray(data).reshape(40, -1), qtype))[ids]
        assert torch.equal(emb(ids), ref)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> llama.cpp q/k row order (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _layer_type(layer: int, proj: str) -> T:
    """Layer 0 mixes Q4_0 / Q4_1 inside the fused q/k/v and gate/up; layer 1 is Q8_0; then Q4_0."""
    if layer == 0:
        return T.Q4_1 if proj in ("k_proj", "up_proj", "o_proj") else T.Q4_0
    return T.Q8_0 if layer == 1 else T.Q4_0


@pytest.fixture(scope="module")
def gguf_folder(model_factory, tmp_path_factory):
    """A tiny Llama folder converted from a GGUF (every projection type mixed across layers),
    holding the GGUF beside float32 safetensors dequantized from it with gguf's own code."""
    from safetensors.torch import load_file, save_file

    src = model_factory(tie_word_embeddings=True, hidden_size=64, intermediate_size=128)
    cfg = json.loads((src / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = tmp_path_factory.mktemp("gguf-llama")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    tensors, ref = {}, {}
    for name, t in sorted(load_file(str(src / "model.safetensors")).items()):
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname, qtype = "token_embd.weight", T.Q8_0
        elif name == "model.norm.weight":
            gname, qtype = "output_norm.weight", T.F32
        else:
            _, _, layer, *module, suffix = name.split(".")
            gname = f"blk.{layer}.{_HF_TO_GGUF['.'.join(module)]}.{suffix}"
            qtype = T.F32 if w.ndim == 1 else _layer_type(int(layer), module[-1])
        if gname.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if "attn_q" in gname else kv_heads
            w = _permute(w, n)
        tensors[gname] = (w, qtype)
        deq = w if qtype == T.F32 else dequantize(quantize(w, qtype), qtype)
        if gname.endswith(("attn_q.weight", "attn_k.weight")):
            deq = _unpermute(deq, heads if "attn_q" in gname else kv_heads)
        ref[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
    meta = {"add_block_count": cfg["num_hidden_layers"], "add_embedding_length": cfg["hidden_size"],
            "add_head_count": heads, "add_head_count_kv": kv_heads, "add_context_length": 512,
            "add_feed_forward_length": cfg["intermediate_size"]}
    _write(out / "model.gguf", tensors, meta)
    save_file(ref, str(out / "model.safetensors"))
    return out


PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41], list(range(3, 40))]


def _greedy(folder, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), progress=False, num_blocks=64, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


def test_gguf_model_greedy_equals_dequantized_float(gguf_folder):
    kept, llm = _greedy(gguf_folder, quantization="gguf")
    m = llm.engine.executor.model
    assert isinstance(m.model.embed_tokens, QuantEmbedding) and m.lm_head is m.model.embed_tokens.head
    assert m.lm_head.scales.shape[1] == m.cfg.hidden_size // 32  # Q8_0: a scale per 32 columns
    assert [layer.self_attn.qkv_proj.scheme for layer in m.model.layers] == ["int4", "int8", "int4"]
    ref, _ = _greedy(gguf_folder)
    assert kept == ref


def test_gguf_split_over_two_pipeline_stages(gguf_folder):
    """Kept quantized on each stage: stage 0 its layers and the Q8_0 embedding (tied LM head), stage 1 the rest."""
    two, llm = _greedy(gguf_folder, quantization="gguf", pipeline_parallel_size=2)
    try:
        m = llm.engine.executor.model
        assert isinstance(m.model.embed_tokens, QuantEmbedding) and len(m.model.held_layers()) == 1
        ref, _ = _greedy(gguf_folder, quantization="gguf")
        assert two == ref
    finally:
        llm.close()


def test_gguf_sharded_over_two_tensor_parallel_ranks(gguf_folder):
    """Kept quantized on each rank: its rows of the column-parallel projections, its 32-column
    blocks of the row-parallel ones, its vocab rows of the Q8_0 embedding (the tied LM head)."""
    two, llm = _greedy(gguf_folder, quantization="gguf", tensor_parallel_size=2)
    try:
        m = llm.engine.executor.model
        assert isinstance(m.model.embed_tokens, QuantEmbedding)
        assert m.model.layers[0].self_attn.o_proj.in_features == m.cfg.hidden_size // 2
        ref, _ = _greedy(gguf_folder, quantization="gguf")
        assert two == ref
    finally:
        llm.close()


@pytest.mark.skipif(not native.has_quant_gemm(), reason="needs the quantized CPU kernel (AVX2, a C++ compiler)")
def test_gguf_decode_stack_equals_layer_loop(gguf_folder, stack_calls, monkeypatch):
    """Q4_0, Q4_1 and Q8_0 layers mixed in one model: batch-1 decode steps run the whole
    layer stack as one C++ op (layers/csrc/decode_stack.cpp) with the layer loop's bits."""
    tokens, _ = stack_then_loop(lambda: LLM(str(gguf_folder), progress=False, num_blocks=64,
                                            quantization="gguf").engine, PROMPTS, stack_calls, monkeypatch)
    assert tokens == [seq[:12] for seq in _greedy(gguf_folder, quantization="gguf")[0]]


def test_gguf_fingerprint_and_errors(gguf_folder, tiny_llama):
    ids = [quantization_id(gguf_folder, q, None) for q in (None, "int4", "gguf")]
    assert ids[2]["method"] == "gguf" and ids[2]["file"] == "model.gguf"
    fps = {model_fingerprint(gguf_folder, {"dtype": "float32", "block_size": 16, "quantization": i}) for i in ids}
    assert len(fps) == 3
    with pytest.raises(ConfigError, match="quantization_group_size"):
        quantization_id(gguf_folder, "gguf", 32)
    with pytest.raises(ConfigError, match=r"\*\.gguf"):
        quantization_id(tiny_llama, "gguf", None)  # a folder without a GGUF


def test_unsupported_gguf_type_names_the_supported_ones(tmp_path, tiny_llama):
    from kvmesh.models.loader import load_arch_config

    cfg = load_arch_config(tiny_llama)
    meta = {"add_block_count": cfg.num_layers, "add_embedding_length": cfg.hidden_size,
            "add_head_count": cfg.num_heads, "add_head_count_kv": cfg.num_kv_heads}
    _write(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (np.ones((64, 64), np.float32), T.Q5_0)}, meta)
    with pytest.raises(ConfigError, match=r"Q5_0.*Q4_0.*Q4_1.*Q8_0"):
        read_gguf(tmp_path / "m.gguf", cfg)
    _write(tmp_path / "bad.gguf", {}, {"add_block_count": cfg.num_layers + 1})
    with pytest.raises(ConfigError, match="does not match"):
        read_gguf(tmp_path / "bad.gguf", cfg)


@pytest.mark.slow
def test_embedded_gguf_greedy_equals_float32():
    """SmolLM2's own Q4_1 / Q8_0 tensors kept quantized vs the fp32 folder converted from them."""
    torch.set_num_threads(2)
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=8, temperature=0)
    out = {}
    for q in (None, "gguf"):
        llm = LLM(progress=False, num_blocks=32, max_model_len=256, quantization=q)
        out[q] = llm.generate([prompt], params)[0].outputs[0]
        if q == "gguf":
            m = llm.engine.executor.model
            assert m.model.layers[0].self_attn.qkv_proj.mins is not None  # Q4_1
            assert m.lm_head is m.model.embed_tokens.head  # Q8_0, tied
        del llm
    assert out["gguf"].token_ids == out[None].token_ids
    assert out["gguf"].text.startswith(" Paris")
