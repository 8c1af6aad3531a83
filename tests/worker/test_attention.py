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


def _decode_reference(q, kc, vc, table, lens, scale):
    """Dense fp32 attention of each sequence's query over its first lens[b] cache rows."""
    b, h, d = q.shape
    bs, kvh = kc.shape[1], kc.shape[2]
    out = torch.empty(b, h, d)
    for i in range(b):
        pos = torch.arange(int(lens[i]))
        blocks = table[i][pos // bs]
        k = kc[blocks, pos % bs].float().repeat_interleave(h // kvh, dim=1)  # (C, H, D)
        v = vc[blocks, pos % bs].float().repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,khd->hk", q[i].float(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", p, v)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("batch, d, max_len", [
    (1, 64, 1000),   # batch-1 decode: the context is split into partitions merged by log-sum-exp
    (2, 64, 300),    # fewer sequences than 4x threads: partitions of uneven, ragged contexts
    (37, 64, 200),   # many ragged sequences: one task per sequence, several softmax chunks
    (4, 128, 150),   # head sizes of a whole number of vectors: the register-blocked path
    (6, 32, 90),
    (5, 40, 70),     # head size not a multiple of the vector width: the general path, scalar tail
    (3, 8, 33),      # head size below one vector
])
def test_paged_decode_kernel_matches_dense(dtype, tol, batch, d, max_len):
    """The C++ kernel against dense fp32 attention, in every cache dtype and over the shapes
    that take its different paths (chunks, partitions, vector tails)."""
    if not cpu_kernels.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    g = torch.Generator().manual_seed(batch * 1000 + d)
    bs, h, kvh = 16, 9, 3
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[0] = max_len
    nblk = -(-max_len // bs)
    nb = batch * nblk + 8
    table = torch.randperm(nb, generator=g)[: batch * nblk].view(batch, nblk)
    kc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    q = (torch.randn(batch, h, d, generator=g) * 2).to(dtype)
    out = torch.ops.kvmesh.paged_decode_attention(q, kc, vc, table, lens, d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), _decode_reference(q, kc, vc, table, lens, d**-0.5), rtol=tol, atol=tol)


def test_paged_decode_kernel_refuses_bad_input():
    if not cpu_kernels.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    kc = torch.zeros(4, 16, 1, 8)
    with pytest.raises(RuntimeError, match="at least one context token"):
        torch.ops.kvmesh.paged_decode_attention(torch.zeros(1, 1, 8), kc, kc, torch.zeros(1, 1, dtype=torch.long),
                                                torch.zeros(1, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.kvmesh.paged_decode_attention(torch.zeros(1, 1, 8, dtype=torch.bfloat16), kc, kc,
                                                torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)
