"""kvmesh.layers.linear: the CPU GEMM paths (weight split, oneDNN packed weight, the native skinny and
small-batch kernels) against F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.config import KernelConfig
from kvmesh.layers import linear as ops
from kvmesh.layers import native
from kvmesh.layers.op import OpContext


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 5, ops.SPLIT_WEIGHT_MAJOR_ROWS, ops.SPLIT_WEIGHT_MAJOR_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(dtype, tol, rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = ops.Linear(96, 120, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(120, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(120, generator=g))
    x = torch.randn(rows, 96, generator=g).to(dtype)
    ref = F.linear(x.double(), lin.weight.double(), lin.bias.double() if bias else None)
    with torch.inference_mode():
        out = lin(x)
    assert out.dtype == dtype and out.shape == (rows, 120)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * 10)


def test_packed_weight_follows_edits_and_casts():
    lin = ops.Linear(32, 48)
    x = torch.randn(ops.SPLIT_WEIGHT_MAJOR_ROWS + 4, 32)
    with torch.inference_mode():
        lin(x)
        with torch.no_grad():
            lin.weight.mul_(2)
        lin.invalidate()
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
        lin = lin.to(torch.bfloat16)  # a cast drops the fp32 packed copy
        torch.testing.assert_close(lin(x.bfloat16()).float(), F.linear(x, lin.weight.float(), lin.bias.float()),
                                   rtol=3e-2, atol=3e-2)


def test_model_runner_prepacks_every_onednn_linear(model_factory):
    """The runner reorders every weight oneDNN serves when it starts, not on the first prompt
    long enough to leave the skinny / small-batch kernels (a multi-second stall there)."""
    from kvmesh.build import build_engine

    engine = build_engine(model=str(model_factory()), progress=False, block_size=4, num_blocks=64)
    model = engine.executor.runner.model
    linears = [m for name, m in model.named_modules() if isinstance(m, ops.Linear) and name != "lm_head"]
    assert linears
    for lin in linears:
        assert (lin._packed is not None) == lin._onednn
    assert model.lm_head._packed is None  # one row per sequence: never oneDNN in a decode or prefill step
    lin = ops.Linear(16, 8)
    lin.prepack()
    packed = lin._packed
    lin.prepack()  # already packed: kept
    assert lin._packed is packed and (packed is not None) == lin._onednn


def test_onednn_path_choice():
    assert ops.Linear(8, 8)._onednn == ops._ONEDNN_BUILT
    # bf16 goes through oneDNN only where the CPU multiplies bf16 natively; the choice
    # follows a cast (made when the layer is built or moved, never per call)
    assert ops.Linear(8, 8).to(torch.bfloat16)._onednn == (ops._ONEDNN_BUILT and native.native_bf16())
    off = OpContext(kernels=KernelConfig(onednn_linear=False))
    assert not ops.Linear(8, 8, ctx=off)._onednn


def test_bmm_split_matches_reference():
    """The fallback path (kernels.onednn_linear off, or bf16 without native bf16)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(120, 96, generator=g), torch.randn(120, generator=g)
    for rows in (1, ops.SPLIT_WEIGHT_MAJOR_ROWS, 100):
        x = torch.randn(rows, 96, generator=g)
        torch.testing.assert_close(ops.split_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def _check_kernel(op, dtype, tol, rows, out_features, k, g) -> torch.Tensor:
    """op(x, w, bias) against a float64 F.linear, with and without a bias; returns w."""
    w = torch.randn(out_features, k, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    for bias in (None, b):
        out = op(x, w, bias)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert out.dtype == dtype and out.shape == (rows, out_features)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * 20)
    return w


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("out_features", [1, 7, 8, 64, 131])  # tiles of 3-8 rows, their remainders
def test_skinny_kernel_matches_reference(dtype, tol, rows, out_features):
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    for k in (576, 37):  # whole vectors, and a scalar tail
        _check_kernel(torch.ops.kvmesh.skinny_linear, dtype, tol, rows, out_features, k, g)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        torch.ops.kvmesh.skinny_linear(torch.zeros(9, 8), torch.zeros(3, 8), None)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 16, 17, 24, 33, 40, 48, 56, 64, 65, 130])  # every register tile (half vectors too), partial and multi-block
@pytest.mark.parametrize("out_features", [1, 6, 13, 131])  # whole tiles of 6 / 8 / 12 / 16 rows and remainders
def test_small_kernel_matches_reference(dtype, tol, rows, out_features):
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    for k in (576, 37):  # whole blocks of 16 k, and a tail
        w = _check_kernel(torch.ops.kvmesh.small_linear, dtype, tol, rows, out_features, k, g)
        # a strided (non-contiguous) input is read as its values
        wide = torch.randn(rows, 2 * k, generator=g).to(dtype)
        torch.testing.assert_close(torch.ops.kvmesh.small_linear(wide[:, ::2], w, None).double(),
                                   F.linear(wide[:, ::2].double(), w.double()), rtol=tol, atol=tol * 20)
    assert torch.ops.kvmesh.small_linear(torch.zeros(0, 8), torch.zeros(3, 8), None).shape == (0, 3)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.kvmesh.small_linear(torch.zeros(4, 8), torch.zeros(3, 8, dtype=torch.bfloat16), None)


def test_linear_runs_the_small_kernel_for_decode_batches(monkeypatch):
    """fp32 Linear with rows in SMALL_GEMM_ROWS runs csrc/small_gemm.cpp (and matches F.linear);
    outside it, or with it switched off, it does not."""
    if not native.load():
        pytest.fail("C++ CPU kernels failed to build on this machine")
    calls = []
    real = torch.ops.kvmesh.small_linear

    def spy(x, *rest):
        calls.append(x.shape[0])
        return real(x, *rest)

    lin = ops.Linear(64, 40)
    lo, hi = ops.SMALL_GEMM_ROWS
    monkeypatch.setattr(torch.ops.kvmesh, "small_linear", spy)
    with torch.inference_mode():
        for rows in (lo - 1, lo, hi, hi + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-4, atol=1e-4)
        assert calls == [lo, hi]
        off = ops.Linear(64, 40, ctx=OpContext(kernels=KernelConfig(small_gemm=False)))
        off.load_state_dict(lin.state_dict())
        assert off(torch.randn(lo, 64)).shape == (lo, 40)
        assert calls == [lo, hi]
