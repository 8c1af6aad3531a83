"""Paged attention over a flat batch of tokens.

The KV cache of one layer is a pair of tensors (K, V), each (num_blocks, block_size,
kv_heads, head_dim), or with an 8-bit cache a `kv_cache.QuantizedKV` (int8 / fp8 K and V
plus a scale per token and KV head; every backend quantizes as it writes and dequantizes as
it reads, see layers/kv_cache.py). A token's KV lives at slot = block_id * block_size +
offset; the runner passes each token's slot (`slot_mapping`) and each sequence's block table.

Backends implement `AttentionBackend`: `build_metadata` once per step (shared by every
layer), `forward` once per layer. `TorchAttentionBackend` is the reference that runs on
any device with plain PyTorch ops (SDPA); `triton` (triton_attention.py) is the CUDA
backend behind the same interface, with its own metadata type.

Sliding-window layers (`forward(..., window=w)`): a query at position p sees keys in
(p - w, p]. No backend reads a key before its query's window: when every layer slides the
engine frees the blocks wholly before it (engine/kv_cache_manager.py) and the block table
then names the null block there. The reference builds its windowed tables and masks at the
first layer that asks for a window and keeps them in the step's metadata for the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from kvmesh.config import KernelConfig
from kvmesh.layers import kv_cache as kvq
from kvmesh.layers import native, slots
from kvmesh.layers.triton_attention import TritonAttentionBackend
from kvmesh.layers.triton_runtime import can_run as triton_can_run


@dataclass
class SeqSpan:
    """A sequence in the flat batch: tokens [q_start, q_start + q_len) at positions
    [start_pos, start_pos + q_len), attending to all ctx_len = start_pos + q_len keys."""

    q_start: int
    q_len: int
    start_pos: int
    block_ids: list[int]

    @property
    def ctx_len(self) -> int:
        return self.start_pos + self.q_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    # Decodes (q_len == 1) come first in the flat batch: tokens [0, num_decodes).
    num_decodes: int
    decode_block_table: torch.Tensor | None  # (Bd, max_blocks) int64, padded with block 0
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, max_blocks * block_size) bool
    decode_context_lens: torch.Tensor | None  # (Bd,) int64
    # Everything else (prefill chunks).
    prefills: list[SeqSpan]
    # The reference backend attends each chunk separately with SDPA:
    prefill_block_tables: list[torch.Tensor | None] = field(default_factory=list)  # None: fresh, no cache read
    prefill_masks: list[torch.Tensor | None] = field(default_factory=list)  # (q_len, ctx_len), None: causal from 0
    # The CPU kernel attends them all in one call, through the cache:
    prefill_spans: torch.Tensor | None = None  # (P, 3) int64 rows (q_start, q_len, start_pos)
    prefill_table: torch.Tensor | None = None  # (P, max_blocks) int64, padded with block 0
    decodes: list[SeqSpan] = field(default_factory=list)
    # The reference's tables and masks per sliding window, built at the first layer with that
    # window and shared by the others: ("decode" | "prefill", window) -> plan.
    window_plans: dict = field(default_factory=dict)


class AttentionBackend(Protocol):
    def build_metadata(self, spans: list[SeqSpan], num_decodes: int) -> AttentionMetadata: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | kvq.QuantizedKV,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """`window`: a sliding-window layer's window (a query at position p sees keys in
        (p - window, p]); None: full causal attention."""
        ...


class TorchAttentionBackend:
    """Reference backend: gathers each batch's blocks, then SDPA. Runs on any device."""

    needs_decode_mask = True

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    def build_metadata(self, spans: list[SeqSpan], num_decodes: int) -> AttentionMetadata:
        bs = self.block_size
        slot_mapping = torch.from_numpy(slots.slot_mapping(spans, bs)).to(self.device)
        meta = AttentionMetadata(slot_mapping, num_decodes, *self._decode_metadata(spans[:num_decodes]),
                                 prefills=spans[num_decodes:], decodes=spans[:num_decodes])
        self._prefill_metadata(meta)
        return meta

    def _decode_metadata(self, dec: list[SeqSpan]) -> tuple[torch.Tensor | None, ...]:
        """(block table, mask, context lengths) of the decodes."""
        bs, num_decodes = self.block_size, len(dec)
        decode_table = decode_mask = decode_lens = None
        if num_decodes:
            nblk = max(-(-s.ctx_len // bs) for s in dec)
            table = np.zeros((num_decodes, nblk), dtype=np.int64)
            ctx = np.empty(num_decodes, dtype=np.int64)
            for i, s in enumerate(dec):
                n = -(-s.ctx_len // bs)
                table[i, :n] = s.block_ids[:n]
                ctx[i] = s.ctx_len
            decode_table = torch.from_numpy(table).to(self.device)
            decode_lens = torch.from_numpy(ctx).to(self.device)
            if self.needs_decode_mask:
                mask = np.arange(nblk * bs)[None, :] < ctx[:, None]
                decode_mask = torch.from_numpy(mask).to(self.device)[:, None, None, :]
        return decode_table, decode_mask, decode_lens

    def _prefill_metadata(self, meta: AttentionMetadata) -> None:
        """Per chunk: its block table and mask when it reads cached tokens."""
        bs = self.block_size
        tables, masks = meta.prefill_block_tables, meta.prefill_masks
        for s in meta.prefills:
            if s.start_pos == 0:
                tables.append(None)
                masks.append(None)
                continue
            n = -(-s.ctx_len // bs)
            tables.append(torch.tensor(s.block_ids[:n], dtype=torch.int64, device=self.device))
            # query i (position start_pos + i) sees keys j <= start_pos + i; an additive
            # float mask (a boolean one keeps SDPA on its slow math path on CPU)
            q_pos = torch.arange(s.start_pos, s.ctx_len, device=self.device)[:, None]
            k_pos = torch.arange(s.ctx_len, device=self.device)[None, :]
            masks.append(torch.zeros(q_pos.shape[0], s.ctx_len, device=self.device)
                         .masked_fill_(k_pos > q_pos, float("-inf")))

    def _windowed_decode(self, meta: AttentionMetadata, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table, mask) of the decodes for a sliding window: per sequence the blocks
        from the one holding its first visible key, the mask true on keys in its window."""
        bs = self.block_size
        first = [max(0, s.ctx_len - window) // bs for s in meta.decodes]
        nblk = max(-(-s.ctx_len // bs) - f for s, f in zip(meta.decodes, first))
        table = np.zeros((len(meta.decodes), nblk), dtype=np.int64)
        mask = np.zeros((len(meta.decodes), nblk * bs), dtype=bool)
        for i, (s, f) in enumerate(zip(meta.decodes, first)):
            n = -(-s.ctx_len // bs)
            table[i, : n - f] = s.block_ids[f:n]
            k_pos = f * bs + np.arange(nblk * bs)
            mask[i] = (k_pos >= s.ctx_len - window) & (k_pos < s.ctx_len)
        return (torch.from_numpy(table).to(self.device),
                torch.from_numpy(mask).to(self.device)[:, None, None, :])

    def _decode_plan(self, meta: AttentionMetadata, window: int | None):
        if window is None or all(s.ctx_len <= window for s in meta.decodes):
            return meta.decode_block_table, meta.decode_mask
        key = ("decode", window)
        if key not in meta.window_plans:
            meta.window_plans[key] = self._windowed_decode(meta, window)
        return meta.window_plans[key]

    def _prefill_plan(self, meta: AttentionMetadata, window: int | None):
        """Per chunk (block table or None: its own fresh K/V, mask or None: causal, first key
        position the table starts at)."""
        if len(meta.prefill_masks) != len(meta.prefills):  # the CPU backend builds these only when needed
            TorchAttentionBackend._prefill_metadata(self, meta)
        if window is None or all(s.ctx_len <= window for s in meta.prefills):
            return list(zip(meta.prefill_block_tables, meta.prefill_masks, [0] * len(meta.prefills)))
        key = ("prefill", window)
        if key not in meta.window_plans:
            meta.window_plans[key] = [self._windowed_prefill(s, window) for s in meta.prefills]
        return meta.window_plans[key]

    def _windowed_prefill(self, s: SeqSpan, window: int):
        bs = self.block_size
        first = max(0, s.start_pos - window + 1) // bs if s.start_pos else 0
        k0 = first * bs
        q_pos = torch.arange(s.start_pos, s.ctx_len, device=self.device)[:, None]
        k_pos = torch.arange(k0, s.ctx_len, device=self.device)[None, :]
        mask = torch.zeros(q_pos.shape[0], k_pos.shape[1], device=self.device).masked_fill_(
            (k_pos > q_pos) | (k_pos <= q_pos - window), float("-inf"))
        table = None
        if s.start_pos:
            table = torch.tensor(s.block_ids[first : -(-s.ctx_len // bs)], dtype=torch.int64, device=self.device)
        return table, mask, k0

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, KVH, D) -> (T, H, D)."""
        # Write this step's K/V first: later tokens of the step (and other sequences
        # that hit blocks registered this step) read them below.
        self._write(kv_cache, k, v, meta)
        nd = meta.num_decodes
        if nd == q.shape[0] and not meta.prefills:  # an all-decode step: no scatter into `out`
            return self._decode(q, kv_cache, meta, scale, window)
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, window)
        self._prefill(q, k, v, kv_cache, meta, scale, out, window)
        return out

    def _write(self, kv_cache, k, v, meta: AttentionMetadata) -> None:
        """This step's K/V rows into their slots (quantized for an 8-bit cache)."""
        if isinstance(kv_cache, kvq.QuantizedKV):
            kvq.write(kv_cache, k, v, meta.slot_mapping)
            return
        k_cache, v_cache = kv_cache
        nb, bs, kvh, d = k_cache.shape
        k_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, v)

    def _prefill(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, out,
                 window: int | None = None) -> None:
        """Attention of the prefill chunks' queries, written into their rows of `out`."""
        k_cache, v_cache, k_scale, v_scale = kvq.unpack(kv_cache)
        group = q.shape[1] // k_cache.shape[2]
        for s, (table, mask, k0) in zip(meta.prefills, self._prefill_plan(meta, window)):
            sl = slice(s.q_start, s.q_start + s.q_len)
            # SDPA's fused (flash) kernels take 4-D (1, H, L, D) inputs with K/V repeated per
            # query head; 3-D inputs or enable_gqa fall back to its math path (2.7x slower
            # on a 384-token prefill here).
            qs = q[sl].transpose(0, 1)[None]
            if table is None and k_scale is None:
                ks, vs = k[sl], v[sl]  # (L, KVH, D)
            elif table is None:  # an 8-bit cache: the chunk's own rows as stored, like any other
                nb, bs, kvh, d = k_cache.shape
                rows = meta.slot_mapping[sl]
                ks = kvq.gather(k_cache.view(nb * bs, kvh, d), k_scale.view(nb * bs, kvh), rows, q.dtype)
                vs = kvq.gather(v_cache.view(nb * bs, kvh, d), v_scale.view(nb * bs, kvh), rows, q.dtype)
            elif k_scale is None:
                # (C, KVH, D): keys at positions [k0, ctx_len)
                ks = k_cache.index_select(0, table).flatten(0, 1)[: s.ctx_len - k0]
                vs = v_cache.index_select(0, table).flatten(0, 1)[: s.ctx_len - k0]
            else:  # only the chunk's blocks are dequantized, never the cache
                ks = kvq.gather(k_cache, k_scale, table, q.dtype).flatten(0, 1)[: s.ctx_len - k0]
                vs = kvq.gather(v_cache, v_scale, table, q.dtype).flatten(0, 1)[: s.ctx_len - k0]
            ks = ks.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # (1, H, C, D)
            vs = vs.transpose(0, 1).repeat_interleave(group, dim=0)[None]
            if mask is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[sl] = o[0].transpose(0, 1)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        """q: (Bd, H, D) one token per sequence -> (Bd, H, D)."""
        k_cache, v_cache, k_scale, v_scale = kvq.unpack(kv_cache)
        nd, h, d = q.shape
        kvh = k_cache.shape[2]
        table, mask = self._decode_plan(meta, window)
        # (Bd * nblk, bs, KVH, D) -> (Bd, KVH, nblk*bs, D). index_select on whole
        # blocks is a row memcpy (4x faster here than advanced indexing).
        table = table.flatten()
        if k_scale is None:
            kd, vd = k_cache.index_select(0, table), v_cache.index_select(0, table)
        else:  # the decodes' blocks dequantized as gathered
            kd, vd = kvq.gather(k_cache, k_scale, table, q.dtype), kvq.gather(v_cache, v_scale, table, q.dtype)
        kd = kd.view(nd, -1, kvh, d).transpose(1, 2)
        vd = vd.view(nd, -1, kvh, d).transpose(1, 2)
        # GQA without repeating K/V: the G query heads sharing a KV head act as G
        # query rows of that head. qd: (Bd, KVH, G, D)
        qd = q.view(nd, kvh, h // kvh, d)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        return o.reshape(nd, h, d)


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """CPU backend: C++ kernels that read K/V in place through the block tables (no gather
    copy, no padding, no repeat for GQA): decode attention, and every prefill chunk of the
    step in one causal flash-attention call (csrc/prefill_attention.cpp), cached prefix
    included."""

    needs_decode_mask = False
    # An all-decode step of a few sequences may run the model's whole layer stack as one
    # C++ op (csrc/decode_stack.cpp) that calls this backend's kernel itself.
    runs_decode_stack = True

    def __init__(self, block_size: int, device: torch.device):
        super().__init__(block_size, device)
        # The prefill kernel's register tiles need AVX2 or AVX-512; its portable scalar build
        # is ~8x slower than SDPA, so CPUs with neither keep the reference prefill.
        self.prefill_kernel = native.isa() != "generic"

    def _prefill_metadata(self, meta: AttentionMetadata) -> None:
        if not self.prefill_kernel:
            return super()._prefill_metadata(meta)
        if not meta.prefills:
            return
        bs = self.block_size
        nblk = max(-(-s.ctx_len // bs) for s in meta.prefills)
        table = np.zeros((len(meta.prefills), nblk), dtype=np.int64)
        for i, s in enumerate(meta.prefills):
            n = -(-s.ctx_len // bs)
            table[i, :n] = s.block_ids[:n]
        meta.prefill_table = torch.from_numpy(table)
        meta.prefill_spans = torch.tensor([(s.q_start, s.q_len, s.start_pos) for s in meta.prefills],
                                          dtype=torch.int64)

    def _write(self, kv_cache, k, v, meta: AttentionMetadata) -> None:
        if isinstance(kv_cache, kvq.QuantizedKV) and kv_cache.k.dtype == torch.int8:
            torch.ops.kvmesh.quantize_kv_cache(k, v, *kv_cache, meta.slot_mapping)
            return
        super()._write(kv_cache, k, v, meta)

    def _prefill(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, out,
                 window: int | None = None) -> None:
        # The kernel computes in fp32: for a bf16 model torch's SDPA (bf16 dot products on
        # AVX512-BF16 / AMX) measured faster (4 x 256 tokens: 306 vs 366 ms a prefill).
        if not self.prefill_kernel or q.dtype != torch.float32:
            return super()._prefill(q, k, v, kv_cache, meta, scale, out, window)
        k_cache, v_cache, k_scale, v_scale = kvq.unpack(kv_cache)
        torch.ops.kvmesh.paged_prefill_attention(out, q, k_cache, v_cache, meta.prefill_table, meta.prefill_spans,
                                                 scale, window or 0, k_scale, v_scale)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        k_cache, v_cache, k_scale, v_scale = kvq.unpack(kv_cache)
        return torch.ops.kvmesh.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_table, meta.decode_context_lens, scale, window or 0,
            k_scale, v_scale)


BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuPagedAttentionBackend}
# Needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests): kept out of
# BACKENDS, whose every entry runs on any CPU machine.
GPU_BACKENDS = {"triton": TritonAttentionBackend}


def get_attention_backend(name: str, block_size: int, device: torch.device,
                          kernels: KernelConfig | None = None) -> AttentionBackend:
    """`auto` picks the fastest backend that works on `device` (the CPU kernels only where
    `kernels.cpu_kernels` allows them)."""
    kernels = kernels or KernelConfig()
    cpu_ok = kernels.cpu_kernels and native.load(kernels.native_isa)
    if name == "auto":
        name = "torch"
        if device.type == "cpu":
            if cpu_ok:
                name = "cpu"
        elif device.type == "cuda" and triton_can_run(device):
            name = "triton"
    if name in GPU_BACKENDS:
        return GPU_BACKENDS[name](block_size, device)  # raises, saying why, where it cannot run
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} unknown; choose from "
                         f"{sorted([*BACKENDS, *GPU_BACKENDS])} or auto")
    if name == "cpu" and not cpu_ok:
        raise ValueError("attention backend 'cpu' needs the native CPU kernels: they are switched off "
                         "(kernels.cpu_kernels) or no C++ compiler was found")
    return BACKENDS[name](block_size, device)
