"""Sliding-window attention: every backend against dense windowed attention (with the blocks
before each window dropped to a NaN-poisoned null block, as the KV cache manager leaves
them), and kvmesh against transformers on tiny random Mistral / Qwen2 models whose window
is shorter than the prompts: chunked prefill, prefix-cache hits, preemption, each backend."""

from __future__ import annotations

import pytest
import torch

from kvmesh.layers import native
from kvmesh.layers.attention import BACKENDS, SeqSpan, get_attention_backend
from kvmesh.layers.triton_runtime import AVAILABLE as TRITON_AVAILABLE, INTERPRET

CPU = torch.device("cpu")
NUM_BLOCKS = 1200
# Dropped table entries point here, filled with NaN: a backend that reads one poisons its
# output. (The null block 0 itself stays zero, as in the runner: the reference pads ragged
# tables with it and masks the padding.)
POISON = NUM_BLOCKS - 1


def _windowed_batch(decode_ctx, prefills, bs, window, seed):
    """Spans with distinct random blocks; the entries wholly before each span's first window
    (the chunk's first query's) are dropped, as kv_cache_manager drops them (to POISON here)."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 2, generator=g) + 1).tolist()
    spans, q_start = [], 0
    for start, qlen in [(ctx - 1, 1) for ctx in decode_ctx] + list(prefills):
        n = -(-(start + qlen) // bs)
        first = max(0, start - window + 1) // bs if window else 0
        spans.append(SeqSpan(q_start, qlen, start, [POISON] * first + [free.pop() for _ in range(n - first)]))
        q_start += qlen
    return spans, q_start


def _dense_windowed(spans, q, kc, vc, bs, scale, window):
    """float64 attention per sequence over keys (p - window, p], read token by token."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    h, kvh = q.shape[1], kc.shape[2]
    for s in spans:
        lo = max(0, s.start_pos - window + 1) if window else 0
        pos = torch.arange(lo, s.ctx_len)
        blocks = torch.tensor(s.block_ids)[pos // bs]
        k = kc[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        v = vc[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        qs = q[s.q_start: s.q_start + s.q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(s.start_pos, s.ctx_len)[:, None]
        hide = (pos[None, :] > qpos) | (pos[None, :] <= qpos - window if window else False)
        scores = scores.masked_fill(hide, float("-inf"))
        out[s.q_start: s.q_start + s.q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _check_backend(be, device, window, bs, h, kvh, d, seed, dtype=torch.float32, tol=1e-4):
    decode_ctx = [1, 5, window or 3, (window or 3) + 1, 70, 133, 400]
    prefills = [(0, 23), (0, 3), (9, 20), (41, 1), (64, 37), (5, 70)]
    spans, t = _windowed_batch(decode_ctx, prefills, bs, window, seed)
    g = torch.Generator().manual_seed(seed + 1)
    kc = torch.randn(NUM_BLOCKS, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(NUM_BLOCKS, bs, kvh, d, generator=g).to(dtype)
    kc[0] = vc[0] = 0.0
    kc[POISON] = float("nan")  # a dropped block must never be read
    vc[POISON] = float("nan")
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k, v = torch.randn(t, kvh, d, generator=g).to(dtype), torch.randn(t, kvh, d, generator=g).to(dtype)
    scale = d**-0.5
    kc, vc, q, k, v = (x.to(device) for x in (kc, vc, q, k, v))
    meta = be.build_metadata(spans, len(decode_ctx))
    out = be.forward(q, k, v, (kc, vc), meta, scale, window=window)
    again = be.forward(q, k, v, (kc, vc), meta, scale, window=window)  # the step's cached plan
    ref = _dense_windowed(spans, q.cpu(), kc.cpu(), vc.cpu(), bs, scale, window)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(again, out)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("window, bs, h, kvh, d", [
    (8, 4, 4, 2, 32), (1, 16, 6, 2, 64), (17, 16, 9, 3, 64), (64, 1, 4, 4, 16), (5, 32, 8, 1, 40),
    (29, 8, 4, 1, 64)])
def test_backend_matches_dense_windowed(backend, window, bs, h, kvh, d):
    if backend == "cpu" and not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    _check_backend(get_attention_backend(backend, bs, CPU), CPU, window, bs, h, kvh, d, seed=window + bs)


def test_cpu_kernels_random_windows_and_full_layers_share_a_step():
    """Several windows (and full attention) over one step's metadata, as a mixed model's layers run."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    g = torch.Generator().manual_seed(0)
    for trial in range(4):
        window = int(torch.randint(1, 90, (1,), generator=g))
        for backend in sorted(BACKENDS):
            _check_backend(get_attention_backend(backend, 8, CPU), CPU, window, 8, 4, 2, 32, seed=trial)


def test_cpu_prefill_bf16_reference_path_honours_the_window():
    """bf16 prefill goes through the reference SDPA path of the CPU backend."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    be = get_attention_backend("cpu", 4, CPU)
    _check_backend(be, CPU, 8, 4, 4, 2, 32, seed=3, dtype=torch.bfloat16, tol=3e-2)


def test_full_attention_unchanged_by_the_window_argument():
    """window=None is plain causal attention (no block dropped)."""
    for backend in sorted(BACKENDS):
        _check_backend(get_attention_backend(backend, 4, CPU), CPU, None, 4, 4, 2, 32, seed=5)


@pytest.mark.skipif(not (TRITON_AVAILABLE and (INTERPRET or torch.cuda.is_available())),
                    reason="triton not installed, or no GPU and TRITON_INTERPRET unset")
@pytest.mark.parametrize("window, bs, sms", [(8, 4, 1), (17, 16, 1), (1, 8, 1), (40, 16, 1), (300, 4, 64)])
def test_triton_matches_dense_windowed(window, bs, sms):
    """sms=64: a small batch splits each window's decode (split-K, merged by log-sum-exp)."""
    from kvmesh.layers.triton_attention import TritonAttentionBackend

    device = CPU if INTERPRET else torch.device("cuda")
    be = TritonAttentionBackend(bs, device)
    be.num_sms = sms
    _check_backend(be, device, window, bs, 4, 2, 32, seed=window)


# -- kvmesh vs transformers -----------------------------------------------------------

MAX_NEW = 10
WINDOW = 8
MISTRAL = dict(architecture="mistral", sliding_window=WINDOW)
# Qwen2 with its first layer full and the others sliding (max_window_layers=1): every block
# is kept, the sliding layers skip the keys before their window.
MIXED = dict(architecture="qwen2", num_kv_heads=1, sliding_window=WINDOW,
             extra={"max_window_layers": 1,
                    "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]})


def _prompts(vocab: int, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _check(path, engine_kwargs, lengths=(1, 5, 17, 33, 64, 9), prompts=None, rtol=1e-3):
    """Greedy tokens and per-step logits equal transformers'; every block back when idle."""
    from transformers import AutoModelForCausalLM

    from helpers import assert_logits_close, hf_greedy, hf_step_logits, run_collecting_logits
    from kvmesh import SamplingParams
    from kvmesh.build import build_engine

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = build_engine(model=str(path), progress=False, **engine_kwargs)
    prompts = prompts or _prompts(hf.config.vocab_size, lengths)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    tokens, logits = run_collecting_logits(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        assert tokens[rid] == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i} (len {len(prompt)})"
        assert_logits_close(torch.stack(logits[rid]), hf_step_logits(hf, prompt, tokens[rid]), rtol)
    assert engine.num_free_blocks == engine.num_usable_blocks
    return engine


def test_arch_windows(model_factory):
    from kvmesh.models.loader import load_arch_config

    mistral, mixed = load_arch_config(model_factory(**MISTRAL)), load_arch_config(model_factory(**MIXED))
    assert mistral.layer_windows == (WINDOW,) * 3 and mistral.kv_window == WINDOW
    assert mixed.layer_windows == (None, WINDOW, WINDOW) and mixed.kv_window is None


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("model", ["mistral", "mixed"])
def test_matches_transformers_chunked(model_factory, backend, model):
    """Chunks of 7 tokens: most chunks start past the window, decodes read only the window."""
    engine = _check(model_factory(**(MISTRAL if model == "mistral" else MIXED)),
                    dict(block_size=4, num_blocks=256, max_num_batched_tokens=7, attention_backend=backend))
    assert engine.kv_manager.sliding_window == (WINDOW if model == "mistral" else None)


def test_matches_transformers_unchunked_and_block_size_one(model_factory):
    _check(model_factory(**MISTRAL), dict(block_size=16, num_blocks=64))
    _check(model_factory(**MISTRAL), dict(block_size=1, num_blocks=1024), lengths=(3, 20, 41))


@pytest.mark.parametrize("model", ["mistral", "mixed"])
def test_prefix_cache_hits(model_factory, model):
    """The same long prefix twice (and a third time after the first two finished): the
    later requests start from cached blocks, the dropped ones standing in as the null block."""
    path = model_factory(**(MISTRAL if model == "mistral" else MIXED))
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 384, (45,), generator=g).tolist()
    prompts = [shared + [5, 6, 7], shared + [9], shared, shared[:30] + [11, 12]]
    for budget in (16, 256):  # chunked: hits on the first request's blocks; whole: hits within a step
        engine = _check(path, dict(block_size=4, num_blocks=256, max_num_batched_tokens=budget), prompts=prompts)
        assert engine.kv_manager.hit_tokens > 0


def test_prefix_hit_after_the_prefix_head_was_evicted(model_factory):
    """Mistral: a hit needs only the blocks in the window of its first computed token, so it
    survives the eviction of the prompt's first blocks, and equals transformers."""
    from transformers import AutoModelForCausalLM

    from helpers import assert_logits_close, hf_step_logits, run_collecting_logits
    from kvmesh import SamplingParams
    from kvmesh.build import build_engine
    from kvmesh.engine.hashing import block_hashes

    path = model_factory(**MISTRAL)
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 19 usable blocks; the first request passes through 16 of them (64 tokens), dropping
    # its head first, so the oldest free blocks after it are 3 never used, then its head.
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=20, max_num_batched_tokens=8)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 384, (60,), generator=g).tolist()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first, _ = run_collecting_logits(engine, [prompt], params)
    # 12 more blocks (48 tokens) evict the 3 unused ones and the prompt's first 9.
    other = torch.randint(3, 384, (44,), generator=g).tolist()
    run_collecting_logits(engine, [other], params)
    kv = engine.kv_manager
    hashes = block_hashes(prompt, 4, kv.fingerprint, [], None)
    assert kv.pool.get_cached_block(hashes[0]) is None, "the prompt's first block should be evicted"
    assert all(kv.pool.get_cached_block(h) is not None for h in hashes[12:14])
    before = kv.hit_tokens
    tokens, logits = run_collecting_logits(engine, [prompt], params)
    assert kv.hit_tokens - before == 56  # (60 - 1) // 4 whole blocks
    assert tokens == first
    assert_logits_close(torch.stack(logits["r0"]), hf_step_logits(hf, prompt, tokens["r0"]))
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_preemption_recomputes(model_factory):
    """Few blocks: requests are preempted and recomputed; outputs do not change."""
    engine = _check(model_factory(**MISTRAL),
                    dict(block_size=4, num_blocks=8, max_model_len=120, max_num_batched_tokens=8),
                    lengths=(40, 33, 50, 21, 64, 9))
    assert engine.stats()["num_preemptions"] > 0


def test_prompt_longer_than_the_cache(model_factory):
    """Mistral: 15 usable blocks hold 60 tokens, yet a 150-token prompt is served (a window's
    worth of blocks at a time)."""
    engine = _check(model_factory(**MISTRAL),
                    dict(block_size=4, num_blocks=16, max_model_len=200, max_num_batched_tokens=8),
                    lengths=(150, 90))
    assert engine.max_model_len == 200


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "draft", "model": "self", "num_speculative_tokens": 3},
    {"method": "draft", "model": "DRAFT", "num_speculative_tokens": 2},
])
def test_speculative_decoding(model_factory, spec):
    """Verification rolls rejected drafts back (ngram: the window's blocks must survive it);
    a draft model shares the target's block ids and catches up from behind the window, so
    with one the engine keeps every block. Greedy output equals no speculation and transformers'."""
    from transformers import AutoModelForCausalLM

    from helpers import hf_greedy
    from kvmesh import SamplingParams
    from kvmesh.llm import LLM

    torch.set_num_threads(1)
    path = model_factory(**MISTRAL)
    if spec.get("model") == "DRAFT":  # other weights: many rejections
        spec = {**spec, "model": str(model_factory(**MISTRAL, seed=7, num_layers=1))}
    g = torch.Generator().manual_seed(1)
    loops = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (6, 4, 9)]
    prompts = [loops[0] * 6, loops[1] * 3 + [7, 8], loops[2] * 2 + list(range(3, 20))]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(progress=False, block_size=4, num_blocks=256, max_model_len=256, max_num_batched_tokens=16)
    ref = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, greedy)]
    llm = LLM(str(path), speculative=spec, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert got == ref
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, 24)
    stats = llm.engine.stats()
    assert stats["spec_proposed_tokens"] > 0
    if spec.get("model") != "self":  # rejections happened (ngram too: a random model ignores the loops)
        assert stats["spec_acceptance_rate"] < 1.0
    assert llm.engine.kv_manager.sliding_window == (WINDOW if spec["method"] == "ngram" else None)
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks


