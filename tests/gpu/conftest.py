"""The GPU group: Triton kernels run interpreted on CPU tensors here (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU, before kvmesh is imported); on a CUDA machine the
same tests run compiled on the GPU. Without triton installed they skip, saying so."""

from __future__ import annotations

import pytest
import torch

from kvmesh.layers.triton_runtime import AVAILABLE, INTERPRET


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: the GPU when there is one, else CPU tensors, interpreted."""
    if not AVAILABLE:
        pytest.skip("triton is not installed")
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device and TRITON_INTERPRET is not set")
    return torch.device("cuda")
