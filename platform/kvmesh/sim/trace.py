"""Mooncake-format request traces: load, slice, time-scale, reshape, and turn each
request's prefix-block ids into kvmesh chained block hashes.

A line is {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]},
one hash id per `trace_block_size` (512) prompt tokens; equal ids at the start of two
requests mean a shared prefix. The simulator hashes id chains with engine.hashing (the
id stands in for the block's tokens), so equal id prefixes give equal kvmesh hashes and
the real prefix cache, KV events and router scorers see exactly the trace's sharing.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from kvmesh.engine.hashing import BlockHash, hash_block, root_hash

TRACE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's release


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, start_s: float = 0.0, duration_s: float | None = None, time_scale: float = 1.0,
               limit: int | None = None) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + duration_s) of the trace, re-timed from 0
    and compressed `time_scale` times (2.0 = the same requests at twice the rate)."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    out: list[TraceRequest] = []
    end = math.inf if duration_s is None else start_s + duration_s
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t = row["timestamp"] / 1000.0
                req = TraceRequest(t, int(row["input_length"]), max(int(row["output_length"]), 1),
                                   tuple(row["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc}); expected timestamp, "
                                 "input_length, output_length, hash_ids") from exc
            if start_s <= t < end:
                out.append(replace(req, arrival_s=(t - start_s) / time_scale))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def compress(trace: Iterable[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests at `factor` times the arrival rate (arrival times divided by it)."""
    if factor <= 0:
        raise ValueError(f"rate factor must be > 0, got {factor}")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in trace]


def warp(trace: Iterable[TraceRequest], multiplier: Callable[[float], float], dt: float = 1.0) -> list[TraceRequest]:
    """Re-time a trace so its arrival rate is multiplied by `multiplier(t)` around time t
    of the output (diurnal waves, bursts), keeping the order of requests: output time T
    maps to input time t(T) = integral of multiplier over [0, T]."""
    reqs = list(trace)
    if not reqs:
        return []
    grid_t, grid_in = [0.0], [0.0]  # output time -> consumed input time
    last = reqs[-1].arrival_s
    while grid_in[-1] < last:
        m = multiplier(grid_t[-1])
        if m <= 0:
            raise ValueError(f"multiplier must be > 0, got {m} at t={grid_t[-1]}")
        grid_t.append(grid_t[-1] + dt)
        grid_in.append(grid_in[-1] + m * dt)
    out = []
    for r in reqs:
        i = max(bisect.bisect_left(grid_in, r.arrival_s), 1)
        frac = (r.arrival_s - grid_in[i - 1]) / (grid_in[i] - grid_in[i - 1])
        out.append(replace(r, arrival_s=grid_t[i - 1] + frac * dt))
    return out


def diurnal(period_s: float, low: float, high: float) -> Callable[[float], float]:
    """A rate multiplier that swings from `low` up to `high` and back once per period."""
    return lambda t: low + (high - low) * 0.5 * (1 - math.cos(2 * math.pi * t / period_s))


def block_hashes(hash_ids: Iterable[int], model_fingerprint: str) -> list[BlockHash]:
    """kvmesh chained hashes of a chain of trace block ids (each id hashed as the block's content)."""
    parent = root_hash(model_fingerprint)
    out = []
    for block_id in hash_ids:
        parent = hash_block(parent, (block_id,))
        out.append(parent)
    return out


def block_tokens(block_id: int, n: int, vocab_size: int) -> list[int]:
    """A fixed pseudo-random block of `n` token ids for a trace block id (for replays
    against real workers, whose engines hash real tokens)."""
    x = (block_id * 0x9E3779B97F4A7C15 + 1) & 0xFFFFFFFFFFFFFFFF
    out = []
    for _ in range(n):
        x ^= (x << 13) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 7
        x ^= (x << 17) & 0xFFFFFFFFFFFFFFFF
        out.append(x % vocab_size)
    return out
