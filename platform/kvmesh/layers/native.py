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
`KVMESH_CPU_MARCH=portable` (the runtime image) builds each ISA tier for a fixed x86-64
level instead (avx512: x86-64-v4, avx2: x86-64-v3), so a build baked into an image on one
machine runs on any CPU of its tier; a process there loads the best baked tier its CPU runs
before it would compile anything (`prebuild`, `kvmesh warm`).

A finished build leaves a marker beside its library (torch version, flags); a later
process whose build matches it loads the library directly: no compiler, no ninja, no write
to the cache folder (which may be a read-only image layer).

Failure policy: no C++ compiler -> a warning and the PyTorch reference paths (the kernels
are an optimization). A compiler present and the build failing on a CPU with AVX2 ->
`NativeBuildError` with the compiler's output: that is a bug to fix, not a fallback to
hide (tests fail on it).
"""

from __future__ import annotations

import functools
import hashlib
import json
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
           "quant_gemm.cpp", "decode_stack.cpp", "moe.cpp", "lora.cpp", "kv_quant.cpp", "shm_allreduce.cpp")
OPS = ("paged_decode_attention", "paged_prefill_attention", "skinny_linear", "small_linear", "int8_linear",
       "int4_linear", "decode_stack", "rms_norm", "add_rms_norm", "rope_qkv", "silu_and_mul", "argmax_rows",
       "moe_experts", "lora_sgmv", "quantize_kv_cache", "shm_all_reduce_", "shm_all_reduce_init",
       "shm_all_reduce_attach", "shm_all_reduce_peers_visible", "shm_all_gather")
# The quantized GEMM's intrinsics (csrc/quant_gemm.cpp).
QUANT_GEMM_FLAGS = frozenset({"avx2", "fma", "f16c"})
ISA_CAPS = ("native", "avx2")
# Vector ISA tiers, widest first; a CPU of a tier runs every tier after it.
TIERS = ("avx512", "avx2", "generic")
MARCH_ENV = "KVMESH_CPU_MARCH"
# KVMESH_CPU_MARCH=portable: the x86-64 level each tier is built for. v3 has AVX2, FMA, F16C;
# v4 adds AVX512F/BW/DQ/VL: every macro csrc/ tests for, and nothing a CPU of the tier may lack.
# generic: the compiler's default target (the baseline of any architecture).
PORTABLE_MARCH = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "generic": None}
MARKER = "kvmesh_build.json"

_lock = threading.Lock()
_loaded: dict[str, str | bool] = {}  # "ok", "quant": bool; "isa_cap": the cap asked for; "isa": the tier loaded


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
    leaves AVX-512 out (KernelConfig.native_isa); None: the tier of the loaded build."""
    if cap is None and "isa" in _loaded:
        return str(_loaded["isa"])
    cap = cap or str(_loaded.get("isa_cap", "native"))
    flags = cpu_flags()
    if "avx512f" in flags and cap == "native":
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def march() -> str:
    """How builds target the CPU: "native" (this machine's, the default) or "portable" (the
    tier's x86-64 level), from $KVMESH_CPU_MARCH."""
    mode = os.environ.get(MARCH_ENV, "").strip() or "native"
    if mode not in ("native", "portable"):
        raise KVMeshError(f"{MARCH_ENV}={mode!r}: use native (build for this CPU) or portable (an image's "
                          f"builds, for any CPU of their tier)")
    return mode


def runnable_tiers() -> tuple[str, ...]:
    """The tiers this CPU runs, widest first."""
    return TIERS[TIERS.index(isa("native")):]


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 dot products or AMX tiles)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def has_quant_gemm() -> bool:
    """Whether the native build has the int8 / int4 GEMM (it needs AVX2, FMA and F16C);
    loads the build (with the ISA of an earlier load) on first use."""
    quant = _loaded.get("quant")  # per quantized matmul: one dict read once known
    if quant is None:
        # A generic build has no quantized GEMM even on a CPU that could run one.
        quant = _loaded["quant"] = (load(str(_loaded.get("isa_cap", "native")))
                                    and QUANT_GEMM_FLAGS <= cpu_flags() and _loaded.get("isa") != "generic")
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


def _digest() -> str:
    # One build per ISA and per source version (headers included, which torch's own change
    # detection does not hash).
    return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(_CSRC.glob("*.[ch]*")))).hexdigest()


