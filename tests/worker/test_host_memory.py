"""The CPU worker keeps freed activation memory mapped (worker/host_memory.py), and the KV
cache's background populate maps block b of every layer before block b + 1 of any."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from kvmesh.worker import kv_memory
from kvmesh.worker.host_memory import keep_freed_memory

ROOT = Path(__file__).resolve().parents[2]

# Engine-like steps: each keeps a layer's activations (rows x 576 / 960 / 3072 / 1536 floats) until
# the step ends, the row count changing from step to step as prefill chunks come and go.
FAULTS = textwrap.dedent("""
    import random, resource, sys, torch
    if sys.argv[1] == "keep":
        from kvmesh.worker.host_memory import keep_freed_memory
        assert keep_freed_memory()
    rng = random.Random(0)
    def step(rows):
        live = [torch.ones(rows, w) for _ in range(4) for w in (576, 960, 3072, 1536, 576)]
        del live
    for rows in (512, 256, 64):
        step(rows)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(30):
        step(rng.choice((16, 64, 128, 256, 384, 512)))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    r = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_activations_stay_mapped_instead_of_faulting_in_every_step():
    default, kept = _faults("default"), _faults("keep")
    # glibc's defaults hand freed blocks back (unmapped, or trimmed off the heap top) and fault
    # them in again the next step.
    assert default > 30 * 1000, default
    # kept: what is left is first touches of new heap (a few thousand faults at most; 250-1500
    # measured across the pool's CPUs), not a fault on every page of every step.
    assert kept < default / 10, (kept, default)


def test_keep_freed_memory_is_once_per_process():
    first = keep_freed_memory()
    assert keep_freed_memory() is first
    assert first is sys.platform.startswith("linux")


def test_populate_rounds_advance_every_layer_together():
    page = mmap.PAGESIZE
    tensors = [torch.empty(n // 4) for n in (40 << 20, 40 << 20, 5 << 20)]  # two layers' K/V, one scale
    spans = kv_memory._spans(tensors)
    pieces = kv_memory._rounds(spans)
    for t, (_, start, end) in zip(tensors, spans):
        mine = [(a, b) for ref, a, b in pieces if ref() is t]
        # every byte once, in order, on page boundaries
        assert mine[0][0] == start - start % page and mine[-1][1] == end
        assert all(b == a2 for (_, b), (a2, _) in zip(mine, mine[1:]))
        assert all(a % page == 0 for a, _ in mine)
    # round-robin: the first piece of every tensor comes before the second piece of any
    firsts = [next(i for i, p in enumerate(pieces) if p[0]() is t) for t in tensors]
    seconds = [[i for i, p in enumerate(pieces) if p[0]() is t][1] for t in tensors]
    assert max(firsts) < min(seconds)
    # a tensor dropped before its turn is skipped, the rest still populated
    assert kv_memory._populate_spans([(weakref.ref(tensors[0]), *spans[0][1:])], duty=1.0)
