"""csrc/decode_stack.cpp: the whole decoder stack of a batch-1 decode step as one C++ op.

It runs the same kernels as the layer-by-layer path, in the same order, so the engine's
logits must be bit-identical with and without it, for float32 and bf16 models and
for kvmesh's int8 / int4 weights; and the engine's greedy output with it must equal transformers' (the
oracle) on tiny random models of every supported shape."""

import pytest
import torch
from helpers import assert_logits_close, hf_greedy, hf_step_logits, run_collecting_logits, stack_then_loop

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.layers import native
from kvmesh.layers.attention import CpuPagedAttentionBackend
from kvmesh.layers.linear import SKINNY_KERNEL_ROWS, STACK_DENSE
from kvmesh.llm import LLM

pytestmark = pytest.mark.skipif(not native.load(), reason="CPU kernels need a C++ compiler")
MAX_NEW = 12


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(1)
    # Lengths around the block size (4): the decode tokens cross block boundaries.
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 4, 13, 30)]


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
    prompts = _prompts(hf.config.vocab_size)
    tokens, logits = stack_then_loop(
        lambda: build_engine(model=str(path), progress=False, block_size=4, num_blocks=128), prompts,
        stack_calls, monkeypatch)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i} (len {len(prompt)})"
        assert_logits_close(logits[i], hf_step_logits(hf, prompt, tokens[i]))


@pytest.mark.skipif(not native.has_quant_gemm(), reason="the quantized CPU kernel needs AVX2")
@pytest.mark.parametrize("method,group", [("int8", None), ("int4", 32), ("int4", 64)])
def test_quantized_stack_equals_layer_loop(model_factory, stack_calls, monkeypatch, method, group):
    """int8 / int4 projections run kvmesh's quantized kernel inside the stack: same bits."""
    torch.set_num_threads(1)
    path = model_factory(qkv_bias=True)
    stack_then_loop(
        lambda: LLM(str(path), progress=False, block_size=4, num_blocks=128, quantization=method,
                    quantization_group_size=group).engine,
        _prompts(384), stack_calls, monkeypatch)


def _batch_stack_equals_loop(path, prompts, stack_calls, monkeypatch, num_blocks=128):
    """All `prompts` at once with the stack, then without: every decode step ran the stack
    (the prompts are prefilled in the first step, each later step decodes all of them), the
    same tokens and logits bit for bit, every block back."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    runs = []
    for stack in (True, False):
        with monkeypatch.context() as m:
            m.setattr(CpuPagedAttentionBackend, "runs_decode_stack", stack)
            engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=num_blocks)
            stack_calls.clear()
            runs.append(run_collecting_logits(engine, prompts, params))
            assert engine.num_free_blocks == engine.num_usable_blocks
        if stack:
            assert sum(stack_calls) == MAX_NEW - 1
    (tok_a, lg_a), (tok_b, lg_b) = runs
    assert tok_a == tok_b
    for rid in lg_a:
        assert all(torch.equal(x, y) for x, y in zip(lg_a[rid], lg_b[rid])), rid


def test_multi_sequence_decode_steps_run_the_stack_bit_for_bit(model_factory, stack_calls, monkeypatch):
    """Decodes of up to SKINNY_KERNEL_ROWS sequences in one step run the stack too (every
    linear of such a step takes the skinny GEMM either way): the same bits as the loop."""
    torch.set_num_threads(1)
    # prompts of 4, 13 and 30 tokens, and more up to SKINNY_KERNEL_ROWS sequences
    prompts = (_prompts(384)[1:] + [[7, 8, 9, 10, 11], [12, 13]])[:SKINNY_KERNEL_ROWS]
    _batch_stack_equals_loop(model_factory(qkv_bias=True), prompts, stack_calls, monkeypatch)


@pytest.mark.parametrize("n", [6, 8, 13])
def test_small_gemm_decode_steps_run_the_stack_bit_for_bit(model_factory, stack_calls, monkeypatch, n):
    """Decode steps of as many sequences as the small-batch GEMM's window takes (5-64) run
    the stack in a float32 model, its linears on that GEMM as `Linear` runs them: the same
    bits as the layer loop; bf16 models keep the loop for them."""
    torch.set_num_threads(1)
    path = model_factory(qkv_bias=True)
    g = torch.Generator().manual_seed(n)
    prompts = [torch.randint(3, 384, (int(k),), generator=g).tolist() for k in torch.randint(1, 20, (n,), generator=g)]
    _batch_stack_equals_loop(path, prompts, stack_calls, monkeypatch, num_blocks=256)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    bf16 = build_engine(model=str(path), progress=False, block_size=4, num_blocks=256, dtype="bfloat16")
    stack_calls.clear()
    run_collecting_logits(bf16, prompts, params)
    assert stack_calls and not any(stack_calls)


def test_larger_batches_and_prefill_steps_take_the_layer_loop(model_factory, stack_calls):
    path = model_factory()
    # Without the small-batch GEMM, one more row than the skinny GEMM takes has no stack form.
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=128, small_gemm=False)
    stack_calls.clear()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21], [22, 23]]
    run_collecting_logits(engine, prompts[: SKINNY_KERNEL_ROWS + 1], params)
    # All prefilled in one step (the layer loop), then decoding together: no step qualifies.
    assert stack_calls and not any(stack_calls)
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_bf16_stack_equals_layer_loop(model_factory, stack_calls, monkeypatch):
    """bf16 weights, activations and KV cache: the same kernels in the model dtype."""
    torch.set_num_threads(1)
    path = model_factory(qkv_bias=True)
    stack_then_loop(lambda: build_engine(model=str(path), progress=False, block_size=4, num_blocks=128,
                                         dtype="bfloat16"), _prompts(384), stack_calls, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_kv_stack_equals_layer_loop(model_factory, stack_calls, monkeypatch, dtype):
    """An int8 KV cache: the stack quantizes each step's K / V with the loop's writer and reads
    them with the loop's int8 kernel, so the bits are the same."""
    torch.set_num_threads(1)
    path = model_factory(qkv_bias=True)
    stack_then_loop(lambda: build_engine(model=str(path), progress=False, block_size=4, num_blocks=128,
                                         dtype=dtype, kv_cache_dtype="int8"),
                    _prompts(384), stack_calls, monkeypatch)


