"""The batched multi-LoRA delta (layers/lora_kernels.py): the native CPU kernel and the PyTorch
reference against a per-row dense oracle in float64, fp32 and bf16, over random shapes with
fused shards of unequal widths, zero-padded ranks, base-model and empty segments."""

from __future__ import annotations

import pytest
import torch
from lora_cases import SHAPES, Case, make_case, naive_delta, random_segments

from kvmesh.layers import lora_kernels, native
from kvmesh.layers.lora_kernels import lora_sgmv_native, lora_sgmv_torch

NATIVE = native.load()
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native kernels are off")
BACKENDS = {"torch": lora_sgmv_torch, "cpu": pytest.param(lora_sgmv_native, marks=needs_native)}
# Against the float64 oracle: fp32 sums in another order; bf16 inputs exact, y rounded once.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def run(fn, case: Case, index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    y = case.y.clone()
    fn(y, case.x, case.a, case.b, *case.seg_tensors(index_dtype), case.offsets)
    return y


def check(out: torch.Tensor, case: Case) -> None:
    want = naive_delta(case)
    torch.testing.assert_close(out.double(), want, **TOL[out.dtype])
    untouched = ~case.covered()
    assert torch.equal(out[untouched], case.y[untouched]), "rows of no adapter segment changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-K{s[1]}-N{'+'.join(map(str, s[2]))}-R{s[3]}")
@pytest.mark.parametrize("fn", BACKENDS.values(), ids=BACKENDS.keys())
def test_matches_dense_oracle(fn, shape, dtype):
    t, k, widths, r, slots, ranks = shape
    g = torch.Generator().manual_seed(t * 31 + k)
    case = make_case(t + k, t, k, widths, r, slots, dtype, random_segments(g, t, slots), ranks)
    check(run(fn, case), case)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_native_matches_reference_random_shapes(seed, dtype):
    g = torch.Generator().manual_seed(100 + seed)
    t, k = int(torch.randint(1, 80, (1,), generator=g)), int(torch.randint(1, 200, (1,), generator=g))
    num_shards = int(torch.randint(1, 4, (1,), generator=g))
    widths = [int(w) for w in torch.randint(0, 90, (num_shards,), generator=g)]
    widths[0] = max(widths[0], 1)
    r = int(torch.randint(1, 65, (1,), generator=g))
    slots = int(torch.randint(1, 5, (1,), generator=g))
    ranks = [int(torch.randint(0, r + 1, (1,), generator=g)) for _ in range(slots)]
    case = make_case(seed, t, k, widths, r, slots, dtype, random_segments(g, t, slots), ranks)
    out, ref = run(lora_sgmv_native, case), run(lora_sgmv_torch, case)
    check(out, case)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # both round the same fp32 sum once, summed in another order: at most an ulp apart
        torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3)


@needs_native
def test_decode_shaped_step_int32_segments():
    """One row per sequence, the batch's rows grouped by adapter, int32 segment tensors."""
    t, k, widths, r = 24, 576, [576, 192, 192], 16
    segments = [(0, 8, 2), (8, 4, -1), (12, 0, 1), (12, 5, 0), (17, 7, 1)]
    case = make_case(5, t, k, widths, r, 3, torch.float32, segments, [16, 8, 4])
    check(run(lora_sgmv_native, case, torch.int32), case)
    check(run(lora_sgmv_torch, case, torch.int32), case)


@needs_native
def test_native_updates_a_strided_view_in_place():
    """y may be a column slice of a wider buffer (its row stride > N): only its columns change."""
    case = make_case(3, 9, 48, [32], 8, 2, torch.float32, [(0, 4, 1), (4, 5, 0)])
    buf = torch.randn(9, 50)
    buf[:, 10:42] = case.y
    before = buf.clone()
    view = buf[:, 10:42]
    lora_sgmv_native(view, case.x, case.a, case.b, *case.seg_tensors(), case.offsets)
    check(view, case)
    assert torch.equal(buf[:, :10], before[:, :10]) and torch.equal(buf[:, 42:], before[:, 42:])


@pytest.mark.parametrize("fn", BACKENDS.values(), ids=BACKENDS.keys())
def test_no_segments_and_all_base_model_leave_y_alone(fn):
    for segments in ([], [(0, 3, -1), (3, 0, 0)]):
        case = make_case(1, 3, 16, [16], 8, 1, torch.float32, segments)
        assert torch.equal(run(fn, case), case.y)


@pytest.mark.parametrize("fn", BACKENDS.values(), ids=BACKENDS.keys())
def test_bad_arguments_raise(fn):
    case = make_case(2, 4, 16, [8, 8], 8, 2, torch.float32, [(0, 4, 1)])
    with pytest.raises(ValueError, match="shard_offsets"):
        fn(case.y.clone(), case.x, case.a, case.b, *case.seg_tensors(), [0, 8])
    with pytest.raises(ValueError, match="b must be"):
        fn(case.y.clone(), case.x, case.a, case.b.transpose(1, 2), *case.seg_tensors(), case.offsets)
    with pytest.raises(ValueError, match="one dtype"):
        fn(case.y.clone(), case.x.bfloat16(), case.a, case.b, *case.seg_tensors(), case.offsets)
    bad = Case(case.y, case.x, case.a, case.b, [(0, 4, 2)], case.offsets)  # slot 2 of 2
    with pytest.raises((ValueError, RuntimeError), match="slot"):
        run(fn, bad)
    bad.segments = [(2, 3, 0)]  # past the 4 rows
    with pytest.raises((ValueError, RuntimeError), match="outside"):
        run(fn, bad)


def test_dispatch_picks_native_on_cpu_when_loaded():
    assert lora_kernels.backend_for(torch.empty(1, 1)) == ("cpu" if NATIVE else "torch")
    case = make_case(4, 5, 32, [16, 8, 8], 8, 2, torch.float32, [(0, 2, 1), (2, 3, 0)])
    y = case.y.clone()
    lora_kernels.lora_sgmv(y, case.x, case.a, case.b, *case.seg_tensors(), case.offsets)
    check(y, case)
