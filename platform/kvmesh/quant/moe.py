"""Weight-only int8 / int4 MoE experts: the quantized twin of layers.moe.FusedMoE.

Every expert's gate-up (2I, H) and down (H, I) projection is stored in the scheme's
canonical tensors (quant/primitives.py), stacked over experts as buffers
`w13_<name>` (E, 2I, ...) and `w2_<name>` (E, H, ...): int8 qweight + per-row scales, or
packed int4 qweight + per-group scales and zero points. Both quantizations are per output
row, so gate and up quantized apart equal the fused gate-up quantized whole, and a fused
(E, rows, cols) checkpoint tensor is quantized as E * rows rows at once.

Forward: FusedMoE's grouping (tokens sorted by expert, one GEMM pair per active expert,
index_add back), each GEMM through quant/kernels.py on the expert's slice of the buffers:
the native int8 / int4 kernel for up to NATIVE_MAX_ROWS rows (decode: each active expert
gets a few rows; the kernel reads each weight byte once, which is what decode is bound
by), dequantize-then-multiply for taller groups (prefill, compute-bound, the dequantize
amortized over the rows) and where the kernel does not take the layout. The router gate
stays a float Linear (as in vLLM: E outputs, a tiny share of the bytes, and the routing
decision is the most sensitive output).

Float checkpoints are quantized as their expert tensors stream in (`weight_loader`, the
same signature as FusedMoE's), so no float copy of all experts is ever held.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvmesh.layers.moe import FusedMoE, grouped_experts, route, shard_sources, silu_and_mul_fn
from kvmesh.layers.op import OpContext, fast_paths_changed
from kvmesh.quant.kernels import int4_matmul, int8_matmul
from kvmesh.quant.primitives import dequantize_int4, dequantize_int8, unpack_int4

Quantizer = Callable[[torch.Tensor], dict[str, torch.Tensor]]
_PARAMS = ("w13", "w2")


class QuantFusedMoE(nn.Module):
    """FusedMoE with int8 / int4 experts; `quantize` is the method's `quantize_linear`
    ((out, in) float -> canonical tensors)."""

    def __init__(self, scheme: str, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, quantize: Quantizer, ctx: OpContext | None = None, native_gemm: bool = True):
        super().__init__()
        if scheme not in ("int8", "int4"):
            raise ValueError(f"scheme: {scheme!r} is not one of ['int4', 'int8']")
        self.ctx = ctx or OpContext()
        tp = self.ctx.tp
        self.scheme, self.quantize, self.native_gemm = scheme, quantize, native_gemm
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        # Tensor parallel as FusedMoE: this rank's I / tp columns of every expert (cut from the
        # float tensors by shard_sources before they are quantized), outputs all-reduced.
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = intermediate_size // tp.size
        self.rows = {"w13": 2 * self.intermediate_size, "w2": hidden_size}
        self._names: dict[str, list[str]] = {p: [] for p in _PARAMS}
        self._loaded: set[tuple[int, str]] = set()
        self._fast: tuple | None = None
        self._act = silu_and_mul_fn(self.ctx)

    @classmethod
    def like(cls, scheme: str, moe: FusedMoE, quantize: Quantizer, device: torch.device | str) -> "QuantFusedMoE":
        """An empty quantized twin of `moe`, for `device`."""
        kernels = moe.ctx.kernels
        ctx = moe.ctx.moved(torch.device(device), moe.ctx.dtype)
        return cls(scheme, moe.num_experts, moe.top_k, moe.hidden_size, moe.full_intermediate_size,
                   renormalize=moe.renormalize, quantize=quantize, ctx=ctx,
                   native_gemm=kernels.cpu_kernels and kernels.quantized_cpu_gemm)

    # -- loading --------------------------------------------------------------

    def weight_loader(self, param: str | None, loaded: torch.Tensor, expert_id: int | None, shard: str) -> None:
        """Quantize a float checkpoint expert weight into its rows (see FusedMoE.weight_loader;
        `param` is unused: the shard says which projection)."""
        for name, experts, start, rows, src in shard_sources(self, loaded, expert_id, shard):
            e, n, k = src.shape
            want = (self.num_experts if expert_id is None else 1, rows, self.hidden_size if name == "w13"
                    else self.intermediate_size)
            if (e, n, k) != want:
                raise ValueError(f"shard {shard!r}: checkpoint {tuple(loaded.shape)} does not fit experts of hidden "
                                 f"{self.hidden_size}, intermediate {self.intermediate_size}")
            parts = self.quantize(src.reshape(e * n, k))
            self._store(name, experts, start, {key: t.reshape(e, n, *t.shape[1:]) for key, t in parts.items()})
        ids = range(self.num_experts) if expert_id is None else (expert_id,)
        shards = ("gate", "up") if shard == "gate_up" else (shard,)
        self._loaded.update((i, s) for i in ids for s in shards)

    def _store(self, param: str, experts: slice, start: int, parts: dict[str, torch.Tensor]) -> None:
        self._fast = None
        fast_paths_changed()
        for key, t in parts.items():
            name = f"{param}_{key}"
            buf = getattr(self, name, None)
            if buf is None:
                buf = torch.empty((self.num_experts, self.rows[param], *t.shape[2:]), dtype=t.dtype,
                                  device=self.ctx.device)
                self.register_buffer(name, buf)
                self._names[param].append(key)
            elif buf.shape[2:] != t.shape[2:] or buf.dtype != t.dtype:
                raise ValueError(f"{name}: shapes {tuple(t.shape)} / {t.dtype} differ from the stored "
                                 f"{tuple(buf.shape)} / {buf.dtype}")
            buf[experts].narrow(1, start, t.shape[1]).copy_(t)

    def missing(self) -> list[str]:
        return [f"expert {e} {s}" for e in range(self.num_experts) for s in ("gate", "up", "down")
                if (e, s) not in self._loaded]

    def finalize(self, dtype: torch.dtype) -> None:
        """After loading: check completeness and fix the activation dtype."""
        missing = self.missing()
        if missing:
            more = " ..." if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing experts' weights: {missing[:8]}{more}")
        self.ctx = self.ctx.moved(self.ctx.device, dtype)
        self._act = silu_and_mul_fn(self.ctx)
        self._fast = None
        fast_paths_changed()

    def _apply(self, fn, recurse: bool = True):
        self._fast = None
        fast_paths_changed()
        return super()._apply(fn, recurse)

    # -- forward ----------------------------------------------------------------

    def _tensors(self, param: str) -> tuple[torch.Tensor, ...]:
        names = self._names[param]
        if self.scheme == "int8":
            return self.get_buffer(f"{param}_qweight"), self.get_buffer(f"{param}_scales")
        offsets = "zeros" if "zeros" in names else "mins"
        return tuple(self.get_buffer(f"{param}_{n}") for n in ("qweight", "scales", offsets))

    def _gemm(self) -> Callable[[torch.Tensor, tuple[torch.Tensor, ...], int], torch.Tensor]:
        native_ok = self.native_gemm
        if self.scheme == "int8":
            return lambda x, t, e: int8_matmul(x, t[0][e], t[1][e], native_ok)
        mins = "mins" in self._names["w13"]
        return lambda x, t, e: int4_matmul(x, t[0][e], t[1][e], t[2][e], mins, native_ok)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        fast = self._fast
        if fast is None:
            fast = self._fast = (self._tensors("w13"), self._tensors("w2"), self._gemm(), self._act)
        w13, w2, gemm, act = fast
        weights, ids = route(router_logits, self.top_k, self.renormalize)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return gemm(act(gemm(rows, w13, e)), w2, e)

        out = grouped_experts(x, weights, ids, self.num_experts, expert)
        return self.ctx.tp.all_reduce(out)

    def dequantized(self, param: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float expert weights this module computes with: w13 (E, 2I, H) or w2 (E, H, I)."""
        t = self._tensors(param)
        out = []
        for e in range(self.num_experts):
            if self.scheme == "int8":
                out.append(dequantize_int8(t[0][e], t[1][e], dtype))
            else:
                out.append(dequantize_int4(unpack_int4(t[0][e]), t[1][e], t[2][e], dtype,
                                           "mins" in self._names[param]))
        return torch.stack(out)

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"{self.scheme}, num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}")
