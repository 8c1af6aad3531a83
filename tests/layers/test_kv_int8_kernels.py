"""The int8 KV cache's native kernels (csrc/kv_quant.cpp, the int8 paths of
paged_attention.cpp and prefill_attention.cpp) against PyTorch over the same quantized
values: the writer equals layers/kv_cache.py's reference bit for bit, and attention over an
int8 cache equals attention over its dequantized float32 copy to float32 rounding (both see
the same numbers, so the tolerance is tight, not the quantization error's)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.layers import kv_cache as kvq
from kvmesh.layers import native
from kvmesh.layers.attention import SeqSpan, get_attention_backend

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _kernels():
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")


def _int8_cache(nb, bs, kvh, d, g, spread=True):
    """A random int8 cache with scales that vary per row over two decades (a cache written
    from real rows has per-row scales; equal scales would hide a row / scale mix-up)."""
    kc = torch.randint(-127, 128, (nb, bs, kvh, d), dtype=torch.int8, generator=g)
    vc = torch.randint(-127, 128, (nb, bs, kvh, d), dtype=torch.int8, generator=g)
    lo = 1e-3 if spread else 1e-2
    ks = lo * 10 ** (2 * torch.rand(nb, bs, kvh, generator=g)) if spread else torch.full((nb, bs, kvh), lo)
    vs = lo * 10 ** (2 * torch.rand(nb, bs, kvh, generator=g)) if spread else torch.full((nb, bs, kvh), lo)
    return kc, vc, ks, vs


def _deq(c, s):
    return kvq.dequantize(c, s, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_writer_equals_the_torch_reference_bit_for_bit(dtype):
    """Same int8 values and float32 scales from both writers (rows of ordinary, tiny, huge and
    all-zero magnitude; strided rows as rope_qkv leaves them; padded slots skipped)."""
    g = torch.Generator().manual_seed(1)
    nb, bs, kvh, d, t = 16, 4, 3, 40, 50
    qkv = torch.randn(t, 5, kvh, d, generator=g)  # k, v as strided views of a wider tensor
    qkv[3] *= 1e-6
    qkv[4] *= 1e4
    qkv[5, 3:] = 0.0  # zero rows: scale 0, values 0
    k, v = qkv[:, 3].to(dtype), qkv[:, 4].to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[7] = -1  # a padded row writes nothing
    native_kv = kvq.QuantizedKV(*(torch.zeros(nb, bs, kvh, d, dtype=torch.int8) for _ in range(2)),
                                *(torch.zeros(nb, bs, kvh) for _ in range(2)))
    torch.ops.kvmesh.quantize_kv_cache(k, v, *native_kv, slots)
    ref = kvq.QuantizedKV(*(torch.zeros_like(x) for x in native_kv))
    keep = slots >= 0
    kvq.write(ref, k[keep], v[keep], slots[keep])
    for a, b in zip(native_kv, ref):
        assert torch.equal(a, b)
    assert (native_kv.k_scale.view(-1, kvh)[slots[5]] == 0).all() and (native_kv.k.view(-1, kvh, d)[slots[5]] == 0).all()
    assert (native_kv.k_scale.view(-1, kvh)[slots[keep]] > 0).sum() == (t - 2) * kvh  # every other row written


def test_quantization_error_is_half_a_step_of_each_rows_scale():
    """|x - q s| <= s / 2 = max |row| / 254 per element: the bound the engine tests' logit
    tolerances are derived from."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 3, 64, generator=g) * 10 ** torch.randn(300, 3, 1, generator=g)
    q, s = kvq.quantize_rows(x, torch.int8)
    err = (kvq.dequantize(q, s, torch.float32) - x).abs()
    bound = x.abs().amax(-1, keepdim=True) / 254
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    assert q.abs().amax(-1).eq(127).all()  # each row's largest value uses the full range


