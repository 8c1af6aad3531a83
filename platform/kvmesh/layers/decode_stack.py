"""A decode step's whole layer stack as one C++ call (csrc/decode_stack.cpp): the CPU
counterpart of a CUDA graph replay, with the layer-by-layer path's bits.

A model gives `DecodeStack` its decoder layers as `StackLayer`s (which norm and linear is
which) and calls it first in its forward: it returns the hidden states when the step can
run as the one op, else None (the model then loops over its layers). It can when:

- the model's context runs the native CPU kernels and the step's attention backend is the
  CPU paged one (`runs_decode_stack`), and the step is all decodes with no rows under a
  LoRA adapter (layers/lora.py: the stack runs the base GEMMs only);
- either it has at most SKINNY_KERNEL_ROWS tokens and every projection has a `stack_form`
  (a float32 / bf16 `Linear`, or, in a float32 model, an int8 / int4 `QuantLinear` on the
  native kernel), or it has a number of tokens in SMALL_GEMM_ROWS, the model is float32 and
  every projection a dense `Linear`:

exactly the steps whose layer loop runs the same C++ kernels one Python call at a time, so
both paths give the same bits (at 5-64 rows the loop's Python and dispatch cost the
48-request offline workload ~8%: 229-231 -> 250-251 tok/s with the stack).

With tensor parallelism each rank's stack runs its own shards and sums the row-parallel
outputs (o, down) over the group from C++ (its shared-memory segment, layers/shm_allreduce.py,
or else the gloo group registered by name: worker/groups.py), the same collectives in the same order as the layer loop, so the ranks' loops and stacks
can even mix. While `op.COMM` meters communication (benchmarks/parallel_comm.py) a
parallel step takes the layer loop, whose all-reduces it can time.

The layers' tensors are gathered once (~800 module attribute reads, 1 ms a step) and again
whenever a layer changes (layers/op.py `fast_paths_changed`: a rebind, a swapped or
reloaded module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvmesh.layers import lora, op
from kvmesh.layers.attention import AttentionMetadata
from kvmesh.layers.kv_cache import QuantizedKV
from kvmesh.layers.linear import SKINNY_KERNEL_ROWS, SMALL_GEMM_ROWS, STACK_DENSE
from kvmesh.layers.norm import RMSNorm


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as the stack runs it (csrc/decode_stack.cpp's per-layer recipe)."""

    input_norm: RMSNorm
    qkv: torch.nn.Module
    o: torch.nn.Module
    post_norm: RMSNorm
    gate_up: torch.nn.Module
    down: torch.nn.Module
    window: int | None = None  # a sliding-window layer's window, None: full attention


@dataclass(frozen=True)
class StackArgs:
    """decode_stack's per-model arguments, in its order."""

    norms: list[torch.Tensor]
    tensors: list[torch.Tensor]
    kinds: list[int]
    biases: list[torch.Tensor | None]
    runs_small: bool  # every linear dense and on the small-batch GEMM: steps of SMALL_GEMM_ROWS rows
    windows: list[int]  # per layer, 0: full attention


class DecodeStack:
    def __init__(self, layers: Callable[[], Sequence[StackLayer]], num_heads: int, num_kv_heads: int, eps: float,
                 scale: float, ctx: op.OpContext):
        # `layers` is called at each gather: the model's modules may be replaced after it is built.
        self.layers = layers
        self.num_heads, self.num_kv_heads, self.eps, self.scale = num_heads, num_kv_heads, eps, scale
        self.tp = ctx.tp
        # At TP > 1 the C++ side needs the group's registered name to all-reduce.
        self.enabled = (ctx.device.type == "cpu" and ctx.kernels.cpu_kernels and ctx.kernels.decode_stack
                        and (ctx.tp.size == 1 or bool(ctx.tp.name) or ctx.tp.shm is not None))
        self._args: StackArgs | None = None
        self._generation = -1

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | list[QuantizedKV], meta: AttentionMetadata,
                 backend) -> torch.Tensor | None:
        args = self.step_args(h, meta, backend)
        if args is None:
            return None
        quantized = isinstance(kv_caches[0], QuantizedKV)  # an int8 cache: its scales ride along
        return torch.ops.kvmesh.decode_stack(
            h, cos, sin, args.norms, args.tensors, args.kinds, args.biases, [kv[0] for kv in kv_caches],
            [kv[1] for kv in kv_caches], meta.slot_mapping, meta.decode_block_table, meta.decode_context_lens,
            self.num_heads, self.num_kv_heads, self.eps, self.scale, SKINNY_KERNEL_ROWS,
            [kv.k_scale for kv in kv_caches] if quantized else [], [kv.v_scale for kv in kv_caches] if quantized else [],
            args.windows, *self._tp_args())

    def _tp_args(self) -> tuple:
        """decode_stack's (tp_group, tp_shm, tp_rank, tp_timeout_s): how the C++ side sums the
        row-parallel shards, as the layer loop's TPGroup.all_reduce would."""
        tp = self.tp
        if tp.size == 1:
            return "", None, 0, 0.0
        if tp.shm is not None:
            return "", tp.shm.segment, tp.shm.rank, tp.shm.timeout_s
        return tp.name, None, 0, 0.0

    def step_args(self, h: torch.Tensor, meta: AttentionMetadata, backend) -> StackArgs | None:
        """The gathered arguments when this step runs as the one op (see the module doc), else None."""
        t = h.shape[0]
        if (not self.enabled or not getattr(backend, "runs_decode_stack", False) or meta.prefills
                or meta.num_decodes != t or lora.active() or (self.tp.size > 1 and op.COMM.enabled)):
            return None
        small = t > SKINNY_KERNEL_ROWS
        if small and not (SMALL_GEMM_ROWS[0] <= t <= SMALL_GEMM_ROWS[1] and h.dtype == torch.float32):
            return None
        if self._generation != op.GENERATION:
            self._args, self._generation = self._gather(), op.GENERATION
        args = self._args
        if args is None or (small and not args.runs_small):
            return None
        return args

    def _gather(self) -> StackArgs | None:
        """None when a projection has no stack form (e.g. act-order int4, a LoRA delta, a
        quantized layer in a bf16 model)."""
        norms: list[torch.Tensor] = []
        tensors: list[torch.Tensor] = []
        kinds: list[int] = []
        biases: list[torch.Tensor | None] = []
        windows: list[int] = []
        runs_small = True
        for layer in self.layers():
            norms += [layer.input_norm.weight, layer.post_norm.weight]
            windows.append(layer.window or 0)
            for module in (layer.qkv, layer.o, layer.gate_up, layer.down):
                form = module.stack_form() if hasattr(module, "stack_form") else None
                if form is None:
                    return None
                kind, ts = form
                if kind != STACK_DENSE and layer.input_norm.weight.dtype != torch.float32:
                    return None  # the quantized kernels take float32 activations only
                # (small_gemm switched off: the loop runs oneDNN for those rows, so must the stack)
                runs_small = runs_small and kind == STACK_DENSE and module._small_rows == SMALL_GEMM_ROWS
                kinds.append(kind)
                tensors += ts
                biases.append(module.bias)
        return StackArgs(norms, tensors, kinds, biases, runs_small, windows)
