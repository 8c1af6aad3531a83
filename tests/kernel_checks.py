"""Kernel checks run as scripts in other interpreters (an image's venv, another build tier)."""

# The int8 KV cache's native kernels on the AVX2 build, against PyTorch over the same
# quantized values (as tests/layers/test_kv_int8_kernels.py does on the default build): the
# writer equals layers/kv_cache.py's reference bit for bit, decode and prefill attention over
# the int8 cache equal attention over its dequantized float32 copy. Prints "ok".
INT8_KV_CHECK = """
import torch
from kvmesh.layers import kv_cache as kvq, native
assert native.load("avx2") and native.isa() == "avx2"
g = torch.Generator().manual_seed(0)
for d in (64, 40):
    nb, bs, kvh, h = 40, 16, 3, 9
    x = torch.randn(nb * bs, kvh, d, generator=g)
    kv = kvq.QuantizedKV(*(torch.zeros(nb, bs, kvh, d, dtype=torch.int8) for _ in range(2)),
                         *(torch.zeros(nb, bs, kvh) for _ in range(2)))
    torch.ops.kvmesh.quantize_kv_cache(x, -x, *kv, torch.arange(nb * bs))
    ref = kvq.QuantizedKV(*(torch.zeros_like(t) for t in kv))
    kvq.write(ref, x, -x, torch.arange(nb * bs))
    assert all(torch.equal(a, b) for a, b in zip(kv, ref))
    kd, vd = kvq.dequantize(kv.k, kv.k_scale, torch.float32), kvq.dequantize(kv.v, kv.v_scale, torch.float32)
    table = torch.randperm(nb, generator=g)[:36].view(3, 12)
    lens = torch.tensor([190, 7, 64])
    q = torch.randn(3, h, d, generator=g)
    op = torch.ops.kvmesh.paged_decode_attention
    torch.testing.assert_close(op(q, *kv[:2], table, lens, d**-0.5, 0, *kv[2:]), op(q, kd, vd, table, lens, d**-0.5),
                               rtol=2e-5, atol=2e-5)
    out, want = torch.zeros(40, h, d), torch.zeros(40, h, d)
    spans = torch.tensor([[0, 30, 100], [30, 10, 0]])
    qp = torch.randn(40, h, d, generator=g)
    torch.ops.kvmesh.paged_prefill_attention(out, qp, *kv[:2], table[:2], spans, d**-0.5, 0, *kv[2:])
    torch.ops.kvmesh.paged_prefill_attention(want, qp, kd, vd, table[:2], spans, d**-0.5, 0)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
print("ok")
"""
