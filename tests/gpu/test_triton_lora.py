"""The Triton multi-LoRA shrink / expand (layers/triton_lora.py) against the PyTorch reference
and the per-row dense oracle (tests/lora_cases.py), fp32 and bf16, at tiny sizes (interpreted
on CPU here): fused shards of unequal widths, zero-padded ranks, base-model and empty segments."""

from __future__ import annotations

import pytest
import torch
from gpu_marks import requires_triton
from lora_cases import SHAPES, Case, make_case, naive_delta, random_segments

from kvmesh.layers import triton_lora
from kvmesh.layers.lora_kernels import lora_sgmv_torch, lora_sgmv_triton

pytestmark = requires_triton

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def run_triton(case: Case, device: torch.device, index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    y = case.y.clone().to(device)  # .to(cpu) alone would alias case.y
    lora_sgmv_triton(y, case.x.to(device), case.a.to(device), case.b.to(device),
                     *case.seg_tensors(index_dtype, device), case.offsets)
    return y.cpu()


def check(out: torch.Tensor, case: Case) -> None:
    torch.testing.assert_close(out.double(), naive_delta(case), **TOL[out.dtype])
    untouched = ~case.covered()
    assert torch.equal(out[untouched], case.y[untouched]), "rows of no adapter segment changed"
    ref = case.y.clone()
    lora_sgmv_torch(ref, case.x, case.a, case.b, *case.seg_tensors(), case.offsets)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # bf16: TF32 expand products and another summation order, y rounded once
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: f"T{s[0]}-K{s[1]}-N{'+'.join(map(str, s[2]))}-R{s[3]}")
def test_triton_matches_reference(device, shape, dtype):
    t, k, widths, r, slots, ranks = shape
    g = torch.Generator().manual_seed(t * 31 + k)
    case = make_case(t + k, t, k, widths, r, slots, dtype, random_segments(g, t, slots), ranks)
    check(run_triton(case, device), case)


def test_triton_rank_64_int32_segments_and_prefill_tiles(device):
    """R = 64 (one BLOCK_R tile), int32 segments, and T > 256 (64-row tiles)."""
    case = make_case(7, 20, 128, [130], 64, 2, torch.float32, [(0, 9, 1), (9, 4, -1), (13, 7, 0)], [64, 9])
    check(run_triton(case, device, torch.int32), case)
    assert triton_lora.block_m_for(300) == 64
    case = make_case(8, 300, 16, [16, 8], 8, 2, torch.float32, [(0, 5, 0), (5, 0, 1), (5, 290, 1)])
    check(run_triton(case, device), case)


def test_triton_no_segments_and_all_base_model_leave_y_alone(device):
    for segments in ([], [(0, 3, -1), (3, 0, 0)]):
        case = make_case(1, 3, 16, [16], 8, 1, torch.float32, segments)
        assert torch.equal(run_triton(case, device), case.y)
