"""The pinned host buffer of the KV store path (worker/host_staging.py): a no-op for CPU
tensors; otherwise one buffer reused across reads and grown when a larger read comes.
Page-locking needs CUDA, so here the buffer logic runs unpinned on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from kvmesh.worker.host_staging import HostStaging


def test_cpu_tensors_pass_through_without_a_buffer():
    staging = HostStaging(pin=False)
    kv = torch.randn(2, 2, 3, 4, 2, 8)
    assert staging.to_host(kv) is kv and staging.allocations == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_reuse_one_buffer_and_grow_it(dtype):
    staging = HostStaging(pin=False)
    a = torch.randn(2, 2, 3, 4, 2, 8).to(dtype)
    out = staging.copy(a)
    assert torch.equal(out, a) and out.dtype == dtype and out.data_ptr() != a.data_ptr()
    ptr = out.data_ptr()
    b = torch.randn(2, 2, 1, 4, 2, 8).to(dtype)[:, :, :, :, :, ::2]  # smaller, non-contiguous
    out = staging.copy(b)
    assert torch.equal(out, b) and out.data_ptr() == ptr and staging.allocations == 1
    c = torch.randn(2, 2, 9, 4, 2, 8).to(dtype)  # larger: one new buffer
    assert torch.equal(staging.copy(c), c) and staging.allocations == 2
    assert torch.equal(staging.copy(a), a) and staging.allocations == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_cuda_reads_land_in_pinned_memory():
    staging = HostStaging(pin=True)
    kv = torch.randn(2, 2, 3, 4, 2, 8, device="cuda")
    out = staging.to_host(kv)
    assert out.device.type == "cpu" and out.is_pinned() and torch.equal(out, kv.cpu())
