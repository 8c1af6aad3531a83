"""The `triton` attention backend: paged attention in Triton kernels, for CUDA.

Everything reads the paged KV cache in place through block tables (no gather copy, no
per-sequence Python loop, no padding of K/V). Per layer and step:

1. `_store_kv`: each token's K/V row goes to `slot_mapping[t]` (a slot < 0 is a padding
   row of a CUDA-graph bucket and is skipped).
2. decode tokens (q_len 1, first in the flat batch): `_decode_split`, one program per
   (sequence, KV head, split of the context). The G = H / KVH query heads sharing a KV head
   are the rows of one tile, so each K/V row is loaded once per group (GQA). Long contexts
   are split (split-K, "flash decoding") so a small batch still fills the GPU; each split
   writes a partial output and its log-sum-exp, merged by `_decode_reduce`. With one split
   the kernel writes the final output directly.
3. prefill / extend chunks: `_prefill`, one launch for the whole varlen batch, one program
   per (sequence, query head, tile of BLOCK_M queries). Keys are read from the cache
   (cached prefix blocks and this step's rows, written in step 1), causal by position.

Sliding-window layers (`window` > 0): a query at position p sees keys in (p - window, p];
keys before that are never loaded (their blocks may be freed: engine/kv_cache_manager.py),
the decode split plan covers the window, not the context, and prefill key tiles before a
query tile's window are skipped.

Numerics: scores and softmax in float32; the P @ V product in the cache dtype with a float32
accumulator (float32 models use IEEE float32 dots, not TF32). Rows nobody asked for (padded
query rows, empty splits) are never stored into the output; a context of length 0 (a padded
graph row) yields zeros, never NaN.

An 8-bit cache (`kv_cache.QuantizedKV`: int8 or float8 e4m3 with a float32 scale per token
and KV head): `_store_kv_quant` quantizes each (token, KV head) row as it stores it (the
scheme of layers/kv_cache.py, int8 rounded to nearest even like torch.round), and the
attention kernels (QUANT) load the 8-bit tiles, widen them and multiply by their rows'
scales in registers, then proceed in the model's dtype as above: the cache is read at a
quarter of float32's bytes (plus 4 per row) and never dequantized into memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.layers.kv_cache import QuantizedKV, qmax
from kvmesh.layers.slots import slot_mapping
from kvmesh.layers.triton_runtime import (
    INTERPRET,
    can_run,
    dot,
    next_pow2,
    num_sms,
    tl,
    to_dtype,
    triton,
    unavailable_reason,
)

DECODE_BLOCK_N = 64
MAX_SPLITS = 64

if triton is not None:
    _INTERPRET = tl.constexpr(INTERPRET)  # a global read inside @jit code must be a constexpr

    @triton.jit
    def _store_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt,
                  ROW: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            m = offs < ROW
            k = tl.load(k_ptr + t * stride_kt + offs, mask=m)
            v = tl.load(v_ptr + t * stride_vt + offs, mask=m)
            tl.store(kc_ptr + slot * ROW + offs, k, mask=m)
            tl.store(vc_ptr + slot * ROW + offs, v, mask=m)

    @triton.jit
    def _store_kv_quant(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, stride_kt, stride_kh,
                        stride_vt, stride_vh, QMAX: tl.constexpr, INT8: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        """Program (token, KV head): its K and V rows quantized into their slot, scales beside."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        kvh = tl.num_programs(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK_D)
            m = offs < D
            _quant_row(k_ptr + t * stride_kt + h * stride_kh, kc_ptr + (slot * kvh + h) * D, ks_ptr + slot * kvh + h,
                       offs, m, QMAX, INT8)
            _quant_row(v_ptr + t * stride_vt + h * stride_vh, vc_ptr + (slot * kvh + h) * D, vs_ptr + slot * kvh + h,
                       offs, m, QMAX, INT8)

    @triton.jit
    def _rne(r):
        """r rounded to the nearest integer, ties to even (torch.round's rule; a float -> int
        cast would truncate)."""
        f = tl.floor(r)
        frac = r - f
        odd = f - 2.0 * tl.floor(f * 0.5)  # 1 for an odd f: a tie goes to the even neighbour
        return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))

    @triton.jit
    def _round_e4m3(r):
        """|r| <= 448 rounded to float8 e4m3's grid, ties to even, still in float32: the
        interpreter's own float8 cast gets carries into the exponent wrong (124.7 -> 64)."""
        bits = r.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # 3 mantissa bits kept
        normal = bits.to(tl.float32, bitcast=True)
        sub = _rne(r * 512.0) / 512.0  # below 2^-6 the grid is 2^-9 (subnormals)
        return tl.where(tl.abs(r) < 0.015625, sub, normal)

    @triton.jit
    def _quant_row(src, dst, scale_dst, offs, m, QMAX: tl.constexpr, INT8: tl.constexpr):
        x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        a = tl.max(tl.abs(x), 0)
        inv = tl.where(a > 0, tl.math.div_rn(QMAX, tl.maximum(a, 1e-38)), 0.0)
        r = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)
        if INT8:
            r = _rne(r)
        elif _INTERPRET:
            r = _round_e4m3(r)
        tl.store(dst + offs, r.to(dst.dtype.element_ty), mask=m)
        tl.store(scale_dst, tl.math.div_rn(a, QMAX))

    @triton.jit
    def _load_kv(c_ptr, s_ptr, row, srow, d, pm, kv_mask, QUANT: tl.constexpr, DT: tl.constexpr):
        """A (BLOCK_N, BLOCK_D) tile of cache rows: as stored, or (QUANT) widened and scaled by
        each row's scale (at s_ptr + srow) into the model's dtype DT."""
        x = tl.load(c_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            sc = tl.load(s_ptr + srow, mask=pm, other=0.0)
            x = to_dtype(x.to(tl.float32) * sc[:, None], DT)
        return x

    @triton.jit
    def _decode_split(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, o_ptr, mid_ptr, lse_ptr,
                      scale, split_len, num_splits, window,
                      stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ot, stride_oh,
                      BS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
                      QUANT: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # first key in the window
        start = lo + s * split_len
        end = tl.minimum(ctx, start + split_len)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, BLOCK_D)
        gm = g < G
        dm = d < D
        heads = kvh * G + g
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([G_PAD], -1e30, tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pm = pos < end
            blk = tl.load(table_ptr + b * stride_tb + pos // BS, mask=pm, other=0).to(tl.int64)
            row = blk * stride_cb + (pos % BS) * stride_ct + kvh * stride_ch
            srow = (blk * BS + pos % BS) * tl.num_programs(1) + kvh  # the rows' scales (QUANT)
            kv_mask = pm[:, None] & dm[None, :]
            k = _load_kv(kc_ptr, ks_ptr, row, srow, d, pm, kv_mask, QUANT, q_ptr.dtype.element_ty)
            sc = dot(q, tl.trans(k), IEEE)
            sc = tl.where(pm[None, :], sc * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_kv(vc_ptr, vs_ptr, row, srow, d, pm, kv_mask, QUANT, q_ptr.dtype.element_ty)
            acc = acc * alpha[:, None] + dot(to_dtype(p, v.dtype), v, IEEE)
            m_i = m_new
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        omask = gm[:, None] & dm[None, :]
        if DIRECT:
            tl.store(o_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     to_dtype(out, o_ptr.dtype.element_ty), mask=omask)
        else:
            # mid: (B, H, S, BLOCK_D) float32, lse: (B, H, S) float32, both contiguous
            row_id = (b * (tl.num_programs(1) * G) + heads) * num_splits + s
            tl.store(mid_ptr + row_id[:, None] * BLOCK_D + d[None, :], out, mask=omask)
            tl.store(lse_ptr + row_id, tl.where(empty, float("-inf"), m_i + tl.log(l_i)), mask=gm)

    @triton.jit
    def _decode_reduce(mid_ptr, lse_ptr, o_ptr, num_splits, stride_ot, stride_oh,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, BLOCK_D)
        sm = s < num_splits
        base = (b * tl.num_programs(1) + h) * num_splits
        lse = tl.load(lse_ptr + base + s, mask=sm, other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.exp(lse - tl.where(mx == float("-inf"), 0.0, mx))
        denom = tl.sum(w, 0)
        part = tl.load(mid_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=sm[:, None], other=0.0)
        out = tl.sum(w[:, None] * part, 0) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(o_ptr + b * stride_ot + h * stride_oh + d, to_dtype(out, o_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _prefill(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, o_ptr, table_ptr, qstart_ptr, qlen_ptr, startpos_ptr, scale,
                 window, stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ot, stride_oh,
                 BS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr):
        p = tl.program_id(0)
        h = tl.program_id(1)
        mt = tl.program_id(2)
        q_len = tl.load(qlen_ptr + p)
        if mt * BLOCK_M < q_len:
            q0 = tl.load(qstart_ptr + p).to(tl.int64)
            sp = tl.load(startpos_ptr + p)
            m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
            mm = m < q_len
            qpos = sp + m
            d = tl.arange(0, BLOCK_D)
            dm = d < D
            q = tl.load(q_ptr + (q0 + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                        mask=mm[:, None] & dm[None, :], other=0.0)
            kvh = h // G
            hi = sp + tl.minimum(q_len, (mt + 1) * BLOCK_M)  # keys [lo, hi) can be seen by this tile
            lo = tl.where(window > 0, tl.maximum(sp + mt * BLOCK_M - window + 1, 0), 0)
            m_i = tl.full([BLOCK_M], -1e30, tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                pm = (pos < hi) & (pos >= lo)
                blk = tl.load(table_ptr + p * stride_tb + pos // BS, mask=pm, other=0).to(tl.int64)
                row = blk * stride_cb + (pos % BS) * stride_ct + kvh * stride_ch
                srow = (blk * BS + pos % BS) * (tl.num_programs(1) // G) + kvh
                kv_mask = pm[:, None] & dm[None, :]
                k = _load_kv(kc_ptr, ks_ptr, row, srow, d, pm, kv_mask, QUANT, q_ptr.dtype.element_ty)
                sc = dot(q, tl.trans(k), IEEE)
                ok = pm[None, :] & (pos[None, :] <= qpos[:, None]) & (
                    (pos[None, :] > qpos[:, None] - window) | (window <= 0))
                sc = tl.where(ok, sc * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                pr = tl.exp(sc - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(pr, 1)
                v = _load_kv(vc_ptr, vs_ptr, row, srow, d, pm, kv_mask, QUANT, q_ptr.dtype.element_ty)
                acc = acc * alpha[:, None] + dot(to_dtype(pr, v.dtype), v, IEEE)
                m_i = m_new
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + (q0 + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
                     to_dtype(out, o_ptr.dtype.element_ty), mask=mm[:, None] & dm[None, :])


def decode_split_plan(batch: int, kv_heads: int, max_ctx: int, sms: int,
                      block_n: int = DECODE_BLOCK_N) -> tuple[int, int]:
    """(num_splits, split_len) for a decode batch whose longest context is `max_ctx`.

    Enough (sequence, KV head, split) programs for about two waves over the SMs, but at
    least two key tiles per split (a split's fixed cost is its partial output's write
    and merge). split_len is a multiple of block_n; splits past a context are empty.
    """
    want = -(-2 * sms // max(batch * kv_heads, 1))
    by_len = max(-(-max_ctx // (2 * block_n)), 1)
    splits = max(1, min(want, by_len, MAX_SPLITS))
    split_len = -(-max(-(-max_ctx // splits), 1) // block_n) * block_n
    return -(-max_ctx // split_len) if max_ctx > 0 else 1, split_len


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64; a negative slot is a padding row (not written)
    # Decodes (q_len == 1) come first in the flat batch: tokens [0, num_decodes).
    num_decodes: int
    decode_block_table: torch.Tensor | None  # (Bd, max_blocks) int32, padded with block 0
    decode_context_lens: torch.Tensor | None  # (Bd,) int32; 0 for a padding row
    # Upper bound of the decode contexts: fixes the split-K plan (a CUDA graph's stays
    # valid for every replay because its bound is max_model_len).
    max_decode_ctx: int
    # Prefill / extend chunks, all in one launch: per chunk its first row in the flat
    # batch, its length, its first position and its block table row.
    num_prefills: int = 0
    prefill_block_table: torch.Tensor | None = None  # (P, max_blocks) int32
    prefill_q_start: torch.Tensor | None = None  # (P,) int32
    prefill_q_len: torch.Tensor | None = None  # (P,) int32
    prefill_start_pos: torch.Tensor | None = None  # (P,) int32
    max_prefill_len: int = 0
    # Split-K partials, allocated on first use and shared by every layer of the step.
    scratch: dict = field(default_factory=dict)


def _table(spans, block_size: int) -> np.ndarray:
    nblk = max(max(-(-s.ctx_len // block_size) for s in spans), 1)
    table = np.zeros((len(spans), nblk), dtype=np.int32)
    for i, s in enumerate(spans):
        n = -(-s.ctx_len // block_size)
        table[i, :n] = s.block_ids[:n]
    return table


class TritonAttentionBackend:
    """Paged attention in Triton kernels (see the module docstring)."""

    supports_cuda_graphs = True

    def __init__(self, block_size: int, device: torch.device):
        if not can_run(device):
            raise ValueError(f"attention backend 'triton': {unavailable_reason(device)}")
        self.block_size = block_size
        self.device = device
        self.num_sms = num_sms(device)

    def _to(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def build_metadata(self, spans, num_decodes: int) -> TritonAttentionMetadata:
        bs = self.block_size
        meta = TritonAttentionMetadata(self._to(slot_mapping(spans, bs)), num_decodes, None, None, 0)
        if num_decodes:
            dec = spans[:num_decodes]
            meta.max_decode_ctx = max(s.ctx_len for s in dec)
            meta.decode_block_table = self._to(_table(dec, bs))
            meta.decode_context_lens = self._to(np.array([s.ctx_len for s in dec], dtype=np.int32))
        prefills = spans[num_decodes:]
        if prefills:
            meta.num_prefills = len(prefills)
            meta.prefill_block_table = self._to(_table(prefills, bs))
            meta.prefill_q_start = self._to(np.array([s.q_start for s in prefills], dtype=np.int32))
            meta.prefill_q_len = self._to(np.array([s.q_len for s in prefills], dtype=np.int32))
            meta.prefill_start_pos = self._to(np.array([s.start_pos for s in prefills], dtype=np.int32))
            meta.max_prefill_len = max(s.q_len for s in prefills)
        return meta

    def graph_metadata(self, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                       context_lens: torch.Tensor, max_ctx: int) -> TritonAttentionMetadata:
        """Decode-only metadata over caller-owned (static) buffers, for CUDA-graph capture:
        the split plan is fixed for contexts up to `max_ctx`, so any replay is valid."""
        return TritonAttentionMetadata(slot_mapping, block_table.shape[0], block_table, context_lens, max_ctx)

    def forward(self, q, k, v, kv_cache, meta: TritonAttentionMetadata, scale: float,
                window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D) -> (T, H, D), into `out` when given. `window`:
        a sliding-window layer's window (None: full attention)."""
        quant = isinstance(kv_cache, QuantizedKV)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # (an unused pointer for a float cache: QUANT is off and the kernels never read it)
        k_scale, v_scale = (kv_cache.k_scale, kv_cache.v_scale) if quant else (k_cache, v_cache)
        t, h, d = q.shape
        nb, bs, kvh, _ = k_cache.shape
        if k.stride(-1) != 1 or k.stride(-2) != d or v.stride(-1) != 1 or v.stride(-2) != d:
            k, v = k.contiguous(), v.contiguous()
        if q.stride(-1) != 1:
            q = q.contiguous()
        row = kvh * d
        if quant:
            _store_kv_quant[(t, kvh)](k, v, k_cache, v_cache, k_scale, v_scale, meta.slot_mapping, k.stride(0),
                                      k.stride(1), v.stride(0), v.stride(1), QMAX=qmax(k_cache.dtype),
                                      INT8=k_cache.dtype == torch.int8, D=d, BLOCK_D=next_pow2(d))
        else:
            _store_kv[(t,)](k, v, k_cache, v_cache, meta.slot_mapping, k.stride(0), v.stride(0),
                            ROW=row, BLOCK=next_pow2(row))
        out = torch.empty_like(q) if out is None else out
        ieee = q.dtype == torch.float32
        block_d = max(next_pow2(d), 16)
        strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        nd = meta.num_decodes
        win = window or 0
        if nd:
            g = h // kvh
            span = meta.max_decode_ctx if not win else min(meta.max_decode_ctx, win)
            s, split_len = decode_split_plan(nd, kvh, span, self.num_sms)
            if s > 1:
                key = (nd, h, s, block_d)
                mid, lse = meta.scratch.get(key, (None, None))
                if mid is None:
                    mid = torch.empty((nd, h, s, block_d), dtype=torch.float32, device=q.device)
                    lse = torch.empty((nd, h, s), dtype=torch.float32, device=q.device)
                    meta.scratch[key] = (mid, lse)
            else:
                mid = lse = out  # unused: the kernel writes the output directly
            _decode_split[(nd, kvh, s)](
                q, k_cache, v_cache, k_scale, v_scale, meta.decode_block_table, meta.decode_context_lens, out, mid, lse,
                scale, split_len, s, win, q.stride(0), q.stride(1), *strides,
                meta.decode_block_table.stride(0), out.stride(0), out.stride(1),
                BS=bs, G=g, G_PAD=max(next_pow2(g), 16), D=d, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N,
                DIRECT=s == 1, IEEE=ieee, QUANT=quant)
            if s > 1:
                _decode_reduce[(nd, h)](mid, lse, out, s, out.stride(0), out.stride(1),
                                        D=d, BLOCK_D=block_d, S_PAD=max(next_pow2(s), 2))
        if meta.num_prefills:
            block_m = 64 if q.element_size() <= 2 else 32
            block_m = min(block_m, max(next_pow2(meta.max_prefill_len), 16))
            grid = (meta.num_prefills, h, -(-meta.max_prefill_len // block_m))
            _prefill[grid](
                q, k_cache, v_cache, k_scale, v_scale, out, meta.prefill_block_table, meta.prefill_q_start,
                meta.prefill_q_len,
                meta.prefill_start_pos, scale, win, q.stride(0), q.stride(1), *strides,
                meta.prefill_block_table.stride(0), out.stride(0), out.stride(1),
                BS=bs, G=h // kvh, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=32, IEEE=ieee, QUANT=quant)
        return out
