"""Attention backends agree with each other and with dense causal attention."""

import pytest
import torch

from kvmesh.layers import cpu_kernels
from kvmesh.layers.attention import BACKENDS, SeqSpan, get_attention_backend

CPU = torch.device("cpu")


def _random_batch(num_decodes, prefills, block_size, kvh, d, num_blocks=1200, seed=0):
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    spans, q_start = [], 0
    for i in range(num_decodes):
        ctx = int(torch.randint(1, 120, (1,), generator=g))
        n = -(-ctx // block_size)
        spans.append(SeqSpan(q_start, 1, ctx - 1, [free.pop() for _ in range(n)]))
        q_start += 1
    for start, qlen in prefills:
        n = -(-(start + qlen) // block_size)
        spans.append(SeqSpan(q_start, qlen, start, [free.pop() for _ in range(n)]))
        q_start += qlen
    return spans, q_start


def _dense_reference(spans, q, kc, vc, block_size, scale):
    """Plain causal attention per sequence over its K/V read token by token."""
    out = torch.empty_like(q)
    h, kvh = q.shape[1], kc.shape[2]
    for s in spans:
        pos = torch.arange(s.ctx_len)
        blocks = torch.tensor(s.block_ids)[pos // block_size]
        k = kc[blocks, pos % block_size].repeat_interleave(h // kvh, dim=1)  # (C, H, D)
        v = vc[blocks, pos % block_size].repeat_interleave(h // kvh, dim=1)
        qs = q[s.q_start : s.q_start + s.q_len]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(s.start_pos, s.ctx_len)[:, None]
        scores = scores.masked_fill(pos[None, :] > qpos, float("-inf"))
        out[s.q_start : s.q_start + s.q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("block_size, h, kvh", [(16, 9, 3), (1, 4, 4), (4, 8, 1), (32, 6, 2)])
def test_backend_matches_dense(backend, block_size, h, kvh):
    if backend == "cpu" and not cpu_kernels.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    d, scale = 32, 32**-0.5
    spans, t = _random_batch(7, [(0, 13), (9, 20), (40, 1)], block_size, kvh, d)
    be = get_attention_backend(backend, block_size, CPU)
    meta = be.build_metadata(spans, 7)
    nb = 1200
    kc, vc = torch.randn(nb, block_size, kvh, d), torch.randn(nb, block_size, kvh, d)
    q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    out = be.forward(q, k, v, (kc, vc), meta, scale)
    # forward wrote this step's K/V into the cache; the reference reads the cache
    torch.testing.assert_close(out, _dense_reference(spans, q, kc, vc, block_size, scale), rtol=1e-4, atol=1e-5)


def test_auto_picks_cpu_kernels_on_cpu():
    assert type(get_attention_backend("auto", 16, CPU)).__name__ == (
        "CpuPagedAttentionBackend" if cpu_kernels.load() else "TorchAttentionBackend")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="choose from"):
        get_attention_backend("flash9", 16, CPU)
