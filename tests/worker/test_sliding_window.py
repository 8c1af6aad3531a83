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
