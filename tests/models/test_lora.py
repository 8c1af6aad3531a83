"""Multi-LoRA against transformers + peft on tiny random models and random adapters (lora_B
random too, so every adapter changes the output): greedy tokens equal and logits close for a
batch that mixes three adapters and the base model, with chunked prefill, prefix-cache hits,
fewer device slots than adapters (slots refilled, the scheduler's max_loras cap), q/k/v and
gate/up shards of the fused projections, Phi-3's fused checkpoint modules, rsLoRA and
alpha_pattern; the prefix cache never shares blocks across adapters; bad adapters refused
by name; idle engines back at their full free-block count."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_logits_close, hf_greedy, hf_step_logits, make_adapter, peft_reference

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.errors import ConfigError, InvalidRequestError
from kvmesh.layers import lora as lora_layers
from kvmesh.layers import native

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)

# name -> peft LoraConfig arguments (rank, targets, scaling variants)
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]),
    "attn-qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 2}),
    "mlp-r16-rslora": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                           use_rslora=True),
}


def _prompts(vocab: int, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run(engine, jobs):
    """jobs: [(prompt ids, adapter name | None)] -> ({rid: tokens}, {rid: [logits]}), stepping
    the runner to collect each step's logits."""
    rids = [engine.add_request(f"r{i}", p, GREEDY, lora=name) for i, (p, name) in enumerate(jobs)]
    tokens = {r: [] for r in rids}
    logits = {r: [] for r in rids}
    cached = {}
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        for seq in sched.seqs:
            req = engine.scheduler.requests[seq.request_id]
            cached.setdefault(seq.request_id, req.num_cached_tokens)
        out = engine.executor.runner.execute(sched, return_logits=True)
        for rid, lg in out.logits.items():
            logits[rid].append(lg)
        for res in engine.scheduler.update_from_output(sched, out):
            tokens[res.request.request_id].extend(res.new_token_ids)
    engine._states.clear()
    return tokens, logits, cached


