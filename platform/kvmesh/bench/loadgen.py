"""The open-loop load generator of `kvmesh bench serve`, and its library API.

Requests leave on a schedule fixed before the run (`arrival_times`: Poisson at
`request_rate`, gamma-distributed gaps for another `burstiness`, all at once for an
infinite rate, or a trace's own timestamps), whether or not earlier ones have finished:
a slow server builds a queue, as under real traffic. `max_concurrency` caps the
requests in flight (the rest wait their turn at the client, and their clock starts
when they are sent, as vLLM's does).

    from kvmesh.bench import ServeConfig, random_samples, run_serve
    result = run_serve(ServeConfig(backend="grpc", target="127.0.0.1:50051", request_rate=4),
                       random_samples(tokenizer, 32, 256, 64))
    print(result.summary["ttft_ms"]["p99"], result.summary["output_throughput"])
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from kvmesh.bench.clients import BACKENDS, Backend, RequestOptions
from kvmesh.bench.datasets import Sample
from kvmesh.bench.metrics import RequestRecord, summarize


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of `n` requests at `rate` per second: the
    first at 0, then gaps drawn from a gamma distribution of shape `burstiness` and mean
    1 / rate (shape 1 is a Poisson process; < 1 burstier, > 1 more even). rate = inf:
    all at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burst must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass
class ServeConfig:
    """One `kvmesh bench serve` run against one server."""

    backend: str = "openai"  # a key of clients.BACKENDS
    target: str = "http://127.0.0.1:8000"  # base URL (openai*) or host:port (grpc)
    model: str | None = None  # the served model name; None: the server's first
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    use_trace_timestamps: bool = True  # samples that carry arrival_s (traces) are sent then
    num_warmups: int = 0  # requests sent (all at once, not recorded) before the run
    options: RequestOptions = field(default_factory=RequestOptions)
    slos: dict[str, float] = field(default_factory=dict)  # metrics.parse_goodput's seconds
    progress: bool = True
    label: str = ""  # the tqdm bar's name

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class ServeResult:
    model: str
    records: list[RequestRecord]
    duration_s: float
    summary: dict
    arrivals_s: list[float]

    def to_dict(self, with_records: bool = True) -> dict:
        out = {"model": self.model, "summary": self.summary}
        if with_records:
            out["requests"] = [{k: v for k, v in asdict(r).items() if k != "text"} | {"tpot_s": r.tpot_s}
                               for r in self.records]
        return out


def schedule(cfg: ServeConfig, samples: list[Sample]) -> list[float]:
    """Each sample's send time: the trace's, or arrival_times at the configured rate."""
    if cfg.use_trace_timestamps and samples and all(s.arrival_s is not None for s in samples):
        return [float(s.arrival_s) for s in samples]
    return arrival_times(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)


async def _drive(backend: Backend, samples: list[Sample], arrivals: list[float], max_concurrency: int | None,
                 bar) -> tuple[list[RequestRecord], float]:
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(sample: Sample) -> RequestRecord:
        if gate is None:
            rec = await _send(sample)
        else:
            async with gate:
                rec = await _send(sample)
        if bar is not None:
            bar.update(1)
        return rec

    async def _send(sample: Sample) -> RequestRecord:
        start = time.perf_counter() - t0
        rec = await backend.send(sample)
        rec.start_s = start
        return rec

    tasks: list[asyncio.Task | None] = [None] * len(samples)
    for i in sorted(range(len(samples)), key=lambda i: arrivals[i]):
        delay = t0 + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks[i] = asyncio.create_task(one(samples[i]))
    records = await asyncio.gather(*tasks)  # in sample order
    return list(records), time.perf_counter() - t0


async def run_serve_async(cfg: ServeConfig, samples: list[Sample]) -> ServeResult:
    """Run `samples` against the server of `cfg`; see the module docstring."""
    backend = BACKENDS[cfg.backend](cfg.target, cfg.model, cfg.options)
    await backend.open()
    try:
        if backend.model is None:
            models = await backend.served_models()
            if not models:
                raise ValueError(f"{cfg.target} serves no models")
            backend.model = models[0]
        arrivals = schedule(cfg, samples)
        if cfg.num_warmups:
            await asyncio.gather(*(backend.send(s) for s in samples[:cfg.num_warmups]))
        bar = tqdm(total=len(samples), desc=cfg.label or cfg.backend, disable=not cfg.progress)
        try:
            records, duration = await _drive(backend, samples, arrivals, cfg.max_concurrency, bar)
        finally:
            bar.close()
    finally:
        await backend.close()
    return ServeResult(backend.model, records, duration, summarize(records, duration, cfg.slos), arrivals)


def run_serve(cfg: ServeConfig, samples: list[Sample]) -> ServeResult:
    """`run_serve_async` on a fresh event loop (call it from synchronous code)."""
    return asyncio.run(run_serve_async(cfg, samples))
