"""What a simulated run measured: per-request latencies, then summaries (percentiles,
goodput at an SLO, cache hit rate, per-worker load)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvmesh.router.autoscale import SLO


@dataclass
class RequestRecord:
    arrival_s: float
    input_length: int
    output_length: int
    worker: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    rejected: str = ""  # why it was not served ("" = served)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None:
            return None
        return (self.finish_s - self.first_token_s) / max(self.output_length - 1, 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def meets(self, slo: SLO) -> bool:
        return self.finish_s is not None and self.ttft <= slo.ttft_s and self.tpot <= slo.tpot_s


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def pcts(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else math.nan}


@dataclass
class SimResult:
    policy: str
    records: list[RequestRecord]
    duration_s: float  # arrival span of the trace: the goodput denominator
    makespan_s: float
    workers: list[dict]
    worker_seconds: float
    timeline: list[dict] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self, slo: SLO) -> dict:
        done = [r for r in self.records if r.finish_s is not None]
        prompt = sum(r.input_length for r in done)
        meeting = sum(r.meets(slo) for r in self.records)
        return {
            "policy": self.policy,
            "requests": len(self.records), "finished": len(done),
            "rejected": sum(bool(r.rejected) for r in self.records),
            "ttft_s": pcts([r.ttft for r in done]), "tpot_s": pcts([r.tpot for r in done]),
            "e2e_s": pcts([r.e2e for r in done]),
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
            "slo_attainment": meeting / len(self.records) if self.records else math.nan,
            "goodput_rps": meeting / self.duration_s if self.duration_s > 0 else math.nan,
            "throughput_rps": len(done) / self.duration_s if self.duration_s > 0 else math.nan,
            "cache_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
            "duration_s": self.duration_s, "makespan_s": self.makespan_s,
            "worker_seconds": self.worker_seconds, "workers": self.workers,
            "preemptions": sum(w["preemptions"] for w in self.workers), "wall_s": self.wall_s,
        }
