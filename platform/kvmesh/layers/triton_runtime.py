"""Where Triton kernels can run, with the import guarded (a CPU install never needs triton).

Triton compiles kernels for CUDA tensors. With `TRITON_INTERPRET=1` in the environment
*before the kernels are defined* (their modules' import), it instead interprets them on
CPU tensors with numpy: slow, but the same kernel code, which is how the tests check
every kernel against the PyTorch reference on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: every `can_run` is False and callers take the PyTorch path
    triton = None
    tl = None

AVAILABLE = triton is not None
# Read once, like triton itself does when its @jit decorators run.
INTERPRET = AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def can_run(device: torch.device) -> bool:
    """Whether Triton kernels run on tensors of `device`: CUDA, or CPU when interpreting."""
    if not AVAILABLE:
        return False
    if device.type == "cuda":
        return not INTERPRET
    return INTERPRET and device.type == "cpu"


def unavailable_reason(device: torch.device) -> str:
    if not AVAILABLE:
        return "triton is not installed (pip install 'kvmesh[gpu]')"
    if device.type == "cuda" and INTERPRET:
        return "TRITON_INTERPRET=1 is set; unset it to run Triton kernels on the GPU"
    return (f"Triton kernels need a CUDA device, got {device.type!r} (tests run them on CPU "
            "with TRITON_INTERPRET=1 set before kvmesh is imported)")


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a fixed small number when interpreting)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


if triton is not None:
    _INTERPRET = tl.constexpr(INTERPRET)  # a global read inside @jit code must be a constexpr

    @triton.jit
    def dot(a, b, IEEE: tl.constexpr):
        """tl.dot with a float32 accumulator; IEEE float32 products for float32 models
        (Triton's default there is TF32). The interpreter multiplies bf16 / fp16 operands
        wrongly (their raw bits), so there they are upcast first: bf16 products are exact
        in float32, which is what the GPU's bf16 dot computes too."""
        if _INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)
        return c

    @triton.jit
    def to_dtype(x, dt: tl.constexpr):
        """float32 `x` rounded to `dt` to nearest even, as the GPU (and torch) does. The
        interpreter truncates float32 -> bfloat16, so there the rounding is done on the bits."""
        if dt == tl.float32:
            y = x
        elif _INTERPRET and dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dt)
        return y
else:
    dot = to_dtype = None
