"""The int8 KV cache (`kv_cache_dtype="int8"`) end to end on tiny random checkpoints: logits
within the quantization error of transformers in fp32, backends agreeing on the same
quantized values, chunked prefill / prefix hits / preemption reading the same KV as one
uninterrupted prefill, the memory budget holding ~4x the blocks, P/D transfer of int8
blocks, and every block back at the end."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_logits_close, hf_step_logits, run_collecting_logits

from kvmesh import LLM, SamplingParams
from kvmesh.build import build_engine
from kvmesh.cli.args import add_engine_args, engine_overrides
from kvmesh.config import EngineConfig
from kvmesh.errors import ConfigError, KVTransferError
from kvmesh.layers import kv_cache as kvq
from kvmesh.layers import native
from kvmesh.worker.kv_transfer import KVAssembler, make_chunk, make_layout

MAX_NEW = 10
LENGTHS = (1, 5, 17, 33, 64, 9)
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# Each cached K / V element is off by at most max |row| / 254 (0.4% of its row's largest value,
# tests/layers/test_kv_int8_kernels.py). Through three layers (K and V of each) that moved the
# logits by 0.8% of their largest magnitude on these models: 3% leaves room for other shapes
# and prompts, and is still far below what a wrong read (a row's scale mixed up, a stale row)
# does, which moves logits by tens of percent. An fp32 cache is within 1e-6 (test_correctness).
INT8_RTOL = 3e-2
# Two int8 engines that read the same quantized values agree to float32 rounding.
SAME_KV_RTOL = 1e-4


def _prompts(vocab: int, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _engine(path, **kw):
    torch.set_num_threads(1)
    opts = dict(progress=False, block_size=4, num_blocks=256, kv_cache_dtype="int8")
    opts.update(kw)
    return build_engine(model=str(path), **opts)


def _run(engine, prompts):
    tokens, logits = run_collecting_logits(engine, prompts, GREEDY)
    assert engine.num_free_blocks == engine.num_usable_blocks, "a KV block leaked"
    return tokens, {rid: torch.stack(lg) for rid, lg in logits.items()}


def _close(a: dict, b: dict, rtol: float):
    assert a.keys() == b.keys()
    for rid in a:
        assert_logits_close(a[rid], b[rid], rtol)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("config", [dict(), dict(num_kv_heads=1, architecture="qwen2"),
                                    dict(head_dim=32, num_heads=4, num_kv_heads=2)])
def test_int8_kv_logits_stay_within_quantization_error_of_fp32(model_factory, backend, config):
    """Teacher-forced along the int8 engine's own greedy tokens, its logits are within
    INT8_RTOL of transformers in fp32 (and not equal to them: the cache really is int8);
    its greedy tokens equal the fp32-cache engine's on (nearly) every prompt."""
    from transformers import AutoModelForCausalLM

    path = model_factory(**config)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    tokens, logits = _run(_engine(path, attention_backend=backend), prompts)
    worst = 0.0
    for i, prompt in enumerate(prompts):
        ref = hf_step_logits(hf, prompt, tokens[f"r{i}"])
        assert_logits_close(logits[f"r{i}"], ref, INT8_RTOL)
        worst = max(worst, ((logits[f"r{i}"] - ref).abs().max() / ref.abs().max()).item())
    assert worst > 1e-5, "int8 KV gave fp32's logits: is the cache quantized at all?"
    fp32_tokens, _ = _run(_engine(path, attention_backend=backend, kv_cache_dtype="auto"), prompts)
    same = sum(tokens[r] == fp32_tokens[r] for r in tokens)
    assert same >= len(prompts) - 1, f"greedy agreement with the fp32 cache: {same}/{len(prompts)}"


