"""The Triton paged-attention kernels against plain attention read token by token from the
cache: block sizes, GQA ratios, ragged lengths, prefix hits, chunked prefill, split-K,
fp32 / bf16, NaN-poisoned unused blocks and output rows, padded (graph) rows."""

from __future__ import annotations

import pytest
import torch
from gpu_marks import requires_triton

from kvmesh.layers.attention import SeqSpan, get_attention_backend
from kvmesh.layers.triton_attention import TritonAttentionBackend, decode_split_plan

pytestmark = requires_triton
NUM_BLOCKS = 400


def _batch(decode_ctx, prefills, block_size, seed):
    """spans with distinct random blocks; prefills are (start_pos, q_len)."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
    spans, q_start = [], 0
    for ctx in decode_ctx:
        spans.append(SeqSpan(q_start, 1, ctx - 1, [free.pop() for _ in range(-(-ctx // block_size))]))
        q_start += 1
    for start, qlen in prefills:
        spans.append(SeqSpan(q_start, qlen, start, [free.pop() for _ in range(-(-(start + qlen) // block_size))]))
        q_start += qlen
    return spans, q_start


def _reference(spans, q, kc, vc, block_size, scale):
    """float64 causal attention per sequence, K/V read token by token from the cache."""
    out = torch.empty(q.shape, dtype=torch.float64)
    h, kvh = q.shape[1], kc.shape[2]
    for s in spans:
        pos = torch.arange(s.ctx_len)
        blocks = torch.tensor(s.block_ids)[pos // block_size]
        k = kc[blocks, pos % block_size].double().repeat_interleave(h // kvh, dim=1)
        v = vc[blocks, pos % block_size].double().repeat_interleave(h // kvh, dim=1)
        qs = q[s.q_start: s.q_start + s.q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(s.start_pos, s.ctx_len)[:, None]
        scores = scores.masked_fill(pos[None, :] > qpos, float("-inf"))
        out[s.q_start: s.q_start + s.q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _run(device, spans, t, num_decodes, block_size, h, kvh, d, dtype, seed, sms=None):
    g = torch.Generator().manual_seed(seed + 1)
    kc = torch.randn(NUM_BLOCKS, block_size, kvh, d, generator=g).to(dtype)
    vc = torch.randn(NUM_BLOCKS, block_size, kvh, d, generator=g).to(dtype)
    used = {b for s in spans for b in s.block_ids}
    unused = torch.tensor([b for b in range(NUM_BLOCKS) if b not in used])
    kc[unused] = float("nan")  # must never be read
    vc[unused] = float("nan")
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k, v = torch.randn(t, kvh, d, generator=g).to(dtype), torch.randn(t, kvh, d, generator=g).to(dtype)
    be = TritonAttentionBackend(block_size, device)
    if sms is not None:
        be.num_sms = sms
    meta = be.build_metadata(spans, num_decodes)
    out = torch.full((t, h, d), float("nan"), dtype=dtype, device=device)  # every row must be written
    kcd, vcd = kc.to(device), vc.to(device)
    be.forward(q.to(device), k.to(device), v.to(device), (kcd, vcd), meta, d**-0.5, out=out)
    # the step's K/V landed in their slots
    for s in spans:
        for i in range(s.q_len):
            p = s.start_pos + i
            blk, off = s.block_ids[p // block_size], p % block_size
            assert torch.equal(kcd[blk, off].cpu(), k[s.q_start + i]) and torch.equal(vcd[blk, off].cpu(), v[s.q_start + i])
    ref = _reference(spans, q, kcd.cpu(), vcd.cpu(), block_size, d**-0.5)
    assert not out.isnan().any(), "unwritten output rows or NaN read from an unused block"
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("block_size, h, kvh", [(16, 6, 2), (1, 4, 4), (4, 8, 2), (8, 3, 1)])
def test_mixed_batch_fp32(device, block_size, h, kvh):
    # decodes of ragged contexts; a fresh prefill, a prefix hit (block-aligned start) and a
    # chunk of a chunked prefill (start inside a block)
    spans, t = _batch([1, 37, 70], [(0, 19), (16, 9), (13, 21)], block_size, seed=block_size)
    _run(device, spans, t, 3, block_size, h, kvh, 16, torch.float32, seed=h)


def test_bf16_tolerance(device):
    spans, t = _batch([5, 64, 33], [(0, 40), (24, 17)], 16, seed=3)
    _run(device, spans, t, 3, 16, 8, 2, 32, torch.bfloat16, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode(device, dtype):
    # many SMs for a tiny batch: the contexts are split and merged by log-sum-exp, some
    # splits of the short context are empty
    spans, t = _batch([300, 7, 129], [], 16, seed=5)
    assert decode_split_plan(3, 2, 300, 64)[0] > 1
    _run(device, spans, t, 3, 16, 4, 2, 16, dtype, seed=5, sms=64)


def test_prefill_only_long_chunk(device):
    # query tiles past the first, keys across many blocks, start inside a block
    spans, t = _batch([], [(5, 70), (0, 3)], 4, seed=7)
    _run(device, spans, t, 0, 4, 4, 2, 16, torch.float32, seed=7)


def test_padded_rows_write_nothing_and_read_nothing(device):
    # a CUDA-graph bucket: row 1 is padding (slot -1, context 0) next to a real decode
    be = TritonAttentionBackend(4, device)
    kc = torch.randn(NUM_BLOCKS, 4, 2, 16, device=device)
    vc = torch.randn(NUM_BLOCKS, 4, 2, 16, device=device)
    before = kc.clone()
    table = torch.tensor([[3, 9], [0, 0]], dtype=torch.int32, device=device)
    meta = be.graph_metadata(torch.tensor([9 * 4 + 1, -1], device=device), table,
                             torch.tensor([6, 0], dtype=torch.int32, device=device), max_ctx=64)
    q = torch.randn(2, 4, 16, device=device)
    k, v = torch.randn(2, 2, 16, device=device), torch.randn(2, 2, 16, device=device)
    out = be.forward(q, k, v, (kc, vc), meta, 0.25)
    changed = (kc != before).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
    assert changed == [9]
    assert torch.equal(out[1].cpu(), torch.zeros(4, 16))
    ref = _reference([SeqSpan(0, 1, 5, [3, 9])], q[:1].cpu(), kc.cpu(), vc.cpu(), 4, 0.25)
    torch.testing.assert_close(out[:1].cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_split_plan_bounds():
    assert decode_split_plan(64, 8, 4096, 132) == (1, 4096)  # a full batch needs no split
    splits, split_len = decode_split_plan(1, 8, 8192, 132)
    assert splits > 1 and split_len % 64 == 0 and splits * split_len >= 8192
    assert decode_split_plan(1, 1, 0, 132) == (1, 64)  # padded-only batch


def test_auto_and_errors(device):
    be = get_attention_backend("triton", 16, device)
    assert isinstance(be, TritonAttentionBackend)
    with pytest.raises(ValueError, match="choose from"):
        get_attention_backend("flash", 16, device)
    if device.type == "cpu":
        # on CPU auto keeps the CPU backends; triton runs only because the tests interpret it
        assert not isinstance(get_attention_backend("auto", 16, device), TritonAttentionBackend)