def _decode_reference(q, k, v, table, lens, scale, window=0):
    """float64 attention of each query over its rows [lo, len) of a float cache."""
    b, h, d = q.shape
    bs, kvh = k.shape[1], k.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        lo = max(0, int(lens[i]) - window) if window else 0
        pos = torch.arange(lo, int(lens[i]))
        blocks = table[i][pos // bs]
        kk = k[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        vv = v[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,khd->hk", q[i].double(), kk) * scale).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", p, vv)
    return out


@pytest.mark.parametrize("batch, d, max_len, window", [
    (1, 64, 1000, 0),    # batch 1: the context split into partitions merged by log-sum-exp
    (2, 64, 300, 0),
    (37, 64, 200, 0),    # many ragged sequences, several chunks each
    (4, 128, 150, 0),    # head sizes of whole vectors: the fixed-width tile loop
    (6, 32, 90, 0),
    (5, 40, 70, 0),      # head size not a multiple of the vector width: the general loop
    (3, 8, 33, 0),       # below one vector
    (4, 64, 300, 50),    # a sliding window
])
def test_int8_decode_equals_float_decode_over_the_dequantized_cache(batch, d, max_len, window):
    g = torch.Generator().manual_seed(batch * 100 + d)
    bs, h, kvh = 16, 9, 3
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[0] = max_len
    nblk = -(-max_len // bs)
    nb = batch * nblk + 8
    table = torch.randperm(nb, generator=g)[: batch * nblk].view(batch, nblk)
    kc, vc, ks, vs = _int8_cache(nb, bs, kvh, d, g)
    q = torch.randn(batch, h, d, generator=g) * 2
    op = torch.ops.kvmesh.paged_decode_attention
    out = op(q, kc, vc, table, lens, d**-0.5, window, ks, vs)
    kd, vd = _deq(kc, ks), _deq(vc, vs)
    torch.testing.assert_close(out, op(q, kd, vd, table, lens, d**-0.5, window), rtol=2e-5, atol=2e-5)
    ref = _decode_reference(q, kd, vd, table, lens, d**-0.5, window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # a bf16 / fp16 model over the same cache: the dequantized values in float32, the output rounded
    for low, tol in ((torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        o = op(q.to(low), kc, vc, table, lens, d**-0.5, window, ks, vs)
        assert o.dtype == low
        torch.testing.assert_close(o.float(), op(q.to(low).float(), kd, vd, table, lens, d**-0.5, window),
                                   rtol=tol, atol=tol)


def test_int8_decode_cascade_over_shared_prefixes():
    """Sequences sharing leading blocks (prefix-cache hits) take the cascade path over an int8
    cache too: equal to the float kernel over the dequantized cache."""
    g = torch.Generator().manual_seed(5)
    bs, h, kvh, d, nb = 16, 9, 3, 64, 600
    kc, vc, ks, vs = _int8_cache(nb, bs, kvh, d, g)
    prefix = list(range(1, 33))  # 32 shared blocks: a 512-token system prompt
    own = [1, 17, 64, 5, 30, 2]
    rows, lens, nxt = [], [], 100
    for n in own:
        blocks = -(-n // bs)
        rows.append(prefix + list(range(nxt, nxt + blocks)))
        nxt += blocks
        lens.append(len(prefix) * bs + n)
    width = max(map(len, rows))
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lens = torch.tensor(lens)
    q = torch.randn(len(own), h, d, generator=g)
    op = torch.ops.kvmesh.paged_decode_attention
    out = op(q, kc, vc, table, lens, d**-0.5, 0, ks, vs)
    torch.testing.assert_close(out, op(q, _deq(kc, ks), _deq(vc, vs), table, lens, d**-0.5), rtol=2e-5, atol=2e-5)


def _prefill_batch(chunks, bs, nb, g):
    free = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    spans, t = [], 0
    for start, n in chunks:
        spans.append(SeqSpan(t, n, start, [free.pop() for _ in range(-(-(start + n) // bs))]))
        t += n
    return spans, t


@pytest.mark.parametrize("chunks, h, kvh, d, window", [
    ([(0, 256)], 9, 3, 64, 0),                         # a fresh prompt: several query and key tiles
    ([(15, 40), (64, 64), (500, 17), (129, 1)], 9, 3, 64, 0),  # chunks behind cached prefixes
    ([(0, 70), (33, 90)], 16, 2, 128, 0),
    ([(3, 45), (0, 9)], 6, 2, 40, 0),                  # head size not a multiple of the vector width
    ([(100, 60), (0, 80)], 9, 3, 64, 32),              # a sliding window
])
def test_int8_prefill_equals_float_prefill_over_the_dequantized_cache(chunks, h, kvh, d, window):
    g = torch.Generator().manual_seed(len(chunks) * 7 + d)
    bs, nb = 16, 400
    spans, t = _prefill_batch(chunks, bs, nb, g)
    kc, vc, ks, vs = _int8_cache(nb, bs, kvh, d, g)
    q = torch.randn(t, h, d, generator=g) * 2
    meta = get_attention_backend("cpu", bs, CPU).build_metadata(spans, 0)
    op = torch.ops.kvmesh.paged_prefill_attention
    out, ref = torch.zeros_like(q), torch.zeros_like(q)
    op(out, q, kc, vc, meta.prefill_table, meta.prefill_spans, d**-0.5, window, ks, vs)
    op(ref, q, _deq(kc, ks), _deq(vc, vs), meta.prefill_table, meta.prefill_spans, d**-0.5, window)
    # (V's scales are folded into the probabilities: a rounding apart, not bit-equal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


def test_int8_kernels_refuse_bad_scales():
    kc = torch.zeros(4, 16, 2, 8, dtype=torch.int8)
    s = torch.zeros(4, 16, 2)
    q = torch.zeros(1, 2, 8)
    table, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    op = torch.ops.kvmesh.paged_decode_attention
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q, kc, kc, table, lens, 1.0)  # an int8 cache without its scales
    with pytest.raises(RuntimeError, match="both k_scale and v_scale"):
        op(q, kc, kc, table, lens, 1.0, 0, s, None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        op(q, kc, kc, table, lens, 1.0, 0, s.double(), s)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        op(q, kc, kc, table, lens, 1.0, 0, s[:, :8], s)
    with pytest.raises(RuntimeError, match="go with an int8 KV cache"):
        op(q, kc.float(), kc.float(), table, lens, 1.0, 0, s, s)
    out = torch.empty(4, 2, 8)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.kvmesh.paged_prefill_attention(out, torch.zeros(4, 2, 8), kc, kc, table,
                                                 torch.tensor([[0, 4, 0]]), 1.0, 0, s, s[:1])
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        torch.ops.kvmesh.quantize_kv_cache(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), kc, kc.clone(), s, s.clone(),
                                           torch.tensor([64]))


# The same kernels on the AVX2 build (8-lane loads, where an AVX-512 CPU's default build takes
# 16-lane ones): tests/kernel_checks.py's INT8_KV_CHECK, run by tests/deploy/test_dockerfile_steps.py
# on the image's baked AVX2 kernels, the suite's one AVX2 build.
