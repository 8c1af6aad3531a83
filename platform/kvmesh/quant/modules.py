"""Quantized drop-in modules for kvmesh's Linear / MergedLinear and the token embedding.

In the style of gpt-fast's `WeightOnlyInt8Linear`: the module holds the quantized
tensors as buffers (never Parameters: `model.load_weights` and dtype casts leave them
alone) and its forward calls a quantized matmul (kernels.py).

Buffers are allocated on the first `load()` from the canonical tensors' shapes, so a
module is built before its format (group size, act-order permutation) is known.
Fused modules (qkv, gate_up) keep their shards' row ranges; every shard of a
checkpoint is copied into its rows, exactly like MergedLinear.weight_loader.
"""

from __future__ import annotations

import torch
from torch import nn

from kvmesh.layers.linear import SKINNY_KERNEL_ROWS, STACK_INT4, STACK_INT4_MINS, STACK_INT8
from kvmesh.layers.op import TPGroup, fast_paths_changed
from kvmesh.quant.kernels import int4_matmul, int4_native_layout, int8_matmul, int8_native_layout, native_usable
from kvmesh.quant.primitives import dequantize_int4, dequantize_int8, unpack_int4

# Canonical buffers per scheme (see primitives.py). int4 takes "zeros" or "mins" (GGUF
# Q4_1), never both; "perm" is optional for int4.
SCHEME_TENSORS = {"int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros", "mins")}