@pytest.mark.skipif(not (TRITON_AVAILABLE and (INTERPRET or torch.cuda.is_available())),
                    reason="triton not installed, or no GPU and TRITON_INTERPRET unset")
def test_triton_backend_matches_transformers(model_factory):
    """The Triton kernels (interpreted on CPU here) in a whole engine: chunked prefill past the window."""
    device = "cpu" if INTERPRET else "cuda"
    _check(model_factory(**MISTRAL), dict(block_size=4, num_blocks=128, max_num_batched_tokens=12,
                                          attention_backend="triton", device=device, dtype="float32"),
           lengths=(3, 29))


@pytest.mark.skipif(not native.load(), reason="CPU kernels need a C++ compiler")
@pytest.mark.parametrize("model", ["mistral", "mixed"])
def test_decode_stack_honours_per_layer_windows(model_factory, stack_calls, monkeypatch, model):
    """The whole-stack decode op takes each layer's window: same bits as the layer loop,
    and transformers' tokens, on contexts past the window."""
    from transformers import AutoModelForCausalLM

    from helpers import assert_logits_close, hf_greedy, hf_step_logits, stack_then_loop
    from kvmesh.build import build_engine

    torch.set_num_threads(1)
    path = model_factory(**(MISTRAL if model == "mistral" else MIXED))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, (1, 4, 13, 30), seed=1)
    tokens, logits = stack_then_loop(
        lambda: build_engine(model=str(path), progress=False, block_size=4, num_blocks=128), prompts,
        stack_calls, monkeypatch)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == hf_greedy(hf, prompt, 12), f"prompt {i} (len {len(prompt)})"
        assert_logits_close(logits[i], hf_step_logits(hf, prompt, tokens[i]))


