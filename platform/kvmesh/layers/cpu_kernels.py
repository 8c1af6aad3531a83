"""Build-on-first-use C++ kernels for the CPU path (see csrc/).

Compiled once per machine with torch's cpp_extension into its cache folder
(~/.cache/torch_extensions; ~1 minute on 2 cores the first time, instant after).
If no compiler is available, or KVMESH_CPU_KERNELS=0, callers fall back to the pure
PyTorch reference path: the kernels are an optimization, never a requirement.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, bool] = {}
# csrc/fused_ops.cpp: the decoder's element-wise ops, one dispatch each.
FUSED_OPS = ("rms_norm", "add_rms_norm", "rope_qkv", "silu_and_mul", "argmax_rows")


def isa() -> str:
    """The widest vector ISA the kernels use on this CPU (they are built with -march=native,
    so this is decided on the machine that runs them): avx512, avx2 or generic."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    words = set(flags.split())
    if "avx512f" in words:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= words:
        return "avx2"
    return "generic"


def load() -> bool:
    """Load (building if needed) the kernels; True when torch.ops.kvmesh is usable."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        ok = False
        if os.environ.get("KVMESH_CPU_KERNELS", "1") != "0":
            try:
                from torch.utils.cpp_extension import load as build

                csrc = Path(__file__).parent / "csrc"
                # One build per ISA and per source version (headers included, which torch's
                # own change detection does not hash): a cache folder shared by machines of
                # different CPUs never hands an AVX-512 build to an AVX2-only one.
                digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(csrc.glob("*.[ch]*")))).hexdigest()
                build(
                    name=f"kvmesh_cpu_kernels_{isa()}_{digest[:10]}",
                    sources=[str(csrc / n) for n in ("paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp",
                                                     "skinny_gemm.cpp", "small_gemm.cpp", "decode_stack.cpp")],
                    # Reassociation lets gcc vectorize the dot-product reductions.
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-fassociative-math",
                                  "-fno-signed-zeros", "-fno-trapping-math"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                ok = all(hasattr(torch.ops.kvmesh, op)
                         for op in ("paged_decode_attention", "paged_prefill_attention", "skinny_linear", "small_linear", "decode_stack",
                                   *FUSED_OPS))
            except Exception as exc:  # no compiler, headers, ...: use the torch path
                logger.warning("kvmesh CPU kernels unavailable (%s); using the PyTorch path", exc)
        _state["ok"] = ok
        return ok


def fused(x: torch.Tensor) -> bool:
    """Whether the model should use the fused ops of csrc/fused_ops.cpp for `x`
    (a CPU tensor, kernels built); otherwise it runs the PyTorch reference ops."""
    if x.device.type != "cpu":
        return False
    ok = _state.get("ok")  # lock-free after the first call: this runs per op
    return load() if ok is None else ok
