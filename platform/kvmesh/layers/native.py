"""kvmesh's native CPU kernels: one build of every C++ source in csrc/, one CPU probe.

All kernels (paged decode and prefill attention over float or int8 KV caches, the int8 KV
cache writer, fused element-wise ops, the skinny and
small-batch GEMMs, the weight-only int8 / int4 GEMMs, the decode stack, the MoE experts, the
batched multi-LoRA delta) are one torch extension, built on first use with torch's
cpp_extension into its cache folder (~/.cache/torch_extensions; ~1 minute on 2 cores the
first time, instant after) and registered as `torch.ops.kvmesh.*`. C++ callers
(decode_stack.cpp) call the other kernels directly through csrc/kernels.h: no function
pointers cross a library boundary.

The build is `-march=native`: what a kernel may use is decided on the machine that runs
it, and the library's name carries the ISA and a digest of the sources, so a cache folder
shared by different CPUs never hands an AVX-512 build to an AVX2-only one.

Failure policy: no C++ compiler -> a warning and the PyTorch reference paths (the kernels
are an optimization). A compiler present and the build failing on a CPU with AVX2 ->
`NativeBuildError` with the compiler's output: that is a bug to fix, not a fallback to
hide (tests fail on it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from kvmesh.errors import KVMeshError

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp", "skinny_gemm.cpp", "small_gemm.cpp",
           "quant_gemm.cpp", "decode_stack.cpp", "moe.cpp", "lora.cpp", "kv_quant.cpp")
OPS = ("paged_decode_attention", "paged_prefill_attention", "skinny_linear", "small_linear", "int8_linear",
       "int4_linear", "decode_stack", "rms_norm", "add_rms_norm", "rope_qkv", "silu_and_mul", "argmax_rows",
       "moe_experts", "lora_sgmv", "quantize_kv_cache")
# The quantized GEMM's intrinsics (csrc/quant_gemm.cpp).
QUANT_GEMM_FLAGS = frozenset({"avx2", "fma", "f16c"})
ISA_CAPS = ("native", "avx2")

_lock = threading.Lock()
_loaded: dict[str, str | bool] = {}  # "ok", "quant": bool; "isa_cap": the cap it was built with


class NativeBuildError(KVMeshError, RuntimeError):
    """The native CPU kernels failed to build where they should (a compiler and AVX2)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo): the one probe every kernel choice reads."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa(cap: str | None = None) -> str:
    """The widest vector ISA the kernels use here: avx512, avx2 or generic. `cap` "avx2"
    leaves AVX-512 out (KernelConfig.native_isa); None: the cap of the loaded build."""
    cap = cap or str(_loaded.get("isa_cap", "native"))
    flags = cpu_flags()
    if "avx512f" in flags and cap == "native":
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 dot products or AMX tiles)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def has_quant_gemm() -> bool:
    """Whether the native build has the int8 / int4 GEMM (it needs AVX2, FMA and F16C);
    loads the build (with the ISA of an earlier load) on first use."""
    quant = _loaded.get("quant")  # per quantized matmul: one dict read once known
    if quant is None:
        quant = _loaded["quant"] = (load(str(_loaded.get("isa_cap", "native")))
                                    and QUANT_GEMM_FLAGS <= cpu_flags())
    return bool(quant)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++") or shutil.which("clang++")


def load(isa_cap: str = "native") -> bool:
    """Load (building if needed) the kernels; True when `torch.ops.kvmesh` is usable.

    The first call in a process decides the ISA cap; a later call asking for another one
    raises (the ops of two builds cannot share one namespace)."""
    if isa_cap not in ISA_CAPS:
        raise ValueError(f"native_isa: {isa_cap!r} is not one of {ISA_CAPS}")
    ok = _loaded.get("ok")
    if ok is not None:
        if ok and _loaded["isa_cap"] != isa_cap:
            raise KVMeshError(f"kernels.native_isa: this process already loaded the {_loaded['isa_cap']!r} "
                              f"build of the native kernels; {isa_cap!r} needs a new process")
        return bool(ok)
    with _lock:
        if "ok" not in _loaded:
            _loaded["ok"] = _build(isa_cap)
            _loaded["isa_cap"] = isa_cap
        return bool(_loaded["ok"])


def loaded() -> bool:
    """Whether the kernels are loaded (never builds)."""
    return bool(_loaded.get("ok"))


# A build takes ~2 minutes on 2 cores; a lock older than this is a killed build's.
STALE_LOCK_S = 900


def _clear_stale_lock(name: str) -> None:
    """torch's build lock (a file, no owner recorded) outlives a build killed mid-way (Ctrl-C,
    an OOM kill), and every later process would wait on it forever: drop it when it is far
    older than any build."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("kvmesh: removing a stale native-kernel build lock (%s, %.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def _build(isa_cap: str) -> bool:
    from torch.utils.cpp_extension import load as build

    if _compiler() is None:
        logger.warning("kvmesh: no C++ compiler found; the native CPU kernels are off (PyTorch reference paths)")
        return False
    # One build per ISA and per source version (headers included, which torch's own change
    # detection does not hash).
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(_CSRC.glob("*.[ch]*")))).hexdigest()
    flags = ["-O3", "-march=native", "-fopenmp",
             # Reassociation lets gcc vectorize the dot-product reductions.
             "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    if isa_cap == "avx2":
        flags.append("-mno-avx512f")  # turns off every AVX-512 subset
    name = f"kvmesh_cpu_kernels_{isa(isa_cap)}_{digest[:10]}"
    _clear_stale_lock(name)
    try:
        build(name=name, sources=[str(_CSRC / n) for n in SOURCES],
              extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # the compiler's output is in the message
        if "avx2" in cpu_flags():
            raise NativeBuildError(f"kvmesh: building the native CPU kernels failed on a CPU with AVX2 and a "
                                   f"compiler ({_compiler()}); fix the build (or set kernels.cpu_kernels=false "
                                   f"to run the PyTorch reference paths): {exc}") from exc
        logger.warning("kvmesh: the native CPU kernels did not build on this CPU (no AVX2): %s", exc)
        return False
    missing = [op for op in OPS if not hasattr(torch.ops.kvmesh, op)]
    if missing:
        raise NativeBuildError(f"kvmesh: the native CPU kernels built but lack ops {missing}")
    return True