def _target(tier: str, mode: str) -> tuple[str, list[str]]:
    """(library name, compiler flags) of `tier`'s build in march `mode`: both depend on nothing
    else, so one name always means one set of flags."""
    level = PORTABLE_MARCH[tier] if mode == "portable" else "native"
    flags = ["-O3", *([f"-march={level}"] if level else []), "-fopenmp",
             # Reassociation lets gcc vectorize the dot-product reductions.
             "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    if tier != "avx512" and mode == "native":
        flags.append("-mno-avx512f")  # turns off every AVX-512 subset
    suffix = "_portable" if mode == "portable" else ""
    return f"kvmesh_cpu_kernels_{tier}{suffix}_{_digest()[:10]}", flags


def _marker(flags: list[str]) -> dict:
    return {"torch": torch.__version__, "flags": flags}


def _library(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def _load_prebuilt(tier: str, mode: str) -> bool:
    """Load `tier`'s finished build if its marker matches (no compiler, no write); False if absent."""
    name, flags = _target(tier, mode)
    try:
        lib = _library(name)  # torch creates the folder: OSError on a read-only cache without it
        if json.loads((lib.parent / MARKER).read_text()) != _marker(flags) or not lib.is_file():
            return False
    except (OSError, ValueError):
        return False
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as exc:
        logger.warning("kvmesh: the native kernel build %s did not load (%s); building anew", lib, exc)
        return False
    _check_ops()
    return True


def _check_ops() -> None:
    missing = [op for op in OPS if not hasattr(torch.ops.kvmesh, op)]
    if missing:
        raise NativeBuildError(f"kvmesh: the native CPU kernels built but lack ops {missing}")


def _compile(tier: str, mode: str) -> Path:
    """Build `tier` (torch's cpp_extension: ninja, into $TORCH_EXTENSIONS_DIR), load it, leave
    the marker; NativeBuildError when the compiler fails on a CPU with AVX2."""
    from torch.utils.cpp_extension import load as build

    name, flags = _target(tier, mode)
    _clear_stale_lock(name)
    try:
        build(name=name, sources=[str(_CSRC / n) for n in SOURCES],
              extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # the compiler's output is in the message
        if "avx2" in cpu_flags():
            raise NativeBuildError(f"kvmesh: building the native CPU kernels failed on a CPU with AVX2 and a "
                                   f"compiler ({_compiler()}); fix the build (or set kernels.cpu_kernels=false "
                                   f"to run the PyTorch reference paths): {exc}") from exc
        raise
    _check_ops()
    lib = _library(name)
    (lib.parent / MARKER).write_text(json.dumps(_marker(flags)))  # written last: the build is whole
    return lib


def _build(isa_cap: str) -> bool:
    best, mode = isa(isa_cap), march()
    # Portable builds run on any CPU of their tier or wider: take the best one already built
    # (an image's) before compiling.
    for tier in TIERS[TIERS.index(best):] if mode == "portable" else (best,):
        if _load_prebuilt(tier, mode):
            _loaded["isa"] = tier
            return True
    if _compiler() is None:
        logger.warning("kvmesh: no C++ compiler found; the native CPU kernels are off (PyTorch reference paths)")
        return False
    try:
        _compile(best, mode)
    except NativeBuildError:
        raise
    except Exception as exc:
        logger.warning("kvmesh: the native CPU kernels did not build on this CPU (no AVX2): %s", exc)
        return False
    _loaded["isa"] = best
    return True


def prebuild(tier: str) -> Path:
    """Build (or find) `tier`'s kernels in the current march mode and load them: the library's
    path. What `kvmesh warm` runs once per tier, each in its own process (one build per process)."""
    if tier not in runnable_tiers():
        raise KVMeshError(f"kernels: this CPU cannot run the {tier} build (it runs {', '.join(runnable_tiers())}); "
                          f"build it on a CPU that does")
    if "ok" in _loaded:
        raise KVMeshError("kernels: this process already loaded a native kernel build; prebuild needs a new process")
    mode = march()
    with _lock:
        if not _load_prebuilt(tier, mode):
            if _compiler() is None:
                raise KVMeshError("kernels: no C++ compiler found (set CXX or install g++)")
            _compile(tier, mode)
        _loaded.update(ok=True, isa=tier, isa_cap="avx2" if tier != "avx512" else "native")
    return _library(_target(tier, mode)[0])
