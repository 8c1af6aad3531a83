"""The router's per-request telemetry: latency histograms, finish counters, the
`kvmesh.router.generate` span, and the scorers' scores of picked workers.

Per streamed message the cost is one perf_counter() and three histogram observes (kvmesh's
inter-token latency and vLLM's two names of it, telemetry/vllm.py); the label lookups
happen once per request. Each value is observed into kvmesh's histogram and its vllm:
twin at the same line, so the two never disagree on counts or sums.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any

from kvmesh.telemetry import metrics as m
from kvmesh.telemetry import tracing
from kvmesh.telemetry import vllm as v
from kvmesh.telemetry.workers import worker_label

if TYPE_CHECKING:
    from kvmesh.router.plugins import WorkerScheduler
    from kvmesh.router.registry import WorkerHandle


def mode_of(path: str) -> str:
    """Metric label of a RouteDecision.path: pd, or unified for a direct request."""
    return "pd" if path == "pd" else "unified"


@functools.lru_cache(maxsize=1024)
def _child(metric: Any, *labels: str) -> Any:
    """A labelled series, looked up once: labels() takes a lock and hashes the labels."""
    return metric.labels(*labels)


class RequestTelemetry:
    """Context manager around one Generate at the router.

    `metadata` is what outgoing worker calls carry (W3C traceparent under the router
    span), None when tracing is off. Call `routed(decision)` once the route is
    decided, `on_message(...)` per message streamed to the client."""

    def __init__(self, model: str, request_id: str, metadata: tuple[tuple[str, str], ...] = ()):
        self.model = model
        self.request_id = request_id
        self.caller_metadata = metadata  # the caller's trace context, if it sent one
        self.decision = None  # kvmesh.router.api.RouteDecision
        self.prompt_tokens = self.cached_prompt_tokens = 0
        self.num_tokens = 0
        self.finish_reason = ""
        self.span = None
        self.metadata: tuple[tuple[str, str], ...] | None = None
        self._start = self._first = self._last = 0.0
        self._itl = None
        self._span_cm = None

    @property
    def mode(self) -> str:
        return mode_of(self.decision.path) if self.decision is not None else "unified"

    def __enter__(self) -> "RequestTelemetry":
        self._start = time.perf_counter()
        _child(m.REQUESTS_WAITING, self.model).inc()
        self._span_cm = tracing.server_span("kvmesh.router.generate", self.caller_metadata,
                                            {"kvmesh.request_id": self.request_id})
        self.span = self._span_cm.__enter__()
        self.metadata = tracing.grpc_metadata(self.span)
        return self

    def routed(self, decision) -> None:
        self.decision = decision
        self.prompt_tokens = decision.prompt_tokens
        _child(m.DECISIONS, mode_of(decision.path)).inc()

    def on_message(self, num_tokens: int, finish_reason: str, cached_prompt_tokens: int | None) -> None:
        if num_tokens:
            now = time.perf_counter()
            if self._itl is None:
                self._first = now
                ttft = now - self._start
                _child(m.TTFT, self.model, self.mode).observe(ttft)
                _child(v.TTFT, self.model).observe(ttft)
                _child(m.REQUESTS_WAITING, self.model).dec()
                _child(m.REQUESTS_RUNNING, self.model).inc()
                self._itl = (_child(m.ITL, self.model, self.mode), _child(v.ITL, self.model),
                             _child(v.TPOT, self.model))
            else:
                gap = now - self._last
                for h in self._itl:
                    h.observe(gap)
            self._last = now
            self.num_tokens += num_tokens
        if finish_reason:
            self.finish_reason = finish_reason
            self.cached_prompt_tokens = cached_prompt_tokens or 0

    def __exit__(self, typ, exc, tb) -> bool:
        now = time.perf_counter()
        model, mode = self.model, self.mode
        reason = self.finish_reason or ("abort" if typ is not None and issubclass(
            typ, (asyncio.CancelledError, GeneratorExit)) else "error")
        _child(m.REQUESTS_RUNNING if self._itl is not None else m.REQUESTS_WAITING, model).dec()
        e2e = now - self._start
        _child(m.E2E, model, mode).observe(e2e)
        _child(v.E2E, model).observe(e2e)
        if self.num_tokens > 1:
            tpot = (self._last - self._first) / (self.num_tokens - 1)
            _child(m.TPOT, model, mode).observe(tpot)
            _child(v.REQUEST_TPOT, model).observe(tpot)
        _child(m.FINISHED, model, mode, reason).inc()
        _child(m.PROMPT_TOKENS, model, mode).inc(self.prompt_tokens)
        _child(m.CACHED_PROMPT_TOKENS, model, mode).inc(self.cached_prompt_tokens)
        _child(m.GENERATION_TOKENS, model, mode).inc(self.num_tokens)
        if self.span is not None:
            d = self.decision
            tracing.set_attributes(self.span, {
                "kvmesh.mode": mode, "kvmesh.prompt_tokens": self.prompt_tokens,
                "kvmesh.completion_tokens": self.num_tokens, "kvmesh.finish_reason": reason,
                "kvmesh.cached_prompt_tokens": self.cached_prompt_tokens,
                "kvmesh.prefill_worker": d.prefill if d is not None else "",
                "kvmesh.decode_workers": ",".join(d.decode) if d is not None else "",
            })
        return bool(self._span_cm.__exit__(typ, exc, tb))


class _RecordingScorer:
    """A scorer that remembers its last scores (scoring is synchronous, so `last` is
    the call that led to the pick that follows it)."""

    def __init__(self, inner, name: str):
        self.inner = inner
        self.name = name
        self.last: tuple[list, list[float]] = ([], [])

    def score(self, req, workers):
        scores = self.inner.score(req, workers)
        self.last = (workers, scores)
        return scores


class ScoreRecorder:
    """Observes, per pick, each scorer's score of the picked worker (no scoring twice)."""

    def __init__(self, scheduler: WorkerScheduler, names: list[str]):
        self._scorers = [_RecordingScorer(s, n) for (s, _), n in zip(scheduler.scorers, names)]
        scheduler.scorers = [(r, w) for r, (_, w) in zip(self._scorers, scheduler.scorers)]

    def observe(self, stage: str, worker: WorkerHandle) -> None:
        _child(m.PICKS, stage, worker_label(worker.address, worker.role)).inc()
        for rec in self._scorers:
            workers, scores = rec.last
            for w, s in zip(workers, scores):
                if w is worker:
                    _child(m.SCORER_SCORE, rec.name, stage).observe(min(max(s, 0.0), 1.0))
                    break


def retried(stage: str) -> None:
    _child(m.RETRIES, stage).inc()