class QuantLinear(nn.Module):
    """Weight-only quantized y = x @ W^T + b; `scheme` is "int8" or "int4". `native_gemm`
    False keeps the native CPU kernel out (KernelConfig.quantized_cpu_gemm / cpu_kernels)."""

    def __init__(self, scheme: str, in_features: int, out_features: int, bias: bool,
                 shards: dict[str, tuple[int, int]] | None = None, device: torch.device | str = "cpu",
                 native_gemm: bool = True):
        super().__init__()
        self.native_gemm = native_gemm
        if scheme not in SCHEME_TENSORS:
            raise ValueError(f"scheme: {scheme!r} is not one of {sorted(SCHEME_TENSORS)}")
        self.scheme = scheme
        self.in_features, self.out_features = in_features, out_features
        self.shards = shards or {"": (0, out_features)}
        self.has_bias = bias
        self.device = torch.device(device)
        self._loaded: set[str] = set()
        self._bias_loaded: set[str] = set()
        self._fast: tuple | None = None  # see _forward_args
        self.delta = None  # a LoRA delta(x, y), as Linear.set_delta (layers/lora.py)
        # A row-parallel layer's group (layers/linear.py): partial products all-reduced, then
        # the bias added once. None: nothing to reduce (one rank, or a column / replicated layer).
        self.reduce_group: TPGroup | None = None
        # The tensor-parallel layout of the float layer this one stands for (`like`): its
        # whole-model sizes and how it cuts a whole-model tensor (LoRA adapters are cut so).
        self.parallel = "replicated"
        self.full_in_features, self.full_out_features = in_features, out_features
        self.full_sizes: dict[str, int] | None = None
        self._slicer = None
        for name in ("qweight", "scales", "zeros", "mins", "bias", "perm"):
            self.register_buffer(name, None)

    @classmethod
    def like(cls, scheme: str, linear: nn.Linear, device: torch.device | str) -> "QuantLinear":
        """An empty quantized twin of `linear` (a layers.linear Linear or MergedColumnLinear),
        with its tensor-parallel shape: this rank's rows / columns, loaded from float tensors cut
        to this rank before quantizing (quant/loader.py)."""
        kernels = linear.ctx.kernels
        module = cls(scheme, linear.in_features, linear.out_features, linear.bias is not None,
                     getattr(linear, "offsets", None), device, kernels.cpu_kernels and kernels.quantized_cpu_gemm)
        if linear.parallel == "row" and linear.ctx.tp.size > 1:
            module.reduce_group = linear.ctx.tp
        if linear.ctx.tp.size > 1:
            module.parallel = linear.parallel
            module.full_in_features, module.full_out_features = linear.full_in_features, linear.full_out_features
            module.full_sizes = getattr(linear, "full_sizes", None)
            module._slicer = linear.local_slice  # (the float twin lives on the meta device: no memory)
        return module

    def local_slice(self, t: torch.Tensor, shard: str | None = None) -> torch.Tensor:
        """This rank's slice of a whole-model tensor, as the float layer it replaced cuts its
        weight (layers/linear.py Linear.local_slice); the tensor itself on one rank."""
        return t if self._slicer is None else self._slicer(t, shard)

    def _rows(self, shard: str | None) -> tuple[int, int]:
        key = shard or ""
        if shard is None and key not in self.shards:  # a checkpoint storing the fused module whole (Phi-3)
            return 0, self.out_features
        if key not in self.shards:
            raise ValueError(f"unknown shard {shard!r}; this module has {sorted(self.shards)}")
        return self.shards[key]

    def load(self, tensors: dict[str, torch.Tensor], shard: str | None = None) -> None:
        """Copy one checkpoint module's canonical tensors into this module's rows."""
        start, size = self._rows(shard)
        self._fast = None
        fast_paths_changed()
        for name, t in tensors.items():
            if name == "perm":
                self._load_perm(t)
                continue
            if name not in SCHEME_TENSORS[self.scheme]:
                raise ValueError(f"{self.scheme} module got unexpected tensor {name!r}")
            if t.shape[0] != size:
                raise ValueError(f"{name}: checkpoint has {t.shape[0]} rows, shard {shard!r} expects {size}")
            buf = getattr(self, name)
            if buf is None:
                buf = torch.empty((self.out_features, *t.shape[1:]), dtype=t.dtype, device=self.device)
                setattr(self, name, buf)
            elif buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
                raise ValueError(f"{name}: shard {shard!r} has shape {tuple(t.shape)} / {t.dtype}, other shards "
                                 f"{tuple(buf.shape)} / {buf.dtype} (mixed group sizes in one fused module?)")
            buf.narrow(0, start, size).copy_(t)
        self._loaded.update(self._covered(shard))

    def _covered(self, shard: str | None) -> set[str]:
        return set(self.shards) if shard is None else {shard}

    def _load_perm(self, perm: torch.Tensor) -> None:
        self._fast = None
        fast_paths_changed()
        perm = perm.to(device=self.device, dtype=torch.long)
        if self.perm is not None and not torch.equal(self.perm, perm):
            raise ValueError("g_idx: shards of one fused module have different act-order permutations; "
                             "kvmesh needs them equal (re-quantize with desc_act=False)")
        self.perm = perm

    def load_bias(self, bias: torch.Tensor, shard: str | None = None) -> None:
        start, size = self._rows(shard)
        self._fast = None
        fast_paths_changed()
        if self.bias is None:
            self.bias = torch.zeros(self.out_features, dtype=torch.float32, device=self.device)
        self.bias.narrow(0, start, size).copy_(bias)
        self._bias_loaded.update(self._covered(shard))

    def missing(self) -> list[str]:
        """Shards (and biases) not loaded yet, as "shard" / "shard:bias" labels."""
        out = [s or "weight" for s in self.shards if s not in self._loaded]
        if self.has_bias:
            out += [f"{s or 'weight'}:bias" for s in self.shards if s not in self._bias_loaded]
        return out

    def finalize(self, dtype: torch.dtype) -> None:
        """After loading: check completeness and put the tensors in their run-time dtypes."""
        if self.missing():
            raise ValueError(f"checkpoint is missing {self.missing()}")
        if self.scheme == "int4" and (self.zeros is None) == (self.mins is None):
            raise ValueError("int4 module needs exactly one of 'zeros' / 'mins' for all its shards")
        self.scales = self.scales.to(torch.float32 if self.scheme == "int8" else torch.float16).contiguous()
        for name in ("zeros", "mins"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(torch.float16).contiguous())
        if self.bias is not None:
            self.bias = self.bias.to(dtype)
        self._fast = None
        fast_paths_changed()

    def _apply(self, fn, recurse=True):  # .to() / .half() replace the buffers: re-read them
        self._fast = None
        fast_paths_changed()
        return super()._apply(fn, recurse)

    def _forward_args(self) -> tuple:
        """The forward's tensors as one plain tuple: buffer reads through nn.Module's
        __getattr__ cost ~0.4 us each, a noticeable share of a decode-sized matmul."""
        offsets = self._offsets()
        return (self.scheme == "int8", self.qweight, self.scales, offsets, self.mins is not None, self.perm,
                self.bias, self.native_gemm)

    def _dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
        if self.scheme == "int8":
            return dequantize_int8(qweight, scales, dtype)
        return dequantize_int4(unpack_int4(qweight), scales, offsets, dtype, self.mins is not None)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight this module computes with, (out, in), in input-column order."""
        w = self._dequantize(self.qweight, self.scales, self._offsets(), dtype)
        if self.perm is not None:  # column j of w is input perm[j]
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` of the dequantized weight, (len(rows), in): an embedding gather."""
        offsets = self._offsets()
        return self._dequantize(self.qweight.index_select(0, rows), self.scales.index_select(0, rows),
                                None if offsets is None else offsets.index_select(0, rows), dtype)

    def _offsets(self) -> torch.Tensor | None:
        return self.zeros if self.zeros is not None else self.mins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = self._fast
        if args is None:
            args = self._fast = self._forward_args()
        is_int8, qweight, scales, offsets, mins, perm, bias, native_ok = args
        xq = x if perm is None else x.index_select(-1, perm)
        y = (int8_matmul(xq, qweight, scales, native_ok) if is_int8
             else int4_matmul(xq, qweight, scales, offsets, mins, native_ok))
        if self.reduce_group is not None:  # row-parallel: reduce the partials, then the bias once
            y = self.reduce_group.all_reduce(y if self.delta is None else self.delta(x, y))
            return y if bias is None else y + bias
        if bias is not None:
            y = y + bias
        return y if self.delta is None else self.delta(x, y)

    def set_delta(self, delta) -> None:
        """Add `delta(x, y)` to this layer's output (a LoRA adapter's, on the unpermuted input);
        None removes it. The decode stack runs only steps where the delta adds nothing."""
        self.delta = delta
        fast_paths_changed()

    def stack_form(self) -> tuple[int, list[torch.Tensor]] | None:
        """How the decode_stack op (layers/csrc/decode_stack.cpp) runs this layer for up to
        SKINNY_KERNEL_ROWS rows: what `forward` runs, the native kernel. None where forward
        would not use that kernel (no kernel here, act-order, other layouts). A row-parallel
        shard: the stack sums it over the group and adds the bias after, as `forward` does."""
        if not self.native_gemm or not native_usable(SKINNY_KERNEL_ROWS, self.device) or self.perm is not None:
            return None
        is_int8, qweight, scales, offsets, mins, _, _, _ = self._fast or self._forward_args()
        if is_int8:
            if not int8_native_layout(self.in_features, scales):
                return None
            return STACK_INT8, [qweight, scales]
        if not int4_native_layout(self.in_features, scales):
            return None
        return (STACK_INT4_MINS if mins else STACK_INT4), [qweight, scales, offsets]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.zeros, self.mins, self.bias) if t is not None)

    def extra_repr(self) -> str:
        return f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}"


