"""csrc/decode_stack.cpp: the whole decoder stack of a batch-1 decode step as one C++ op.

It runs the same kernels as the layer-by-layer path, in the same order, so the engine's
logits must be bit-identical with and without it; and the engine's greedy output with it
must equal transformers' (the oracle) on tiny random models of every supported shape."""

import pytest
import torch

from helpers import assert_logits_close, hf_greedy, hf_step_logits, run_collecting_logits
from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.layers import cpu_kernels
from kvmesh.layers.attention import CpuPagedAttentionBackend
from kvmesh.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels need a C++ compiler")
MAX_NEW = 12


@pytest.fixture
def stack_calls(monkeypatch):
    """Counts the forward passes that ran as one decode_stack call."""
    calls = []
    original = LlamaForCausalLM._decode_stack_params

    def spy(self, h, meta, backend):
        params = original(self, h, meta, backend)
        calls.append(params is not None)
        return params

    monkeypatch.setattr(LlamaForCausalLM, "_decode_stack_params", spy)
    return calls


def _one_at_a_time(engine, prompts):
    """Each prompt alone (batch-1 decode), greedy: ({rid: tokens}, {rid: [logits]})."""
    tokens, logits = {}, {}
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        t, lg = run_collecting_logits(engine, [prompt], params)
        tokens[f"p{i}"], logits[f"p{i}"] = t["r0"], torch.stack(lg["r0"])
    assert engine.num_free_blocks == engine.num_usable_blocks
    return tokens, logits


CONFIGS = {
    "llama-gqa-untied": dict(),
    "llama-tied-qkv-bias": dict(tie_word_embeddings=True, qkv_bias=True),
    "qwen2-one-kv-head": dict(architecture="qwen2", num_kv_heads=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stack_equals_layer_loop_and_transformers(model_factory, stack_calls, monkeypatch, name):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = model_factory(**CONFIGS[name])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    # Lengths around the block size (4): the decode tokens cross block boundaries.
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (1, 4, 13, 30)]
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128)
    stack_calls.clear()  # (building warms the engine up)

    tokens, logits = _one_at_a_time(engine, prompts)
    ran = sum(stack_calls)
    # Every decode step, and the one-token prompt's prefill (a one-token step too).
    assert ran == len(prompts) * (MAX_NEW - 1) + 1, "every decode step should run as one decode_stack call"
    for rid, prompt in zip(tokens, prompts):
        assert tokens[rid] == hf_greedy(hf, prompt, MAX_NEW), f"{rid} (len {len(prompt)})"
        assert_logits_close(logits[rid], hf_step_logits(hf, prompt, tokens[rid]))

    # The layer-by-layer path on a fresh engine (the first one's prefix cache would change
    # how the prompts are prefilled): the same bits.
    monkeypatch.setattr(CpuPagedAttentionBackend, "runs_decode_stack", False)
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128)
    loop_tokens, loop_logits = _one_at_a_time(engine, prompts)
    assert sum(stack_calls) == ran
    assert loop_tokens == tokens
    for rid in tokens:
        assert torch.equal(loop_logits[rid], logits[rid]), rid


def test_batched_decode_and_prefill_steps_take_the_layer_loop(model_factory, stack_calls):
    path = model_factory()
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128)
    stack_calls.clear()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run_collecting_logits(engine, [[5, 6, 7], [8, 9, 10, 11, 12]], params)
    # Both requests are prefilled in one step and decode together: no step qualifies.
    assert stack_calls and not any(stack_calls)
    assert engine.num_free_blocks == engine.num_usable_blocks


