"""layers/op.py: each layer binds its backend once, from its OpContext, and again when it is
moved or cast; model files name no backend; the native build fails loudly where it should
build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvmesh.config import KernelConfig
from kvmesh.layers import native
from kvmesh.layers.activation import SiluAndMul
from kvmesh.layers.linear import SKINNY_KERNEL_ROWS, Linear
from kvmesh.layers.norm import RMSNorm
from kvmesh.layers.op import OpContext
from kvmesh.layers.rotary import RotaryQKV, apply_rope

ROOT = Path(__file__).resolve().parents[2]
NATIVE = native.load()
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native kernels are off")


def _layers(ctx: OpContext):
    return [RMSNorm(16, 1e-6, ctx), SiluAndMul(ctx), RotaryQKV(2, 1, 8, ctx)]


@needs_native
def test_backend_follows_the_context_not_the_call():
    assert {m.backend for m in _layers(OpContext())} == {"cpu"}
    assert {m.backend for m in _layers(OpContext(kernels=KernelConfig(layer_ops="torch")))} == {"torch"}
    assert {m.backend for m in _layers(OpContext(kernels=KernelConfig(cpu_kernels=False)))} == {"torch"}
    lin = Linear(16, 8)
    assert lin._skinny_rows == SKINNY_KERNEL_ROWS
    assert Linear(16, 8, ctx=OpContext(kernels=KernelConfig(cpu_kernels=False)))._skinny_rows == 0


@needs_native
def test_no_per_call_dispatch(monkeypatch):
    """Once built, a layer never asks which backend to run: with every predicate made to
    raise, the bound kernels still run (and equal the references)."""
    norm, act, rope = _layers(OpContext())
    lin = Linear(16, 24)

    def boom(*args, **kwargs):
        raise AssertionError("a backend predicate ran per call")

    monkeypatch.setattr(native, "load", boom)
    monkeypatch.setattr(native, "cpu_flags", boom)
    monkeypatch.setattr(OpContext, "elementwise_backend", boom)
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), norm.forward_torch(x))
    gu = torch.randn(3, 16)
    torch.testing.assert_close(act(gu), F.silu(gu[:, :8]) * gu[:, 8:])
    qkv, ang = torch.randn(3, 32), torch.randn(3, 1, 8)
    q, k, v = rope(qkv, ang.cos(), ang.sin())
    torch.testing.assert_close(q, apply_rope(qkv[:, :16].view(3, 2, 8), ang.cos(), ang.sin()))
    torch.testing.assert_close(v, qkv[:, 24:].view(3, 1, 8))
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_native
def test_cast_rebinds():
    lin = Linear(32, 16)
    assert lin._small_rows[0] <= lin._small_rows[1]  # float32: the small-batch GEMM serves 5-64 rows
    lin = lin.to(torch.bfloat16)
    assert lin.ctx.dtype == torch.bfloat16 and lin._skinny_rows == SKINNY_KERNEL_ROWS
    assert lin._small_rows[0] > lin._small_rows[1]  # bf16: no small-batch GEMM (oneDNN keeps AMX / BF16)
    x = torch.randn(2, 32).bfloat16()
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()),
                               rtol=2e-2, atol=2e-2)
    norm = RMSNorm(8, 1e-6).to(torch.bfloat16)
    assert norm.ctx.dtype == torch.bfloat16 and norm.backend == "cpu"


def test_models_name_no_backend():
    """Model files compose layers: no triton / native / CUDA predicate, no kernel op in them."""
    forbidden = re.compile(r"triton|cpu_kernels|layers\.native|torch\.ops|is_cuda|device\.type|\.cuda\(|"
                           r"mkldnn|_is_avx|import native")
    for path in sorted((ROOT / "platform/kvmesh/models").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not forbidden.search(line), f"{path.name}:{n}: {line.strip()}"


def test_one_native_build():
    """Every C/C++ source of the package is in the one build (no second library, and no kernel
    loaded through ctypes)."""
    sources = {p.name for p in (ROOT / "platform/kvmesh").rglob("*.c*") if p.suffix in (".c", ".cc", ".cpp")}
    assert sources == set(native.SOURCES)
    for folder in ("layers", "quant", "models", "worker"):
        for path in (ROOT / "platform/kvmesh" / folder).rglob("*.py"):
            # madvise on the KV cache's pages, mallopt of the worker's heap: libc, not a kernel
            if path.name not in ("kv_memory.py", "host_memory.py"):
                assert "ctypes" not in path.read_text(), path


def test_native_kernels_build_where_they_should():
    """On a CPU with AVX2 and a C++ compiler the native kernels must load (a build failure
    raises NativeBuildError, never falls back silently): here that is this machine."""
    if "avx2" not in native.cpu_flags() or native._compiler() is None:
        pytest.skip("no AVX2 or no C++ compiler: the PyTorch paths are the design here")
    assert native.load() and native.has_quant_gemm() == ({"avx2", "fma", "f16c"} <= native.cpu_flags())


def test_a_broken_build_raises_with_the_compiler_output(tmp_path, monkeypatch):
    if "avx2" not in native.cpu_flags() or native._compiler() is None:
        pytest.skip("no AVX2 or no C++ compiler")
    broken = tmp_path / "csrc"
    broken.mkdir()
    (broken / "broken.cpp").write_text("int kvmesh_broken( { return 0; }\n")
    monkeypatch.setattr(native, "_CSRC", broken)
    monkeypatch.setattr(native, "SOURCES", ("broken.cpp",))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(native.NativeBuildError, match=r"(?s)failed on a CPU with AVX2.*broken\.cpp"):
        native._build("native")


def test_isa_cap_is_per_process():
    if not NATIVE:
        pytest.skip("no native build")
    with pytest.raises(Exception, match="needs a new process"):
        native.load("avx2" if native._loaded["isa_cap"] == "native" else "native")
    with pytest.raises(ValueError, match="native_isa"):
        native.load("avx9000")


def test_a_killed_builds_lock_is_cleared_a_live_ones_kept(tmp_path, monkeypatch):
    """torch's build lock outlives a build killed mid-way; left there, every later process
    would wait on it forever. One far older than any build is removed, a fresh one kept."""
    import os
    import time

    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "kvmesh_test_ext" / "lock"
    assert str(lock.parent) == _get_build_directory("kvmesh_test_ext", verbose=False)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    native._clear_stale_lock("kvmesh_test_ext")
    assert lock.exists()  # a build may be running: wait for it
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    native._clear_stale_lock("kvmesh_test_ext")
    assert not lock.exists()


def test_gemma_offset_norm_runs_the_kernel_in_fp32_only():
    """Gemma's (1 + w) norm: the C++ rms_norm with 1 + w as its scale in float32 (same math and
    cast order as Gemma's reference); bf16 keeps the reference, whose order differs."""
    from kvmesh.layers.norm import RMSNorm
    from kvmesh.layers.op import OpContext

    norm = RMSNorm(96, 1e-6, OpContext(kernels=KernelConfig()), offset=1.0)
    with torch.no_grad():
        norm.weight.normal_(0, 0.2)
    assert norm.backend == ("cpu" if native.load("native") else "torch")
    x = torch.randn(5, 96)
    torch.testing.assert_close(norm(x), norm.forward_torch(x), rtol=1e-6, atol=1e-6)
    h, y = norm.add_forward(x, x)
    torch.testing.assert_close(y, norm.forward_torch(2 * x), rtol=1e-6, atol=1e-6)
    assert norm.to(torch.bfloat16).backend == "torch"
