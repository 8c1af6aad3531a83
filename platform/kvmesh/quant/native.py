"""Build and load kvmesh's CPU quantized GEMM (csrc/cpu_gemm.c) through ctypes.

Compiled once per source version with the system C compiler into the kvmesh cache
(a few seconds; no torch headers involved) and loaded lazily. `get_lib()` returns
None when the CPU lacks AVX2 / FMA / F16C, no compiler is found, or the build fails:
callers then use the always-correct dequantize-then-matmul path. Set
KVMESH_QUANT_NATIVE=0 to force that fallback. Where the CPU has AVX-512 F / BW the library
is built with its 16-lane loops (one cached build per flag set).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvmesh.checkpoint.embedded import cache_dir

logger = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "cpu_gemm.c"
_FLAGS = ["-O3", "-std=gnu11", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_REQUIRED_CPU_FLAGS = {"avx2", "fma", "f16c"}
# Where the CPU has them, the 16-lane loops of cpu_gemm.c (the flags are part of the cached
# library's name, so a cache shared by different CPUs keeps one build per ISA).
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw"]
_AVX512_CPU_FLAGS = {"avx512f", "avx512bw"}
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_supported() -> bool:
    return _REQUIRED_CPU_FLAGS <= _cpu_flags()


def build_flags() -> list[str]:
    """The compiler flags for this CPU: AVX2 + FMA + F16C, plus AVX-512 F / BW where present
    (KVMESH_QUANT_AVX512=0: the AVX2 loops everywhere, e.g. to test them on an AVX-512 CPU)."""
    avx512 = _AVX512_CPU_FLAGS <= _cpu_flags() and os.environ.get("KVMESH_QUANT_AVX512", "1") != "0"
    return _FLAGS + (_AVX512_FLAGS if avx512 else [])


def _build() -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not _SRC.is_file():  # a wheel built without package data lacks the source
        return None
    src = _SRC.read_bytes()
    flags = build_flags()
    tag = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / "native" / f"kvmesh_cpu_gemm_{tag}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(_SRC), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("kvmesh: building the quantized CPU kernel failed (%s); using dequantize-then-matmul", exc)
        Path(tmp).unlink(missing_ok=True)
        return None
    return out


def get_lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be used (see module doc)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("KVMESH_QUANT_NATIVE", "1") == "0" or not _cpu_supported():
        return None
    import torch  # noqa: F401  (loads torch's libgomp first, so the kernel shares its pool)

    path = _build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.kvm_int8_gemm.argtypes = [p, i64, i64, p, p, i64, i64, p]
    lib.kvm_int8_gemm.restype = None
    lib.kvm_int4_gemm.argtypes = [p, i64, i64, p, p, p, i32, i64, i64, p]
    lib.kvm_int4_gemm.restype = ctypes.c_int
    _lib = lib
    return lib


def address(fn: ctypes._CFuncPtr) -> int:
    """The address of one of the library's C functions (for C++ callers such as the
    decode_stack op, which call the kernel directly)."""
    return ctypes.cast(fn, ctypes.c_void_p).value
