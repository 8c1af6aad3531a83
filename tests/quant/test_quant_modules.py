"""Quantized Linear modules against dequantize-then-matmul, and quantizer error bounds."""

from __future__ import annotations

import pytest
import torch

from kvmesh.layers import native
from kvmesh.quant import get_method, kernels
from kvmesh.quant.modules import QuantEmbedding, QuantLinear
from kvmesh.quant.primitives import (dequantize_int4, dequantize_int8, pack_int4, quantize_int4, quantize_int8,
                                     unpack_int4)

torch.set_num_threads(1)

SHAPES = [(64, 64), (96, 128), (256, 576), (48, 1536)]  # (out, in)
ROWS = [1, 3, 16, 64, 300]


def _module(method_name: str, w: torch.Tensor, group_size: int | None = None, bias: bool = False) -> QuantLinear:
    method = get_method(method_name, group_size)
    out_f, in_f = w.shape
    m = QuantLinear(method.linear_scheme(), in_f, out_f, bias=bias)
    m.load(method.quantize_linear(w))
    if bias:
        m.load_bias(torch.randn(out_f))
    m.finalize(torch.float32)
    return m


@pytest.mark.parametrize("path", ["native", "dequant"])
@pytest.mark.parametrize("method,group", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_quant_linear_matches_dequantize_then_matmul(method, group, path, monkeypatch):
    if path == "native" and not native.has_quant_gemm():
        pytest.skip("native kernel unavailable on this CPU / without a C compiler")
    if path == "dequant":
        monkeypatch.setattr(kernels, "NATIVE_MAX_ROWS", -1)
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in SHAPES:
        if group and in_f % group:
            continue
        w = torch.randn(out_f, in_f, generator=g) * 0.05
        m = _module(method, w, group, bias=True)
        ref_w = m.dequantized_weight()
        for rows in ROWS:
            x = torch.randn(rows, in_f, generator=g)
            y = m(x)
            ref = x.double() @ ref_w.double().t() + m.bias.double()
            err = (y.double() - ref).abs().max().item()
            assert err <= 1e-5 * max(ref.abs().max().item(), 1.0), (out_f, in_f, rows, err)


def test_bfloat16_activations():
    w = torch.randn(64, 128) * 0.05
    for method, group in (("int8", None), ("int4", 32)):
        m = _module(method, w, group)
        x = torch.randn(3, 128)
        y = m(x.bfloat16())
        assert y.dtype == torch.bfloat16
        ref = x @ m.dequantized_weight().t()
        assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_int8_error_is_at_most_half_a_step():
    w = torch.randn(37, 200) * torch.rand(37, 1)
    q, s = quantize_int8(w)
    err = (dequantize_int8(q, s) - w).abs()
    assert bool((err <= s[:, None] * 0.5 + 1e-7).all())
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_is_about_half_a_step(group):
    w = torch.randn(16, 256) + torch.linspace(-2, 2, 256)  # groups with offsets: asymmetric pays off
    q, s, z = quantize_int4(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    err = (dequantize_int4(q, s, z) - w).abs().reshape(16, -1, group)
    # half a step, plus the float16 rounding of the stored zero point (<= 16 * 2^-11 steps)
    assert bool((err <= s.float()[..., None] * 0.51).all())
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_unsupported_group_size_names_the_field():
    with pytest.raises(ValueError, match="group_size"):
        get_method("int4", 48)
    with pytest.raises(ValueError, match="group_size"):
        get_method("int8", 32)
    with pytest.raises(ValueError, match=r"quantization: unknown method 'int3'.*int4.*int8"):
        get_method("int3")


def test_fused_shards_load_into_their_rows():
    g = torch.Generator().manual_seed(1)
    q_w, k_w = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g)
    method = get_method("int4", 32)
    fused = QuantLinear("int4", 64, 96, bias=False, shards={"q": (0, 64), "k": (64, 32)})
    fused.load(method.quantize_linear(k_w), "k")
    assert fused.missing() == ["q"]
    fused.load(method.quantize_linear(q_w), "q")
    fused.finalize(torch.float32)
    ref = torch.cat([_module("int4", q_w, 32).dequantized_weight(), _module("int4", k_w, 32).dequantized_weight()])
    assert torch.equal(fused.dequantized_weight(), ref)


def test_quant_embedding_gathers_dequantized_rows():
    w = torch.randn(50, 32)
    emb = QuantEmbedding(50, 32)
    q, s = quantize_int8(w)
    emb.head.load({"qweight": q, "scales": s})
    emb.finalize(torch.float32)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(emb(ids), dequantize_int8(q, s)[ids])
