"""The Triton backend over an 8-bit KV cache (int8, and float8 e4m3 for CUDA): its
quantizing store writes what layers/kv_cache.py's reference writes, and its decode /
prefill kernels equal the PyTorch reference backend over the same quantized cache (mixed
batches, split-K decode, bf16, padded graph rows). Interpreted on CPU tensors here."""

from __future__ import annotations

import pytest
import torch
from gpu_marks import requires_triton

from kvmesh.layers import kv_cache as kvq
from kvmesh.layers.attention import SeqSpan, TorchAttentionBackend
from kvmesh.layers.triton_attention import TritonAttentionBackend, decode_split_plan

pytestmark = requires_triton
NB = 64
DTYPES = [torch.int8, torch.float8_e4m3fn]


def _cache(dtype, bs, kvh, d, device, seed=1):
    """A cache filled with quantized random rows (and a few tiny and huge ones)."""
    g = torch.Generator().manual_seed(seed)
    kv = kvq.QuantizedKV(*(torch.zeros(NB, bs, kvh, d, dtype=dtype) for _ in range(2)),
                         *(torch.zeros(NB, bs, kvh) for _ in range(2)))
    x = torch.randn(NB * bs, kvh, d, generator=g)
    x[::7] *= 1e-3
    x[::11] *= 1e3
    kvq.write(kv, x, x.flip(0), torch.arange(NB * bs))
    return kvq.QuantizedKV(*(t.to(device) for t in kv))


def _spans(decode_ctx, prefills, bs, seed):
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    spans, t = [], 0
    for ctx in decode_ctx:
        spans.append(SeqSpan(t, 1, ctx - 1, [free.pop() for _ in range(-(-ctx // bs))]))
        t += 1
    for start, n in prefills:
        spans.append(SeqSpan(t, n, start, [free.pop() for _ in range(-(-(start + n) // bs))]))
        t += n
    return spans, t


def _compare(device, dtype, model_dtype, decode_ctx, prefills, bs=16, h=6, kvh=2, d=32, sms=None, seed=0):
    spans, t = _spans(decode_ctx, prefills, bs, seed)
    g = torch.Generator().manual_seed(seed + 5)
    q, k, v = (torch.randn(t, n, d, generator=g).to(model_dtype) for n in (h, kvh, kvh))
    ours, ref = _cache(dtype, bs, kvh, d, device), _cache(dtype, bs, kvh, d, torch.device("cpu"))
    be = TritonAttentionBackend(bs, device)
    if sms is not None:
        be.num_sms = sms
    out = be.forward(q.to(device), k.to(device), v.to(device), ours, be.build_metadata(spans, len(decode_ctx)),
                     d**-0.5)
    rb = TorchAttentionBackend(bs, torch.device("cpu"))
    want = rb.forward(q, k, v, ref, rb.build_metadata(spans, len(decode_ctx)), d**-0.5)
    for a, b in zip(ours, ref):  # the store wrote the reference's bits
        assert torch.equal(a.cpu().view(torch.uint8) if a.dtype != torch.float32 else a.cpu(),
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
    # relative to the whole output (rows 1000x the others cancel in places)
    err = ((out.cpu().double() - want.double()).norm() / want.double().norm()).item()
    assert err < (1e-5 if model_dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs, h, kvh", [(16, 6, 2), (4, 8, 2), (8, 3, 1)])
def test_mixed_batch_over_an_8bit_cache(device, dtype, bs, h, kvh):
    # ragged decodes, a fresh prefill, a prefix hit and a chunk starting inside a block
    _compare(device, dtype, torch.float32, [1, 37, 70], [(0, 19), (16, 9), (13, 21)], bs=bs, h=h, kvh=kvh,
             seed=bs + h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bf16_model_over_an_8bit_cache(device, dtype):
    _compare(device, dtype, torch.bfloat16, [5, 64, 33], [(0, 40), (24, 17)], seed=3)


def test_split_k_decode_over_an_int8_cache(device):
    assert decode_split_plan(3, 2, 300, 64)[0] > 1
    _compare(device, torch.int8, torch.float32, [300, 7, 129], [], sms=64, seed=5)


def test_padded_rows_write_no_row_and_no_scale(device):
    be = TritonAttentionBackend(4, device)
    kv = _cache(torch.int8, 4, 2, 16, device)
    before = [t.clone() for t in kv]
    table = torch.tensor([[3, 9], [0, 0]], dtype=torch.int32, device=device)
    meta = be.graph_metadata(torch.tensor([9 * 4 + 1, -1], device=device), table,
                             torch.tensor([6, 0], dtype=torch.int32, device=device), max_ctx=64)
    q = torch.randn(2, 4, 16, device=device)
    k, v = torch.randn(2, 2, 16, device=device), torch.randn(2, 2, 16, device=device)
    out = be.forward(q, k, v, kv, meta, 0.25)
    for new, old in zip(kv, before):
        changed = (new != old).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [9]
    assert torch.equal(out[1].cpu(), torch.zeros(4, 16))
