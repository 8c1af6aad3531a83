"""Attention backends agree with each other and with dense causal attention."""

import pytest
import torch

from kvmesh.layers import native
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
    if backend == "cpu" and not native.load():
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
        "CpuPagedAttentionBackend" if native.load() else "TorchAttentionBackend")


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
    if not native.load():
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
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    kc = torch.zeros(4, 16, 1, 8)
    with pytest.raises(RuntimeError, match="at least one context token"):
        torch.ops.kvmesh.paged_decode_attention(torch.zeros(1, 1, 8), kc, kc, torch.zeros(1, 1, dtype=torch.long),
                                                torch.zeros(1, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.kvmesh.paged_decode_attention(torch.zeros(1, 1, 8, dtype=torch.bfloat16), kc, kc,
                                                torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("chunks, h, kvh, d", [
    ([(0, 256)], 9, 3, 64),                        # one fresh prompt: several query and key tiles
    ([(0, 1), (0, 31), (0, 32), (0, 33), (0, 65)], 9, 3, 64),  # lengths around the tile sizes
    ([(15, 40), (64, 64), (500, 17), (129, 1)], 9, 3, 64),  # chunks behind cached tokens
    ([(0, 70), (33, 90)], 16, 2, 128),             # 8 query heads per KV head, head size 128
    ([(10, 50)], 4, 4, 80),                        # no GQA; head size a whole number of AVX2 vectors only
    ([(3, 45), (0, 9)], 6, 2, 40),                 # head size not a multiple of the vector width
    ([(7, 20)], 2, 1, 20),
])
def test_paged_prefill_kernel_matches_dense(dtype, tol, chunks, h, kvh, d):
    """The C++ prefill kernel against dense causal attention, over several chunks of one call
    (each behind its own cached prefix, blocks scattered), with decode rows before them that
    it must leave alone."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    bs, nd = 16, 3
    spans, t = _random_batch(nd, chunks, bs, kvh, d, num_blocks=400, seed=len(chunks) * 31 + d)
    g = torch.Generator().manual_seed(d)
    kc = torch.randn(400, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(400, bs, kvh, d, generator=g).to(dtype)
    q = (torch.randn(t, h, d, generator=g) * 2).to(dtype)
    meta = get_attention_backend("cpu", bs, CPU).build_metadata(spans, nd)
    out = torch.full_like(q, 7.0)
    torch.ops.kvmesh.paged_prefill_attention(out, q, kc, vc, meta.prefill_table, meta.prefill_spans, d**-0.5)
    assert (out[:nd] == 7.0).all()  # decode rows are not the kernel's
    ref = _dense_reference(spans[nd:], q.double(), kc.double(), vc.double(), bs, d**-0.5)
    torch.testing.assert_close(out[nd:].float(), ref[nd:].float(), rtol=tol, atol=tol)


def test_cpu_backend_keeps_the_reference_prefill_without_vector_kernels():
    """On a CPU with neither AVX2 nor AVX-512 the CPU backend prefills with SDPA (the
    prefill kernel's scalar build is slower); decodes still take the C++ kernel."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    be = get_attention_backend("cpu", 16, CPU)
    be.prefill_kernel = False
    spans, t = _random_batch(4, [(0, 13), (40, 9)], 16, 3, 32)
    meta = be.build_metadata(spans, 4)
    assert meta.prefill_spans is None and len(meta.prefill_masks) == 2
    kc, vc = torch.randn(1200, 16, 3, 32), torch.randn(1200, 16, 3, 32)
    q, k, v = torch.randn(t, 9, 32), torch.randn(t, 3, 32), torch.randn(t, 3, 32)
    out = be.forward(q, k, v, (kc, vc), meta, 32**-0.5)
    torch.testing.assert_close(out, _dense_reference(spans, q, kc, vc, 16, 32**-0.5), rtol=1e-4, atol=1e-5)


def test_cpu_backend_prefills_bf16_with_sdpa():
    """bf16 models prefill through SDPA on the CPU backend too (its bf16 dot products beat the
    fp32 kernel); the reference metadata is built once, on the first layer's call."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    be = get_attention_backend("cpu", 16, CPU)
    spans, t = _random_batch(2, [(0, 13), (40, 9)], 16, 3, 32)
    meta = be.build_metadata(spans, 2)
    assert meta.prefill_spans is not None and not meta.prefill_masks
    kc, vc = torch.randn(1200, 16, 3, 32).bfloat16(), torch.randn(1200, 16, 3, 32).bfloat16()
    q, k, v = (torch.randn(t, n, 32).bfloat16() for n in (9, 3, 3))
    out = be.forward(q, k, v, (kc, vc), meta, 32**-0.5)
    masks = list(meta.prefill_masks)
    assert len(masks) == 2
    be.forward(q, k, v, (kc, vc), meta, 32**-0.5)  # a second layer reuses them
    assert all(a is b for a, b in zip(masks, meta.prefill_masks))
    ref = _dense_reference(spans, q.float(), kc.float(), vc.float(), 16, 32**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_paged_prefill_kernel_refuses_bad_input():
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    kc, q = torch.zeros(4, 16, 1, 8), torch.zeros(20, 2, 8)
    table = torch.zeros(1, 2, dtype=torch.long)
    op = torch.ops.kvmesh.paged_prefill_attention
    with pytest.raises(RuntimeError, match="outside q"):
        op(torch.empty_like(q), q, kc, kc, table, torch.tensor([[10, 11, 0]]), 1.0)
    with pytest.raises(RuntimeError, match="more blocks than its table"):
        op(torch.empty_like(q), q, kc, kc, table, torch.tensor([[0, 20, 13]]), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(torch.empty_like(q).bfloat16(), q, kc, kc, table, torch.tensor([[0, 4, 0]]), 1.0)


def _shared_prefix_batch(groups, own_lens, bs, g, num_blocks):
    """Block tables where the sequences of each group start with the same physical blocks
    (what prefix-cache hits hand out), followed by blocks of their own. `groups`: (shared
    blocks, members) pairs; `own_lens`: tokens of its own per sequence, in group order."""
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    rows, lens, i = [], [], 0
    for shared_blocks, members in groups:
        prefix = [free.pop() for _ in range(shared_blocks)]
        for _ in range(members):
            own = own_lens[i]
            i += 1
            rows.append(prefix + [free.pop() for _ in range(-(-own // bs))])
            lens.append(shared_blocks * bs + own)
    width = max(map(len, rows))
    # Padding past a row's blocks is block 0 in every row: it must never count as shared.
    return torch.tensor([r + [0] * (width - len(r)) for r in rows]), torch.tensor(lens)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("groups, own_lens", [
    # 4 groups of 3 sharing 32 blocks (a 512-token system prompt), 1-64 own tokens each
    ([(32, 3)] * 4, [1, 17, 64, 5, 16, 33, 2, 48, 15, 9, 31, 64]),
    # groups of 2 and 5 beside lone sequences (a group of one shares nothing)
    ([(6, 2), (1, 1), (9, 5), (4, 1)], [3, 40, 7, 1, 16, 29, 64, 12, 5]),
    # members whose whole context is the shared prefix (nothing of their own) beside one with 5
    ([(5, 3)], [0, 0, 5]),
    # prefixes shorter than the cascade's minimum (4 blocks): the plain path
    ([(3, 4)], [10, 20, 30, 40]),
    # two sequences, few enough that contexts are split into partitions too
    ([(40, 2)], [20, 300]),
])
def test_paged_decode_kernel_shared_prefixes(dtype, tol, groups, own_lens):
    """Sequences whose tables share leading blocks take the cascade path (the shared
    blocks attended once for all sharers, merged by log-sum-exp): same result as dense
    attention, and as the same sequences on tables that share nothing (copies of the
    prefix blocks), batch order shuffled so sharers are not neighbours."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    g = torch.Generator().manual_seed(len(own_lens))
    bs, h, kvh, d, nb = 16, 9, 3, 64, 1600
    table, lens = _shared_prefix_batch(groups, own_lens, bs, g, nb)
    perm = torch.randperm(len(lens), generator=g)
    table, lens = table[perm].contiguous(), lens[perm].contiguous()
    kc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    out = torch.ops.kvmesh.paged_decode_attention(q, kc, vc, table, lens, d**-0.5)
    ref = _decode_reference(q, kc, vc, table, lens, d**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    # Unshared: every sequence's blocks copied to blocks of its own (same K/V, no sharing).
    kc2, vc2 = kc.clone(), vc.clone()
    table2, nxt = table.clone(), nb
    kc2 = torch.cat([kc2, torch.zeros(table.numel(), bs, kvh, d, dtype=dtype)])
    vc2 = torch.cat([vc2, torch.zeros(table.numel(), bs, kvh, d, dtype=dtype)])
    for b in range(len(lens)):
        for i in range(-(-int(lens[b]) // bs)):
            kc2[nxt], vc2[nxt] = kc[table[b, i]], vc[table[b, i]]
            table2[b, i] = nxt
            nxt += 1
    alone = torch.ops.kvmesh.paged_decode_attention(q, kc2, vc2, table2, lens, d**-0.5)
    torch.testing.assert_close(out.float(), alone.float(), rtol=tol, atol=tol)