def _random_stack(t: int, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(t)
    inter, bs, nb = 48, 4, 16
    weights, biases = [], []
    for _ in range(layers):
        weights += [1 + 0.1 * torch.randn(hidden, generator=g), 0.2 * torch.randn((heads + 2 * kv_heads) * d, hidden, generator=g),
                    0.2 * torch.randn(hidden, heads * d, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g),
                    0.2 * torch.randn(2 * inter, hidden, generator=g), 0.2 * torch.randn(hidden, inter, generator=g)]
        biases += [0.1 * torch.randn((heads + 2 * kv_heads) * d, generator=g), None, None, None]
    caches = [(torch.randn(nb, bs, kv_heads, d, generator=g), torch.randn(nb, bs, kv_heads, d, generator=g))
              for _ in range(layers)]
    ang = torch.randn(t, 1, d // 2, generator=g)
    ang = torch.cat((ang, ang), dim=-1)
    ctx = torch.tensor([5, 9, 2, 16][:t])
    tables = torch.stack([torch.randperm(nb, generator=g)[:4] for _ in range(t)])
    slots = torch.stack([tables[i, (ctx[i] - 1) // bs] * bs + (ctx[i] - 1) % bs for i in range(t)])
    return dict(h=torch.randn(t, hidden, generator=g), cos=ang.cos(), sin=ang.sin(), weights=weights, biases=biases,
                caches=caches, slots=slots, tables=tables, ctx=ctx, heads=heads, kv_heads=kv_heads, scale=d**-0.5)


def _call_stack(a, caches):
    return torch.ops.kvmesh.decode_stack(
        a["h"], a["cos"], a["sin"], a["weights"], a["biases"], [k for k, _ in caches], [v for _, v in caches],
        a["slots"], a["tables"], a["ctx"], a["heads"], a["kv_heads"], 1e-6, a["scale"])


@pytest.mark.parametrize("t", [1, 3])
def test_op_matches_the_separate_kernels(t):
    """Up to 4 tokens (one per sequence): the op equals the same kernels called one by one,
    and writes each token's K / V into its slot."""
    a = _random_stack(t)
    ops = torch.ops.kvmesh
    caches = [(k.clone(), v.clone()) for k, v in a["caches"]]
    h = a["h"]
    for layer, (kc, vc) in enumerate(caches):
        w, b = a["weights"][6 * layer: 6 * layer + 6], a["biases"][4 * layer: 4 * layer + 4]
        q, k, v = ops.rope_qkv(ops.skinny_linear(ops.rms_norm(h, w[0], 1e-6), w[1], b[0]), a["cos"], a["sin"],
                               a["heads"], a["kv_heads"])
        kc.view(-1, *kc.shape[2:]).index_copy_(0, a["slots"], k)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, a["slots"], v)
        o = ops.paged_decode_attention(q, kc, vc, a["tables"], a["ctx"], a["scale"])
        h, x = ops.add_rms_norm(h, ops.skinny_linear(o.view(t, -1), w[2], b[1]), w[3], 1e-6)
        h = h + ops.skinny_linear(ops.silu_and_mul(ops.skinny_linear(x, w[4], b[2])), w[5], b[3])
    stack_caches = [(k.clone(), v.clone()) for k, v in a["caches"]]
    out = _call_stack(a, stack_caches)
    assert torch.equal(out, h)
    for (k1, v1), (k2, v2) in zip(stack_caches, caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_bad_arguments_raise_clear_errors():
    a = _random_stack(1)
    with pytest.raises(RuntimeError, match="6 weights, 4 biases"):
        torch.ops.kvmesh.decode_stack(a["h"], a["cos"], a["sin"], a["weights"][:-1], a["biases"],
                                      [k for k, _ in a["caches"]], [v for _, v in a["caches"]], a["slots"],
                                      a["tables"], a["ctx"], a["heads"], a["kv_heads"], 1e-6, a["scale"])
    a["slots"] = torch.tensor([10_000])
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        _call_stack(a, a["caches"])
    a = _random_stack(1)
    a["h"] = torch.randn(5, 32)
    with pytest.raises(RuntimeError, match="T <= 4"):
        _call_stack(a, a["caches"])