def _random_stack(t: int, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(t)
    inter, bs, nb = 48, 4, max(16, 4 * t)
    norms, linears, biases = [], [], []
    for _ in range(layers):
        norms += [1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)]
        linears += [0.2 * torch.randn((heads + 2 * kv_heads) * d, hidden, generator=g),
                    0.2 * torch.randn(hidden, heads * d, generator=g), 0.2 * torch.randn(2 * inter, hidden, generator=g),
                    0.2 * torch.randn(hidden, inter, generator=g)]
        biases += [0.1 * torch.randn((heads + 2 * kv_heads) * d, generator=g), None, None, None]
    caches = [(torch.randn(nb, bs, kv_heads, d, generator=g), torch.randn(nb, bs, kv_heads, d, generator=g))
              for _ in range(layers)]
    ang = torch.randn(t, 1, d // 2, generator=g)
    ang = torch.cat((ang, ang), dim=-1)
    ctx = torch.tensor([5, 9, 2, 16][:t]) if t <= 4 else torch.randint(1, 17, (t,), generator=g)
    tables = torch.randperm(nb, generator=g)[: 4 * t].view(t, 4)  # distinct blocks: no slot written twice
    slots = torch.stack([tables[i, (ctx[i] - 1) // bs] * bs + (ctx[i] - 1) % bs for i in range(t)])
    return dict(h=torch.randn(t, hidden, generator=g), cos=ang.cos(), sin=ang.sin(), norms=norms, linears=linears,
                kinds=[STACK_DENSE] * len(linears), biases=biases, caches=caches,
                slots=slots, tables=tables, ctx=ctx, heads=heads, kv_heads=kv_heads, scale=d**-0.5,
                skinny_rows=SKINNY_KERNEL_ROWS)


def _call_stack(a, caches):
    return torch.ops.kvmesh.decode_stack(
        a["h"], a["cos"], a["sin"], a["norms"], a["linears"], a["kinds"], a["biases"],
        [k for k, _ in caches], [v for _, v in caches], a["slots"], a["tables"], a["ctx"], a["heads"],
        a["kv_heads"], 1e-6, a["scale"], a["skinny_rows"], [], [])


@pytest.mark.parametrize("t", [1, 3, 8, 21])
def test_op_matches_the_separate_kernels(t):
    """The op equals the same kernels called one by one (the skinny GEMM up to
    skinny_rows tokens, one per sequence, the small-batch GEMM above), and writes each
    token's K / V into its slot."""
    a = _random_stack(t)
    ops = torch.ops.kvmesh
    gemm = ops.skinny_linear if t <= a["skinny_rows"] else ops.small_linear
    caches = [(k.clone(), v.clone()) for k, v in a["caches"]]
    h = a["h"]
    for layer, (kc, vc) in enumerate(caches):
        n, w, b = a["norms"][2 * layer:], a["linears"][4 * layer:], a["biases"][4 * layer:]
        q, k, v = ops.rope_qkv(gemm(ops.rms_norm(h, n[0], 1e-6), w[0], b[0]), a["cos"], a["sin"],
                               a["heads"], a["kv_heads"])
        kc.view(-1, *kc.shape[2:]).index_copy_(0, a["slots"], k)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, a["slots"], v)
        o = ops.paged_decode_attention(q, kc, vc, a["tables"], a["ctx"], a["scale"])
        h, x = ops.add_rms_norm(h, gemm(o.view(t, -1), w[1], b[1]), n[1], 1e-6)
        h = h + gemm(ops.silu_and_mul(gemm(x, w[2], b[2])), w[3], b[3])
    stack_caches = [(k.clone(), v.clone()) for k, v in a["caches"]]
    out = _call_stack(a, stack_caches)
    assert torch.equal(out, h)
    for (k1, v1), (k2, v2) in zip(stack_caches, caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("t", [1, 8])
def test_int8_kv_op_matches_the_separate_kernels(t):
    """With int8 caches (k_scales / v_scales given) the op equals quantize_kv_cache and the
    int8 decode kernel called one by one, and leaves the same caches and scales behind."""
    from kvmesh.layers import kv_cache as kvq

    a = _random_stack(t)
    ops = torch.ops.kvmesh
    gemm = ops.skinny_linear if t <= a["skinny_rows"] else ops.small_linear

    def int8_caches():
        out = []
        for k, v in a["caches"]:
            kv = kvq.QuantizedKV(torch.zeros_like(k, dtype=torch.int8), torch.zeros_like(v, dtype=torch.int8),
                                 torch.zeros(k.shape[:3]), torch.zeros(v.shape[:3]))
            kvq.write(kv, k.flatten(0, 1), v.flatten(0, 1), torch.arange(k.shape[0] * k.shape[1]))
            out.append(kv)
        return out

    caches, h = int8_caches(), a["h"]
    for layer, kv in enumerate(caches):
        n, w, b = a["norms"][2 * layer:], a["linears"][4 * layer:], a["biases"][4 * layer:]
        q, k, v = ops.rope_qkv(gemm(ops.rms_norm(h, n[0], 1e-6), w[0], b[0]), a["cos"], a["sin"],
                               a["heads"], a["kv_heads"])
        ops.quantize_kv_cache(k, v, *kv, a["slots"])
        o = ops.paged_decode_attention(q, kv.k, kv.v, a["tables"], a["ctx"], a["scale"], 0, kv.k_scale, kv.v_scale)
        h, x = ops.add_rms_norm(h, gemm(o.view(t, -1), w[1], b[1]), n[1], 1e-6)
        h = h + gemm(ops.silu_and_mul(gemm(x, w[2], b[2])), w[3], b[3])
    stack = int8_caches()
    out = torch.ops.kvmesh.decode_stack(
        a["h"], a["cos"], a["sin"], a["norms"], a["linears"], a["kinds"], a["biases"], [kv.k for kv in stack],
        [kv.v for kv in stack], a["slots"], a["tables"], a["ctx"], a["heads"], a["kv_heads"], 1e-6, a["scale"],
        a["skinny_rows"], [kv.k_scale for kv in stack], [kv.v_scale for kv in stack])
    assert torch.equal(out, h)
    for ours, theirs in zip(stack, caches):
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    with pytest.raises(RuntimeError, match="one per layer each"):
        torch.ops.kvmesh.decode_stack(
            a["h"], a["cos"], a["sin"], a["norms"], a["linears"], a["kinds"], a["biases"], [kv.k for kv in stack],
            [kv.v for kv in stack], a["slots"], a["tables"], a["ctx"], a["heads"], a["kv_heads"], 1e-6, a["scale"],
            a["skinny_rows"], [stack[0].k_scale], [stack[0].v_scale])


@pytest.mark.parametrize("change,message", [
    (lambda a: a["norms"].pop(), "per layer 2 norms"),
    (lambda a: a["linears"].pop(), "too few linear tensors"),
    (lambda a: a["linears"].append(torch.zeros(1)), "more linear tensors"),
    (lambda a: a["slots"].fill_(10_000), "outside the KV cache"),
    (lambda a: a.update(h=torch.randn(65, 32)), "T <= 64"),
    (lambda a: a.update(skinny_rows=5), "skinny_rows must be 0..4"),
    (lambda a: (a.update(skinny_rows=0), a["kinds"].__setitem__(0, 1), a["linears"].insert(1, torch.zeros(1))),
     "need every linear dense and float32"),
    (lambda a: a["linears"].__setitem__(1, torch.zeros(32, 7)), "dense weight must be"),
    (lambda a: (a["kinds"].__setitem__(0, 2), a["linears"].insert(1, torch.zeros(1)),
                a["linears"].insert(1, torch.zeros(1))), "int4 needs packed qweight"),
    (lambda a: a["kinds"].__setitem__(0, 9), "unknown kind"),
])
def test_bad_arguments_raise_clear_errors(change, message):
    a = _random_stack(1)
    caches = [(k.clone(), v.clone()) for k, v in a["caches"]]
    change(a)
    with pytest.raises(RuntimeError, match=message):
        _call_stack(a, caches)
    # Checked before any work: no cache row was written.
    for (k1, v1), (k2, v2) in zip(caches, a["caches"]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
