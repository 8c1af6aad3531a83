"""Fixtures shared by the multi-process integration tests."""

from __future__ import annotations

import pytest

from kvmesh_procs import spawn_worker, stop, wait_ready


@pytest.fixture(scope="module")
def workers(tiny_llama, tmp_path_factory):
    """Two unified worker processes on the tiny model; yields their addresses."""
    logs = tmp_path_factory.mktemp("unified-worker-logs")
    procs = [spawn_worker(f"unified{i}", tiny_llama, "unified", logs) for i in range(2)]
    try:
        yield [wait_ready(p).address for p in procs]
    finally:
        for p in procs:
            stop(p)
