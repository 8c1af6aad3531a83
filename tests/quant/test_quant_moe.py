"""Quantized MoE experts (quant/moe.py): int8 / int4 QuantFusedMoE equal the float layer on
their dequantized weights (native kernel and dequantize paths), stay within the scheme's
quantization error of the float layer, and the loader's swap quantizes streamed expert
tensors (per expert and fused) while the router gate stays float; tiny Mixtral / Qwen3-MoE
engines with --quantization int8 / int4 stay within the quantization error of transformers."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_step_logits, run_collecting_logits
from torch import nn
from transformers import AutoModelForCausalLM

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.config import KernelConfig
from kvmesh.layers.linear import Linear
from kvmesh.layers.moe import FusedMoE
from kvmesh.layers.op import OpContext
from kvmesh.quant.loader import _route_experts, _swap_experts
from kvmesh.quant.methods import get_method
from kvmesh.quant.moe import QuantFusedMoE

E, K, H, I = 8, 2, 64, 96
METHODS = [("int8", None), ("int4", 32), ("int4", 64)]


def float_moe(dtype=torch.float32, seed=0) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(E, K, H, I, renormalize=True, ctx=OpContext(dtype=dtype))
    with torch.no_grad():
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=g) * 0.1)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=g) * 0.1)
    return moe


def quantized(moe: FusedMoE, scheme: str, group: int | None, native: bool = True, per_expert: bool = False):
    method = get_method(scheme, group)
    kernels = KernelConfig(quantized_cpu_gemm=native)
    ctx = OpContext(dtype=moe.ctx.dtype, kernels=kernels)
    q = QuantFusedMoE(method.linear_scheme(), E, K, H, I, renormalize=True, quantize=method.quantize_linear, ctx=ctx,
                      native_gemm=native)
    w13, w2 = moe.w13.detach().float(), moe.w2.detach().float()
    if per_expert:
        for e in range(E):
            q.weight_loader(None, w13[e, :I], e, "gate")
            q.weight_loader(None, w13[e, I:], e, "up")
            q.weight_loader(None, w2[e], e, "down")
    else:
        q.weight_loader(None, w13, None, "gate_up")
        q.weight_loader(None, w2, None, "down")
    q.finalize(moe.ctx.dtype)
    return q


def inputs(t: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(t)
    return torch.randn(t, H, generator=g).to(dtype), torch.randn(t, E, generator=g).to(dtype)


@pytest.mark.parametrize("scheme, group", METHODS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "dequant"])
@pytest.mark.parametrize("per_expert", [False, True], ids=["fused", "per_expert"])
def test_equals_float_layer_on_dequantized_weights(scheme, group, native, per_expert):
    q = quantized(float_moe(), scheme, group, native, per_expert)
    ref = FusedMoE(E, K, H, I, renormalize=True)
    ref.weight_loader(ref.w13, q.dequantized("w13"), None, "gate_up")
    ref.weight_loader(ref.w2, q.dequantized("w2"), None, "down")
    for t in (1, 5, 48):  # 48 rows over 8 experts: some expert groups past the native kernel's 32 rows
        x, logits = inputs(t)
        with torch.no_grad():
            want, out = ref(x, logits), q(x, logits)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# Relative output error of two quantized GEMMs on gaussian weights: rounding to a step s
# (half a step at most, the bound test_quant_modules checks) is s / sqrt(12) rms, with
# s = max|w| / 127 for int8 (~0.7% of the weights' rms per GEMM, ~1% for the pair) and
# (max - min) / 15 per group for int4 (~8-10% per GEMM, ~14-16% for the pair); bounds 1.4x.
@pytest.mark.parametrize("scheme, group, bound", [("int8", None, 0.015), ("int4", 32, 0.21), ("int4", 64, 0.22)])
def test_within_quantization_error_of_the_float_layer(scheme, group, bound):
    moe = float_moe()
    q = quantized(moe, scheme, group)
    for t in (1, 7, 64):
        x, logits = inputs(t)
        with torch.no_grad():
            want, out = moe(x, logits), q(x, logits)
        rel = ((out - want).norm() / want.norm()).item()
        assert rel < bound, (t, rel)


def test_bf16_activations():
    moe = float_moe(torch.bfloat16)
    q = quantized(moe, "int8", None)
    x, logits = inputs(7, torch.bfloat16)
    with torch.no_grad():
        want, out = moe(x, logits).float(), q(x, logits)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - want).norm() / want.norm()) < 0.02


def test_quantized_experts_take_a_fraction_of_the_bytes():
    moe = float_moe()
    weights, rows = moe.w13.numel() + moe.w2.numel(), E * (2 * I + H)
    assert quantized(moe, "int8", None).weight_bytes() == weights + 4 * rows  # + a float32 scale per row
    assert quantized(moe, "int4", 32).weight_bytes() == weights // 2 + weights // 32 * 4  # + fp16 scale, zero


def test_missing_experts_are_named():
    method = get_method("int8")
    q = QuantFusedMoE("int8", E, K, H, I, renormalize=True, quantize=method.quantize_linear)
    q.weight_loader(None, torch.randn(E, 2 * I, H), None, "gate_up")
    q.weight_loader(None, torch.randn(H, I), 0, "down")
    with pytest.raises(ValueError, match="expert 1 down"):
        q.finalize(torch.float32)


class _Block(nn.Module):
    def __init__(self, prefix_name: str):
        super().__init__()
        self.gate = Linear(H, E, bias=False)
        setattr(self, prefix_name, FusedMoE(E, K, H, I, renormalize=True))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _Block("experts")


class _Model(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Layer() for _ in range(layers))


@pytest.mark.parametrize("names", ["mixtral", "qwen3_moe", "fused"])
def test_loader_quantizes_streamed_expert_tensors(names):
    """The swap replaces each FusedMoE (the router gate stays a float Linear); expert tensors
    under any MoE block name (Mixtral's block_sparse_moe.experts.N.w1/w3/w2, Qwen3-MoE's
    mlp.experts.N.gate/up/down_proj, transformers 5.x fused) are quantized into it, the other
    tensors pass through."""
    model = _Model(2)
    float_layers = [float_moe(seed=i) for i in range(2)]
    method = get_method("int4", 32)
    experts = _swap_experts(model, method, torch.device("cpu"))
    assert sorted(experts) == ["model.layers.0", "model.layers.1"]
    assert isinstance(model.model.layers[1].mlp.experts, QuantFusedMoE)
    assert isinstance(model.model.layers[1].mlp.gate, Linear)

    def stream():
        for li, f in enumerate(float_layers):
            w13, w2 = f.w13.detach(), f.w2.detach()
            yield f"model.layers.{li}.mlp.gate.weight", torch.zeros(E, H)
            if names == "fused":
                yield f"model.layers.{li}.mlp.experts.gate_up_proj", w13
                yield f"model.layers.{li}.mlp.experts.down_proj", w2
                continue
            block, (g, u, d) = (("block_sparse_moe", ("w1", "w3", "w2")) if names == "mixtral"
                                else ("mlp", ("gate_proj", "up_proj", "down_proj")))
            for e in range(E):
                yield f"model.layers.{li}.{block}.experts.{e}.{g}.weight", w13[e, :I]
                yield f"model.layers.{li}.{block}.experts.{e}.{u}.weight", w13[e, I:]
                yield f"model.layers.{li}.{block}.experts.{e}.{d}.weight", w2[e]

    rest = list(method.quantize_state_dict(_route_experts(stream(), experts), tie_word_embeddings=False))
    assert [n for n, _ in rest] == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    for li, f in enumerate(float_layers):
        q = model.model.layers[li].mlp.experts
        q.finalize(torch.float32)
        want = quantized(f, "int4", 32)
        for p in ("w13", "w2"):
            assert torch.equal(q.dequantized(p), want.dequantized(p))


@pytest.mark.parametrize("arch, extra", [("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": True})])
def test_engine_quantizes_the_experts_of_moe_models(model_factory, arch, extra):
    """--quantization int8 / int4 on a tiny random Mixtral / Qwen3-MoE: every FusedMoE becomes
    a QuantFusedMoE of the scheme, the router gates stay float Linears, and the logits stay
    within the quantization error. The bounds are looser than the dense layouts' (int8 0.08,
    int4 0.8 of the logit scale in tests/models/test_architectures.py): a perturbed hidden
    state flips near-tied routing choices. On the Mixtral here int8 reaches 0.12 with the
    experts quantized and 0.11 with only the attention quantized (experts float), and a
    float FusedMoE holding the dequantized experts gives the int8 engine's logits exactly."""
    torch.set_num_threads(1)
    path = model_factory(architecture=arch, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         extra=extra)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 33)]
    for scheme, bound in (("int8", 0.2), ("int4", 1.0)):
        engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128, quantization=scheme)
        model = engine.executor.runner.model
        experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
        gates = [m for n, m in model.named_modules() if n.endswith(".mlp.gate")]
        assert experts and all(isinstance(m, QuantFusedMoE) and m.scheme == scheme for m in experts)
        assert len(gates) == len(experts) and all(type(m) is Linear for m in gates)
        assert not any(isinstance(m, FusedMoE) for m in model.modules())
        tokens, logits = run_collecting_logits(engine, prompts, SamplingParams(max_tokens=4, temperature=0,
                                                                               ignore_eos=True))
        for i, prompt in enumerate(prompts):
            ref = hf_step_logits(hf, prompt, tokens[f"r{i}"])
            err = (torch.stack(logits[f"r{i}"]) - ref).abs().max() / ref.abs().max()
            assert err <= bound, (scheme, i, err)
