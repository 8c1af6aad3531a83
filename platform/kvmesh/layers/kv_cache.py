"""The 8-bit KV cache (`kv_cache_dtype` int8, or fp8_e4m3 on CUDA): K and V stored in one
byte per value with a float32 scale per (token, KV head) beside them, dequantized inside
the attention kernels as they read.

A layer's cache is then `QuantizedKV(k, v, k_scale, v_scale)` instead of the pair (k, v):

    k, v              (num_blocks, block_size, kv_heads, head_dim)  int8 / float8_e4m3fn
    k_scale, v_scale  (num_blocks, block_size, kv_heads)            float32

A row x (the head_dim values of one token and KV head) is stored as q = round(x * QMAX / a)
with s = a / QMAX, a = max |x| (QMAX 127 for int8, 448 for e4m3), and read as q * s. Every
backend writes the same bits (the native writer, csrc/kv_quant.cpp, repeats
`quantize_rows`'s float32 operations in order), and every backend reads the whole context
through the cache, the step's own tokens included: what a query sees does not depend on
whether its keys were computed this step, in an earlier chunk, or loaded from a prefix hit,
the store or a P/D transfer.

Why scales per (token, KV head), computed when the row is written:
- no calibration and no static scale: a per-tensor scale (vLLM's fp8 k_scale / v_scale)
  must cover the largest row ever written, and a few outlier tokens (attention-sink keys
  are often 10-100x the typical norm) would crush every other row into a few levels;
- each write stands alone: a block filling token by token never rescales the rows already
  in it (a per-block scale would need a read-modify-write, or a stale bound), and blocks
  move (prefix cache, KV store, P/D transfer) and are freed together with their scales;
- it costs 4 bytes per row, 6% of an int8 row at head_dim 64 (68 bytes vs 256 in fp32:
  3.8x the tokens in one memory budget; 1.9x vs bf16);
- per element the rounding error is at most s / 2 = a / 254 (0.4% of the row's largest
  value; ~1% of a SmolLM2 K / V row's norm). Through its 30 layers that moves the logits by
  ~0.1 on average and by up to ~4% of the largest logit; the argmax agrees with the fp32
  cache's at ~99% of positions, perplexity rises ~0.4%, and greedy decoding parts from the
  fp32 cache's only where its two best tokens were within a few hundredths of a logit
  (tests/models/test_embedded_kv_int8.py, benchmarks/kv_cache_dtype.py).

Memory: `bytes_per_token` feeds the cache sizing (build.py), so the same
`kv_cache_memory_gb` holds ~3.8x the blocks of an fp32 cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvmesh.errors import ConfigError

# kv_cache_dtype -> (storage dtype, largest magnitude stored)
QUANTIZED: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
}
ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's spelling: fp8 is e4m3
SCALE_BYTES = 4  # float32 per (token, KV head) row


class QuantizedKV(NamedTuple):
    """One layer's 8-bit KV cache (see the module doc)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def resolve(kv_cache_dtype: str, device: torch.device) -> str | None:
    """The quantized cache format `kv_cache_dtype` asks for on `device`: "int8", "fp8_e4m3",
    or None (auto: the model's dtype). Raises ConfigError where it cannot run."""
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name == "auto":
        return None
    if name not in QUANTIZED:
        raise ConfigError(f"cache.kv_cache_dtype: {kv_cache_dtype!r} is not one of auto, int8, fp8, fp8_e4m3")
    if name == "fp8_e4m3":
        if device.type != "cuda":
            raise ConfigError(f"cache.kv_cache_dtype: {kv_cache_dtype} needs a CUDA device (fp8 has no CPU "
                              f"attention kernel here); on {device.type} use --kv-cache-dtype int8")
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ConfigError(f"cache.kv_cache_dtype: {kv_cache_dtype} needs a GPU of compute capability "
                              f">= 8.9 (Ada, Hopper); this one is "
                              f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}: use int8")
    return name


def bytes_per_token(kv_heads: int, head_dim: int, model_dtype: torch.dtype, quant: str | None) -> int:
    """Bytes one token takes in one layer's K and V (scales included)."""
    if quant is None:
        return 2 * kv_heads * head_dim * torch.empty((), dtype=model_dtype).element_size()
    return 2 * kv_heads * (head_dim + SCALE_BYTES)


def unpack(kv_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(k, v, k_scale, v_scale) of a layer's cache; the scales are None for a float cache."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache
    k, v = kv_cache
    return k, v, None, None


def qmax(dtype: torch.dtype) -> float:
    for storage, limit in QUANTIZED.values():
        if storage == dtype:
            return limit
    raise ValueError(f"{dtype} is not a quantized KV cache dtype")


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q (..., D) in `dtype`, scale (...) float32) with x ~= q * scale.

    Every step a true float32 division (tensor / tensor): `127 / a` on a Python number
    would run as a reciprocal times 127, another rounding than the native writer's."""
    x = x.float()
    limit = qmax(dtype)
    a = x.abs().amax(-1)
    lim = torch.full_like(a, limit)
    inv = torch.where(a > 0, lim / a, torch.zeros_like(a))
    r = x * inv[..., None]
    if dtype == torch.int8:
        q = r.round_().clamp_(-limit, limit).to(torch.int8)
    else:
        q = r.clamp_(-limit, limit).to(dtype)
    return q, a / lim


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., D), scale (...) -> (..., D) in `dtype` (computed in float32)."""
    return (q.float() * scale[..., None]).to(dtype)


def write(kv: QuantizedKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize k, v (T, KVH, D) into their slots (PyTorch; any device). Slots must be >= 0."""
    nb, bs, kvh, d = kv.k.shape
    for rows, cache, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
        q, s = quantize_rows(rows, cache.dtype)
        # (as bytes: torch has no CPU index_copy_ / index_select for float8)
        cache.view(torch.uint8).view(nb * bs, kvh, d).index_copy_(0, slot_mapping, q.view(torch.uint8))
        scales.view(nb * bs, kvh).index_copy_(0, slot_mapping, s)


def gather(cache: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` of a quantized cache (either blocks of (nb, bs, kvh, d) or flat slots of
    (nb * bs, kvh, d), as `cache` and `scales` are shaped), dequantized into `dtype`."""
    rows = cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return dequantize(rows, scales.index_select(0, index), dtype)