def test_cpu_kernels_and_torch_reference_read_the_same_int8_kv(model_factory):
    """The native writer and kernels against the PyTorch writer and SDPA over dequantized
    blocks: the same int8 values, so float32 rounding apart; a bf16 model too."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    path = model_factory()
    prompts = _prompts(384)
    for dtype, rtol in (("float32", SAME_KV_RTOL), ("bfloat16", 3e-2)):
        tok_a, lg_a = _run(_engine(path, dtype=dtype), prompts)
        tok_b, lg_b = _run(_engine(path, dtype=dtype, attention_backend="torch", cpu_kernels=False), prompts)
        if dtype == "float32":
            assert tok_a == tok_b
            _close(lg_a, lg_b, rtol)
        else:  # bf16 rounding may flip a near-tie: compare what both computed along the same tokens
            for rid in lg_a:
                if tok_a[rid] == tok_b[rid]:
                    assert_logits_close(lg_a[rid].float(), lg_b[rid].float(), rtol)


def test_chunked_prefill_prefix_hits_and_preemption_read_the_same_int8_kv(model_factory):
    """Every backend reads the context through the int8 cache, the step's own tokens
    included: prefilling in 7-token chunks, hitting cached prefix blocks, or being preempted
    and recomputed sees the same K / V as one uninterrupted prefill (SAME_KV_RTOL, far
    tighter than the int8 error), and every block is returned."""
    path = model_factory()
    prompts = _prompts(384)
    base_tokens, base = _run(_engine(path), prompts)

    chunked = _engine(path, max_num_batched_tokens=7)
    tokens, logits = _run(chunked, prompts)
    assert tokens == base_tokens
    _close(logits, base, SAME_KV_RTOL)

    # The same prompts again on one engine: the second round hits the prefix cache.
    engine = _engine(path)
    _run(engine, prompts)
    hits_before = engine.stats()["prefix_hit_tokens"]
    tokens, logits = _run(engine, prompts)
    assert engine.stats()["prefix_hit_tokens"] - hits_before >= sum((n - 1) // 4 * 4 for n in LENGTHS)
    assert tokens == base_tokens
    _close(logits, base, SAME_KV_RTOL)

    # 30 usable blocks of 4 tokens for prompts that need far more: preempted, recomputed.
    long_prompts = _prompts(384, (40, 33, 50, 21, 64, 9), seed=3)
    long_tokens, long_base = _run(_engine(path, max_model_len=120), long_prompts)
    tight = _engine(path, num_blocks=31, max_model_len=120, max_num_batched_tokens=32)
    tokens, logits = _run(tight, long_prompts)
    assert tight.stats()["num_preemptions"] > 0
    assert tokens == long_tokens
    _close(logits, long_base, SAME_KV_RTOL)


@pytest.mark.parametrize("dtype, head_dim", [("float32", 16), ("float32", 64), ("bfloat16", 64)])
def test_the_memory_budget_holds_the_int8_caches_smaller_rows(model_factory, dtype, head_dim):
    """Blocks from kv_cache_memory_gb: an int8 row is head_dim bytes + a 4-byte scale, so the
    budget holds (head_dim x 4) / (head_dim + 4) times the fp32 blocks (3.8x at head_dim 64),
    (head_dim x 2) / (head_dim + 4) times the bf16 ones (1.9x)."""
    path = model_factory(head_dim=head_dim)
    kw = dict(num_blocks=None, block_size=16, kv_cache_memory_gb=0.004, dtype=dtype)
    full = _engine(path, kv_cache_dtype="auto", **kw).num_usable_blocks + 1
    small = _engine(path, **kw).num_usable_blocks + 1
    elem = 4 if dtype == "float32" else 2
    assert small / full == pytest.approx(head_dim * elem / (head_dim + kvq.SCALE_BYTES), rel=2e-3)


def test_fp8_is_refused_on_cpu_with_the_flag_that_works():
    for name in ("fp8", "fp8_e4m3"):
        with pytest.raises(ConfigError, match=r"needs a CUDA device.*--kv-cache-dtype int8"):
            kvq.resolve(name, torch.device("cpu"))
    assert kvq.resolve("auto", torch.device("cpu")) is None and kvq.resolve("int8", torch.device("cpu")) == "int8"


def test_fp8_engine_on_cpu_fails_at_build_with_a_config_error(model_factory):
    with pytest.raises(ConfigError, match="int8"):
        _engine(model_factory(), kv_cache_dtype="fp8")


def test_flag_and_offline_api_spell_it_as_vllm_does(model_factory):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    overrides = engine_overrides(parser.parse_args(["--kv-cache-dtype", "int8"]))
    assert EngineConfig().with_overrides(**overrides).cache.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    torch.set_num_threads(1)
    llm = LLM(str(model_factory()), progress=False, block_size=4, num_blocks=64, kv_cache_dtype="int8")
    runner = llm.engine.executor.runner
    assert runner.spec.quant == "int8" and isinstance(runner.kv_caches[0], kvq.QuantizedKV)
    assert runner.kv_caches[0].k.dtype == torch.int8 and runner.kv_caches[0].k_scale.dtype == torch.float32
    out = llm.generate([[5, 6, 7, 8, 9]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == MAX_NEW


def test_pd_transfer_carries_int8_blocks_with_their_scales_and_refuses_another_dtype(model_factory):
    """read_blocks -> chunks -> KVAssembler -> write_blocks moves int8 values and scales bit
    for bit; a float32-cache worker refuses int8 KV (and the other way round), saying which
    flag to align."""
    path = model_factory()
    src, dst = _engine(path), _engine(path)
    src_runner, dst_runner = src.executor.runner, dst.executor.runner
    _run(src, _prompts(384, (40,)))
    ids = list(range(1, 11))  # blocks the prompt was written to (and random-but-finite others)
    kv = src_runner.read_blocks(ids)
    spec = src_runner.spec
    assert kv.dtype == torch.uint8 and kv.shape == (spec.num_layers, 2, 10, *spec.block_shape)
    assert kv.numel() == 10 * spec.bytes_per_block
    layout = make_layout(src_runner, 10, 40, "fp")
    assert layout.dtype == "int8"
    asm = KVAssembler(dst_runner, "fp")
    for i in range(0, 10, 3):
        asm.add(make_chunk(kv[:, :, i:i + 3], i, layout if i == 0 else None))
    pulled = asm.result()
    dst_runner.write_blocks([20 + i for i in range(10)], pulled.kv)
    idx_src, idx_dst = torch.tensor(ids), torch.arange(20, 30)
    for a, b in zip(src_runner.kv_caches, dst_runner.kv_caches):
        for x, y in zip(a, b):
            assert torch.equal(x[idx_src], y[idx_dst])
    assert any(a.k_scale[idx_src].abs().sum() > 0 for a in src_runner.kv_caches)

    fp32 = _engine(path, kv_cache_dtype="auto").executor.runner
    with pytest.raises(KVTransferError, match=r"source stores int8 KV, this worker float32.*--kv-cache-dtype"):
        KVAssembler(fp32, "fp").add(make_chunk(kv[:, :, :1], 0, layout))
    fp32_layout = make_layout(fp32, 1, 4, "fp")
    with pytest.raises(KVTransferError, match="source stores float32 KV, this worker int8"):
        KVAssembler(dst_runner, "fp").add(make_chunk(fp32.read_blocks([1]), 0, fp32_layout))