class QuantEmbedding(nn.Module):
    """Token embedding stored quantized (int8 per row or group, or int4 per group);
    only the looked-up rows are dequantized.

    With tied embeddings the same storage is the lm_head: `head` is a QuantLinear
    whose buffers are this module's, so the vocabulary matrix is held (and read per
    decode step) once, at 1 byte (int8) or 5/8 byte (int4 g32) per weight instead of 4.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device: torch.device | str = "cpu",
                 scheme: str = "int8", native_gemm: bool = True, tp: TPGroup | None = None):
        """`tp`: vocabulary-parallel as layers/embedding.py's VocabParallelEmbedding (this rank
        holds rows [rank * n, (rank + 1) * n) of the padded vocabulary, lookups all-reduced)."""
        super().__init__()
        self.tp = tp or TPGroup()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_local = -(-num_embeddings // self.tp.size)
        self.vocab_start = self.tp.rank * self.num_local
        self.head = QuantLinear(scheme, embedding_dim, self.num_local, bias=False, device=device,
                                native_gemm=native_gemm)
        self.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.head.dequantize_rows(ids, self.dtype)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        h = self.head.dequantize_rows(local.masked_fill(outside, 0), self.dtype)
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)

    def finalize(self, dtype: torch.dtype) -> None:
        self.head.finalize(dtype)
        self.dtype = dtype
