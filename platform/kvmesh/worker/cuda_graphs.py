"""CUDA graphs for decode-only steps.

A decode step of a small model is dozens of kernel launches per layer, each a few
microseconds of CPU time for a few microseconds of GPU work: launch-bound. A CUDA graph
replays the whole forward with one launch. Graphs need fixed shapes and fixed addresses,
so one graph is captured per batch-size bucket (1, 2, 4, 8, ... up to the configured
maximum) over static buffers (token ids, positions, slots, block table, context lens);
a step of n decodes copies its inputs into the first n rows, pads the rest of its
bucket with rows that write nothing (slot -1) and attend to nothing (context 0), and
replays. Mixed steps (prefill chunks, speculative verification) and batches above the
largest bucket run eagerly.

The bookkeeping (bucket choice, padding, buffers) is plain code over numpy and torch,
tested on CPU; the capture itself goes through a `GraphRecorder`: `CudaGraphRecorder` on
CUDA, `EagerRecorder` (re-runs the function on replay) for tests without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def capture_sizes(max_batch: int) -> list[int]:
    """The buckets captured for batches up to `max_batch` (always ending at max_batch)."""
    if max_batch < 1:
        return []
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


def pick_bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest captured bucket holding n rows, or None (run eagerly)."""
    for b in sizes:
        if b >= n:
            return b
    return None


@dataclass
class DecodeInputs:
    """Host-side inputs of one padded decode batch (rows [n, bucket) are padding)."""

    n: int
    bucket: int
    input_ids: np.ndarray  # (bucket,) int64
    positions: np.ndarray  # (bucket,) int64
    slot_mapping: np.ndarray  # (bucket,) int64, -1 on padding rows
    block_table: np.ndarray  # (bucket, max_blocks) int32, 0 past a row's blocks
    context_lens: np.ndarray  # (bucket,) int32, 0 on padding rows


def pad_decode_inputs(spans, token_ids: list[int], bucket: int, max_blocks: int, block_size: int) -> DecodeInputs:
    """One row per decode span (q_len 1), padded to `bucket` rows."""
    n = len(spans)
    if n > bucket:
        raise ValueError(f"{n} decodes do not fit a bucket of {bucket}")
    ids = np.zeros(bucket, dtype=np.int64)
    pos = np.zeros(bucket, dtype=np.int64)
    slots = np.full(bucket, -1, dtype=np.int64)
    table = np.zeros((bucket, max_blocks), dtype=np.int32)
    lens = np.zeros(bucket, dtype=np.int32)
    for i, s in enumerate(spans):
        nblk = -(-s.ctx_len // block_size)
        if nblk > max_blocks:
            raise ValueError(f"context of {s.ctx_len} tokens needs {nblk} blocks; graph buffers hold {max_blocks}")
        ids[i] = token_ids[i]
        pos[i] = s.start_pos
        slots[i] = s.block_ids[s.start_pos // block_size] * block_size + s.start_pos % block_size
        table[i, :nblk] = s.block_ids[:nblk]
        lens[i] = s.ctx_len
    return DecodeInputs(n, bucket, ids, pos, slots, table, lens)


class GraphBuffers:
    """Static device buffers sized for the largest bucket; a bucket's graph reads rows
    [0, bucket) of each. `fill` overwrites them in place (addresses never change)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)

    def fill(self, inputs: DecodeInputs) -> None:
        b = inputs.bucket
        for dst, src in ((self.input_ids, inputs.input_ids), (self.positions, inputs.positions),
                         (self.slot_mapping, inputs.slot_mapping), (self.block_table, inputs.block_table),
                         (self.context_lens, inputs.context_lens)):
            dst[:b].copy_(torch.from_numpy(src), non_blocking=True)


class GraphRecorder(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        """Capture `fn` (warmed up first); returns its static output and the replay."""
        ...


class CudaGraphRecorder:
    """torch.cuda.CUDAGraph per bucket, all in one memory pool (captured largest first,
    so smaller graphs reuse the largest's activation memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs.append(graph)
        return out, graph.replay


class EagerRecorder:
    """Stands in for CUDA graphs where there is no GPU: replay re-runs the function and
    copies into the static output, so the static-buffer plumbing is what gets tested."""

    def capture(self, fn):
        out = fn()
        return out, lambda: out.copy_(fn())


@dataclass
class _Graph:
    bucket: int
    meta: object
    output: torch.Tensor
    replay: Callable[[], None]


class DecodeGraphs:
    """Captured decode graphs of one model runner (see the module docstring).

    `forward(input_ids, positions, meta)` runs the model; `backend.graph_metadata` builds
    decode metadata over the static buffers with a split plan valid up to max_model_len.
    """

    def __init__(self, forward: Callable, backend, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device, recorder: GraphRecorder | None = None):
        self.forward = forward
        self.backend = backend
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.buffers = GraphBuffers(max(self.sizes), self.max_blocks, device)
        self.recorder = recorder if recorder is not None else CudaGraphRecorder()
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0

    def capture(self) -> float:
        """Capture every bucket, largest first; returns the seconds it took."""
        start = time.perf_counter()
        buf = self.buffers
        for b in sorted(self.sizes, reverse=True):
            meta = self.backend.graph_metadata(buf.slot_mapping[:b], buf.block_table[:b], buf.context_lens[:b],
                                               self.max_model_len)
            ids, pos = buf.input_ids[:b], buf.positions[:b]
            out, replay = self.recorder.capture(lambda ids=ids, pos=pos, meta=meta: self.forward(ids, pos, meta))
            self.graphs[b] = _Graph(b, meta, out, replay)
        return time.perf_counter() - start

    def can_run(self, spans, num_decodes: int) -> bool:
        """Only decode-only steps that fit a bucket and the static block table."""
        if num_decodes != len(spans) or pick_bucket(num_decodes, self.sizes) is None:
            return False
        return all(s.ctx_len <= self.max_model_len for s in spans)

    def run(self, spans, token_ids: list[int]) -> torch.Tensor:
        """Hidden states (n, hidden) of a decode-only step (check `can_run` first)."""
        bucket = pick_bucket(len(spans), self.sizes)
        graph = self.graphs[bucket]
        self.buffers.fill(pad_decode_inputs(spans, token_ids, bucket, self.max_blocks, self.block_size))
        graph.replay()
        self.replays += 1
        return graph.output[: len(spans)]