@pytest.mark.skipif(not (TRITON_AVAILABLE and INTERPRET), reason="runs the Triton kernels interpreted on CPU")
def test_triton_decode_graphs_with_a_window(model_factory):
    """Decode graphs (replayed through EagerRecorder) fix the split plan at max_model_len;
    a window shortens it, and each replay starts at its own context's window."""
    from transformers import AutoModelForCausalLM

    from helpers import hf_greedy
    from kvmesh import SamplingParams
    from kvmesh.build import build_engine
    from kvmesh.worker.cuda_graphs import EagerRecorder

    torch.set_num_threads(1)
    path = model_factory(**MISTRAL)
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=96, max_model_len=64,
                          max_num_batched_tokens=7, attention_backend="triton", layer_ops="triton")
    runner = engine.executor.runner
    runner._capture_graphs(4, 64, EagerRecorder())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, (3, 19, 11))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf, prompt, 6)
    assert runner.graphs.replays > 0
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_held_kv_must_fit_the_whole_cache(model_factory):
    """A request that holds its KV (P/D prefill, pinned prompt) keeps every block: past the
    cache it is refused at once, not preempted forever; one that fits runs and is released."""
    from kvmesh import SamplingParams
    from kvmesh.build import build_engine
    from kvmesh.errors import ResourceExhaustedError

    engine = build_engine(model=str(model_factory(**MISTRAL)), progress=False, block_size=4, num_blocks=16,
                          max_model_len=200, max_num_batched_tokens=8)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with pytest.raises(ResourceExhaustedError, match="KV blocks"):
        engine.add_request("long", list(range(3, 103)), one, hold_kv=True)
    engine.add_request("long-free", list(range(3, 103)), one)  # freed as it goes: served
    engine.add_request("short", list(range(3, 43)), one, hold_kv=True)
    held = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                held[out.request_id] = out.held_block_ids
    assert held["long-free"] is None and len(held["short"]) == 10 and 0 not in held["short"]
    engine.release_kv("short")
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_shared_store_round_trip(model_factory):
    """Blocks are saved to the store as they complete, before the window drops them; after the
    local prefix cache is reset a second request loads them back and matches transformers."""
    from transformers import AutoModelForCausalLM

    from helpers import hf_greedy
    from kvmesh import SamplingParams
    from kvmesh.llm import LLM

    torch.set_num_threads(1)
    path = model_factory(**MISTRAL)
    llm = LLM(str(path), progress=False, block_size=4, num_blocks=64, max_model_len=256,
              max_num_batched_tokens=8, kv_store="memory")
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 384, (48,), generator=g).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate(prefix + [5, 6, 7], greedy)
    llm.engine.kv_connector.flush()
    assert llm.reset_prefix_cache()
    prompt = prefix + [9, 10]
    out = llm.generate(prompt, greedy)[0]
    assert out.num_cached_tokens == 48  # from the store
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks
