"""GPTQ / AWQ checkpoints built here with the published packing loops: unpack exactly,
and load into the engine with greedy output equal to the dequantized float32 model."""

from __future__ import annotations

import pytest
import torch
from quant_packers import dequant_reference, pack_awq, pack_gptq, random_int4_layer, write_quantized_checkpoint

from kvmesh.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.quant.formats import AWQFormat, GPTQFormat, format_from_config
from kvmesh.quant.modules import QuantLinear
from kvmesh.quant.primitives import unpack_int4

torch.set_num_threads(1)


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_unpacks_to_the_packed_integers(desc_act, v1):
    q, z, s, g_idx = random_int4_layer(48, 128, 32, seed=3, desc_act=desc_act)
    z[0, :5] = 0  # v1 stores zero - 1: a zero of 0 wraps to 15 and reads back as 16
    canon = GPTQFormat(32, zero_offset=1 if v1 else 0).convert("layer", pack_gptq(q, z, s, g_idx, v1=v1))
    perm = canon.get("perm")
    assert (perm is not None) == desc_act
    expect_q = q[:, perm] if desc_act else q
    assert torch.equal(unpack_int4(canon["qweight"]), expect_q.to(torch.uint8))
    expect_z = z.clone()
    if v1:
        expect_z[z == 0] = 16  # AutoGPTQ's v1 behaviour, reproduced exactly
    assert torch.equal(canon["zeros"].float(), expect_z.t().float())
    assert torch.equal(canon["scales"], s.t())
    m = QuantLinear("int4", 128, 48, bias=False)
    m.load(canon)
    m.finalize(torch.float32)
    ref = dequant_reference(q, expect_z, s, g_idx)
    assert torch.equal(m.dequantized_weight(), ref)


def test_awq_unpacks_to_the_packed_integers():
    q, z, s, _ = random_int4_layer(64, 96, 32, seed=4)
    canon = AWQFormat(32).convert("layer", pack_awq(q, z, s))
    assert torch.equal(unpack_int4(canon["qweight"]), q.to(torch.uint8))
    assert torch.equal(canon["zeros"].float(), z.t().float())
    assert "perm" not in canon


def test_unsupported_configs_name_the_field():
    with pytest.raises(ValueError, match="quantization_config.bits"):
        format_from_config({"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ValueError, match="quantization_config.version"):
        format_from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    with pytest.raises(ValueError, match="quantization_config.quant_method"):
        format_from_config({"quant_method": "bitsandbytes"})


PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41], list(range(3, 40))]


def greedy(path, **kw) -> list[list[int]]:
    llm = LLM(str(path), progress=False, num_blocks=64, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind,desc_act", [("gptq", False), ("gptq", True), ("awq", False)])
def test_checkpoint_greedy_equals_dequantized_float_model(kind, desc_act, tiny_llama, tmp_path):
    out = write_quantized_checkpoint(tiny_llama, tmp_path / kind, kind, group=32, desc_act=desc_act)
    assert greedy(out) == greedy(out / "dequantized")


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_checkpoint_split_over_two_pipeline_stages(kind, tiny_llama, tmp_path):
    """A stored 4-bit checkpoint loads as stored on each pipeline stage (its own layers' modules)."""
    out = write_quantized_checkpoint(tiny_llama, tmp_path / kind, kind, group=32)
    assert greedy(out, pipeline_parallel_size=2) == greedy(out)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_checkpoint_sharded_over_two_tensor_parallel_ranks(kind, tiny_llama, tmp_path):
    """A stored 4-bit checkpoint at TP=2: each rank cuts its rows (column-parallel) or its
    input groups (row-parallel) out of the converted tensors: the same greedy text as TP=1."""
    out = write_quantized_checkpoint(tiny_llama, tmp_path / kind, kind, group=32)
    assert greedy(out, tensor_parallel_size=2) == greedy(out)


def test_act_order_row_parallel_and_straddling_groups_are_refused(tiny_llama, tmp_path):
    from kvmesh.errors import ConfigError

    act = write_quantized_checkpoint(tiny_llama, tmp_path / "act", "gptq", group=32, desc_act=True)
    with pytest.raises(ConfigError, match="act-order"):
        greedy(act, tensor_parallel_size=2)
    wide = write_quantized_checkpoint(tiny_llama, tmp_path / "wide", "gptq", group=64)  # o_proj: 32 inputs a rank
    with pytest.raises(ConfigError, match="straddle"):
        greedy(wide, tensor_parallel_size=2)
