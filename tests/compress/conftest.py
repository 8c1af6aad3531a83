"""Fixtures of the compression tests: one real worker process (tiny model), reusing the
integration tests' process helpers (tests/integration/kvmesh_procs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# One thread: the LM scoring of the token method thrashes when 2 threads share 2 busy cores.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from kvmesh_procs import spawn_worker, stop, wait_ready  # noqa: E402


@pytest.fixture(scope="module")
def worker_address(tiny_llama, tmp_path_factory):
    """One unified worker process on the tiny model; yields its address."""
    proc = spawn_worker("compress-unified", tiny_llama, "unified", tmp_path_factory.mktemp("compress-worker-logs"),
                        max_model_len=512, num_blocks=256)
    try:
        yield wait_ready(proc).address
    finally:
        stop(proc)