@pytest.fixture(scope="module")
def llama_lora(tmp_path_factory):
    from tiny_models import build_tiny_model

    base = build_tiny_model(tmp_path_factory.mktemp("base"), qkv_bias=True)
    adapters = {name: make_adapter(base, tmp_path_factory.mktemp(name), seed=i + 1, **kw)
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    return base, adapters


def _engine(base, adapters, **kw):
    modules = [{"name": n, "path": str(p)} for n, p in adapters.items()]
    lora = {"modules": modules, "max_loras": kw.pop("max_loras", 2), "max_lora_rank": kw.pop("max_lora_rank", 16)}
    return build_engine(model=str(base), progress=False, lora=lora, **kw)


def test_mixed_batch_matches_peft(llama_lora):
    """Three adapters and the base model in every step; 2 device slots for 3 adapters (the
    scheduler holds a third adapter's requests back until a slot's requests drain, and slots
    are refilled); 24-token steps chunk the longer prompts; round 2 extends round 1's prompts
    (prefix-cache hits within each adapter)."""
    torch.set_num_threads(1)
    base, adapters = llama_lora
    engine = _engine(base, adapters, block_size=4, num_blocks=256, max_num_batched_tokens=24)
    refs = {None: peft_reference(base, None), **{n: peft_reference(base, p) for n, p in adapters.items()}}
    names = [None, *adapters]
    first = _prompts(384, (5, 17, 33, 9, 26, 12, 40, 3))
    for rnd in range(2):
        prompts = [p + _prompts(384, [4 * rnd], seed=rnd + 7)[0] for p in first]
        jobs = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
        tokens, logits, cached = run(engine, jobs)
        for i, (prompt, name) in enumerate(jobs):
            rid = f"r{i}"
            ref = refs[name]
            assert tokens[rid] == hf_greedy(ref, prompt, MAX_NEW), f"round {rnd} prompt {i} adapter {name}"
            assert_logits_close(torch.stack(logits[rid]).float(), hf_step_logits(ref, prompt, tokens[rid]))
            if rnd == 1 and len(first[i]) >= 8:
                assert cached[rid] > 0, f"prompt {i} under {name} missed its own round-1 blocks"
    assert engine.executor.lora.loads > 3  # 3 adapters through 2 slots: refilled
    backends = {layer.backend for layer in engine.executor.lora._layers.values()}
    assert backends == ({"cpu"} if native.loaded() else {"torch"})  # the SGMV kernel where it built
    assert engine.num_free_blocks == engine.num_usable_blocks
    # The adapters change the output: each differs from the base model on some prompt.
    base_tokens = {i: hf_greedy(refs[None], p, MAX_NEW) for i, p in enumerate(first)}
    for name in adapters:
        assert any(hf_greedy(refs[name], p, MAX_NEW) != base_tokens[i] for i, p in enumerate(first)), name


def test_pytorch_path_without_native_kernels(llama_lora):
    """cpu_kernels off: the per-segment addmm path and the reference attention."""
    torch.set_num_threads(1)
    base, adapters = llama_lora
    engine = _engine(base, adapters, block_size=8, num_blocks=128, max_loras=3, cpu_kernels=False,
                     attention_backend="torch")
    prompts = _prompts(384, (6, 23, 11, 30))
    jobs = list(zip(prompts, [None, *adapters]))
    tokens, logits, _ = run(engine, jobs)
    assert {layer.backend for layer in engine.executor.lora._layers.values()} == {"torch"}
    for i, (prompt, name) in enumerate(jobs):
        ref = peft_reference(base, adapters.get(name))
        assert tokens[f"r{i}"] == hf_greedy(ref, prompt, MAX_NEW), name
        assert_logits_close(torch.stack(logits[f"r{i}"]).float(), hf_step_logits(ref, prompt, tokens[f"r{i}"]))
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_prefix_cache_never_shares_blocks_across_adapters(llama_lora):
    torch.set_num_threads(1)
    base, adapters = llama_lora
    engine = _engine(base, adapters, block_size=4, num_blocks=128)
    prompt = _prompts(384, [21], seed=3)[0]
    order = [None, "all-r8", "attn-qv-r4", None, "all-r8"]
    hits = []
    for name in order:
        tokens, _, cached = run(engine, [(prompt, name)])
        hits.append(cached["r0"])
    assert hits[:3] == [0, 0, 0]  # first time under each: nothing to share
    assert hits[3] == 20 and hits[4] == 20  # again under the same one: its own blocks
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_max_loras_caps_the_adapters_running_at_once(llama_lora):
    base, adapters = llama_lora
    engine = _engine(base, adapters, block_size=4, num_blocks=128, max_loras=1)
    jobs = [(p, name) for p, name in zip(_prompts(384, (6, 7, 8, 9)), ["all-r8", "mlp-r16-rslora", None, "all-r8"])]
    for i, (p, name) in enumerate(jobs):
        engine.add_request(f"r{i}", p, GREEDY, lora=name)
    seen_running = []
    while engine.has_unfinished():
        engine.step()
        seen_running.append({r.lora_name for r in engine.scheduler.running if r.lora is not None})
    assert all(len(s) <= 1 for s in seen_running)
    assert {"all-r8"} in seen_running and {"mlp-r16-rslora"} in seen_running
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_fused_checkpoint_modules_phi3(model_factory, tmp_path):
    """Phi-3 stores q/k/v and gate/up fused: peft adapts `qkv_proj` / `gate_up_proj` whole."""
    torch.set_num_threads(1)
    base = model_factory(architecture="phi3")
    adapter = make_adapter(base, tmp_path / "phi", seed=5, r=8, lora_alpha=8,
                           target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    engine = _engine(base, {"phi": adapter}, block_size=4, num_blocks=128, max_num_batched_tokens=16)
    ref = peft_reference(base, adapter)
    prompts = _prompts(384, (5, 19, 30))
    tokens, logits, _ = run(engine, [(p, "phi") for p in prompts] + [(prompts[0], None)])
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(ref, p, MAX_NEW)
        assert_logits_close(torch.stack(logits[f"r{i}"]).float(), hf_step_logits(ref, p, tokens[f"r{i}"]))
    assert tokens["r3"] == hf_greedy(peft_reference(base, None), prompts[0], MAX_NEW)


def test_moe_model_serves_attention_adapters_and_refuses_expert_ones(model_factory, tmp_path):
    torch.set_num_threads(1)
    base = model_factory(architecture="qwen3_moe", extra={"norm_topk_prob": True})
    adapter = make_adapter(base, tmp_path / "attn", seed=6, r=8, lora_alpha=16,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    engine = _engine(base, {"attn": adapter}, block_size=4, num_blocks=128)
    ref = peft_reference(base, adapter)
    prompts = _prompts(384, (7, 15))
    tokens, _, _ = run(engine, [(p, "attn") for p in prompts])
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(ref, p, MAX_NEW)
    experts = make_adapter(base, tmp_path / "experts", seed=7, r=4, lora_alpha=4,
                           target_modules=["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(InvalidRequestError, match="MoE experts"):
        engine.load_lora("experts", str(experts))


def test_load_unload_at_run_time_and_errors(llama_lora, tmp_path):
    base, adapters = llama_lora
    engine = _engine(base, {}, block_size=4, num_blocks=64, max_lora_rank=8)
    assert engine.list_loras() == []
    with pytest.raises(InvalidRequestError, match="not loaded"):
        engine.add_request("x", [5, 6, 7], GREEDY, lora="all-r8")
    info = engine.load_lora("a", str(adapters["all-r8"]))
    assert info.rank == 8 and info.loaded and len(info.key) == 16
    assert engine.load_lora("a", str(adapters["all-r8"])) == info  # idempotent
    # The same weights under another name share a content key (and so their KV blocks).
    assert engine.load_lora("b", str(adapters["all-r8"])).key == info.key
    with pytest.raises(InvalidRequestError, match="max_lora_rank=8.*--max-lora-rank 16"):
        engine.load_lora("big", str(adapters["mlp-r16-rslora"]))
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        engine.load_lora("missing", str(tmp_path / "nowhere"))
    embed = make_adapter(base, tmp_path / "embed", seed=9, r=4, lora_alpha=4, target_modules=["embed_tokens"])
    with pytest.raises(InvalidRequestError, match="embedding"):
        engine.load_lora("embed", str(embed))
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((adapters["all-r8"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(InvalidRequestError, match="DoRA"):
        engine.load_lora("dora", str(dora))
    engine.add_request("busy", [5, 6, 7, 8], GREEDY, lora="a")
    assert [i.num_requests for i in engine.list_loras() if i.name == "a"] == [1]
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.unload_lora("a")
    while engine.has_unfinished():
        engine.step()
    assert engine.unload_lora("a") and not engine.unload_lora("a")
    assert [i.name for i in engine.list_loras()] == ["b"]
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_host_lru_evicts_idle_adapters_only(llama_lora):
    base, adapters = llama_lora
    lora = {"max_loras": 1, "max_cpu_loras": 2}
    engine = build_engine(model=str(base), progress=False, lora=lora, block_size=4, num_blocks=64)
    engine.load_lora("a", str(adapters["all-r8"]))
    engine.load_lora("b", str(adapters["attn-qv-r4"]))
    engine.add_request("r", [5, 6, 7], GREEDY, lora="a")  # "a" is busy and most recently used
    engine.load_lora("c", str(adapters["mlp-r16-rslora"]))
    assert sorted(i.name for i in engine.list_loras()) == ["a", "c"]
    with pytest.raises(InvalidRequestError, match="max_cpu_loras"):
        engine.add_request("r2", [5, 6], GREEDY, lora="c")  # both held; c is fine
        engine.load_lora("d", str(adapters["attn-qv-r4"]))  # a and c busy: nothing to evict
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_lora_off_and_bad_start_up_modules(llama_lora, tmp_path):
    base, adapters = llama_lora
    engine = build_engine(model=str(base), progress=False, block_size=4, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        engine.add_request("x", [5, 6, 7], GREEDY, lora="all-r8")
    with pytest.raises(ConfigError, match="'broken'.*adapter_config.json"):
        build_engine(model=str(base), progress=False, block_size=4, num_blocks=64,
                     lora={"modules": [{"name": "broken", "path": str(tmp_path)}]})


def test_base_only_steps_keep_the_decode_stack(llama_lora, monkeypatch):
    """With adapters loaded, a step without adapter rows still runs as the one decode-stack
    op; a step with them runs the layer loop (the stack has the base GEMMs only)."""
    base, adapters = llama_lora
    engine = _engine(base, adapters, block_size=4, num_blocks=64)
    stack = engine.executor.runner.model.decode_stack
    if stack is None or not stack.enabled:
        pytest.skip("no native decode stack on this machine")
    calls = []
    real = stack.step_args

    def step_args(*a):
        args = real(*a)
        calls.append((lora_layers.active(), args is not None))
        return args

    monkeypatch.setattr(stack, "step_args", step_args)
    for name, ran_stack in ((None, True), ("all-r8", False)):
        calls.clear()
        engine.add_request(f"r-{name}", [5, 6, 7], GREEDY, lora=name)
        while engine.has_unfinished():
            engine.step()
        assert all(active == (name is not None) for active, _ in calls)
        assert any(ran for _, ran in calls) == ran_stack
    assert engine.num_free_blocks == engine.num_usable_blocks


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_adapters_on_a_quantized_base(llama_lora, scheme):
    """LoRA over kvmesh's weight-only quantized layers (QuantLinear): the oracle is peft on a
    transformers model holding the weights kvmesh dequantizes, so only the adapters' path
    differs between the two."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kvmesh.quant.modules import QuantEmbedding, QuantLinear

    torch.set_num_threads(1)
    base, adapters = llama_lora
    engine = _engine(base, adapters, block_size=4, num_blocks=128, quantization=scheme)
    model = engine.executor.runner.model
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    unfused = {"qkv_proj": "{}_proj", "gate_up_proj": "{}_proj"}
    quantized = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QuantEmbedding):
                hf.get_submodule(name).weight.copy_(module.head.dequantized_weight())
            elif isinstance(module, QuantLinear) and not name.endswith("embed_tokens.head"):
                w = module.dequantized_weight()
                parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
                if leaf in unfused:
                    for shard, (start, size) in module.shards.items():
                        hf.get_submodule(f"{parent}.{unfused[leaf].format(shard)}").weight.copy_(w[start:start + size])
                else:
                    hf.get_submodule(name).weight.copy_(w)
                quantized += 1
    assert quantized == 4 * 3 + 1  # 4 projections x 3 layers and the LM head
    prompts = _prompts(384, (9, 21, 14))
    jobs = list(zip(prompts, [None, "all-r8", "mlp-r16-rslora"]))
    tokens, logits, _ = run(engine, jobs)
    for i, (prompt, name) in enumerate(jobs):
        ref = hf if name is None else PeftModel.from_pretrained(hf, adapters[name]).eval()
        assert tokens[f"r{i}"] == hf_greedy(ref, prompt, MAX_NEW), name
        assert_logits_close(torch.stack(logits[f"r{i}"]).float(), hf_step_logits(ref, prompt, tokens[f"r{i}"]),
                            rtol=2e-3)
        if name is not None:
            ref.unload()  # peft injected into `hf`: take the adapter out again
    assert engine.num_free_blocks == engine.num_usable_blocks
