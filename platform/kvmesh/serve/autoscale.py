"""Ray Serve autoscaling on kvmesh's own signals: the glue between Ray Serve's custom
autoscaling policy API and the pure policy in `kvmesh.router.autoscale`.

Ray Serve's default policy counts requests that pass through Ray; kvmesh's requests are
gRPC streams from the router to the workers, which Ray never sees. Instead:

1. every worker replica reports custom autoscaling metrics (Ray Serve calls the
   deployment's `record_autoscaling_stats`; `replica_metrics` builds the dict): waiting
   requests, KV usage, the age of its oldest request still waiting for a first token,
   how full its batch ran (slot usage: the mean number of sequences per step over the
   last `LatencyWindow.window_s`, as a fraction of max_num_seqs), how much of that window
   it spent stepping (busy), and the p90 TTFT of the requests whose first token came in the last
   `LatencyWindow.window_s` and p90 TPOT of those that finished in it (engine-side:
   queueing + prefill, decode steps);
2. Ray's controller averages each metric over `look_back_period_s` per replica and calls
   `KvmeshAutoscalingPolicy` (named in the deployment's `autoscaling_config.policy`),
   which folds the replicas into one `ScaleSignals` for the role (prefill replicas answer
   for TTFT, decode for TPOT and KV room, unified for both) and returns
   `desired_replicas` against the config's SLO;
3. Ray applies min / max replicas and the upscale / downscale delays (the hysteresis)
   as it does for its own policy.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvmesh.router.autoscale import SLO, ScalePolicy, ScaleSignals, desired_replicas, pressure

POLICY_IMPORT_PATH = "kvmesh.serve.autoscale:KvmeshAutoscalingPolicy"
QUEUE = "kvmesh_queue_depth"
KV_USAGE = "kvmesh_kv_usage"
TTFT_P90 = "kvmesh_ttft_p90_s"
TPOT_P90 = "kvmesh_tpot_p90_s"
OLDEST_WAIT = "kvmesh_oldest_wait_s"
SLOT_USAGE = "kvmesh_slot_usage"
BUSY = "kvmesh_busy"
_NONE = -1.0  # metric value for "no request finished in the window" (Ray metrics are numbers)


class LatencyWindow:
    """TTFT and TPOT of the requests a worker finished recently (engine-side), and how
    busy its engine was and how full its batch ran over the same window."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._ttft: collections.deque[tuple[float, float]] = collections.deque()
        self._tpot: collections.deque[tuple[float, float]] = collections.deque()
        # (time, engine busy_seconds, engine seq_seconds) readings, for usage()
        self._busy: collections.deque[tuple[float, float, float]] = collections.deque()
        self._lock = threading.Lock()  # the engine's step thread writes, Ray's metrics call reads

    def observe(self, outputs: Iterable[Any]) -> None:
        """Record an engine step's RequestOutputs: a request's TTFT when its first tokens
        arrive (its first output: all its tokens are new), its TPOT = (e2e - ttft) /
        (tokens - 1) when it finishes (metrics hold ttft_s and e2e_s)."""
        now = self._clock()
        for out in outputs:
            if "ttft_s" not in out.metrics or not out.outputs:
                continue
            ttft, tokens = out.metrics["ttft_s"], out.outputs[0].token_ids
            with self._lock:
                if tokens and len(out.outputs[0].delta_token_ids) == len(tokens):
                    self._ttft.append((now, ttft))
                if out.finished and "e2e_s" in out.metrics and len(tokens) > 1:
                    self._tpot.append((now, (out.metrics["e2e_s"] - ttft) / (len(tokens) - 1)))

    def p90(self) -> tuple[float | None, float | None]:
        """(TTFT p90, TPOT p90) over the window; None where nothing finished."""
        cutoff = self._clock() - self.window_s
        out = []
        with self._lock:
            for q in (self._ttft, self._tpot):
                while q and q[0][0] < cutoff:
                    q.popleft()
                out.append(_p90([v for _, v in q]))
        return out[0], out[1]

    def usage(self, busy_seconds: float, seq_seconds: float, max_num_seqs: int) -> tuple[float, float]:
        """(busy, slot usage) over the last `window_s`, from the engine's cumulative
        `busy_seconds` and `seq_seconds` (stats()) read now: the fraction of the window the
        engine spent in steps, and the mean fraction of its `max_num_seqs` batch slots in
        use. Both lead TTFT under a rising load: a batch that runs full leaves each new
        request to wait for a slot, and an engine that steps all the time has no compute
        left for the next prompt, so the queue (and TTFT) grows from there while the
        measured latencies are still within the SLO. (0, 0) until a second reading."""
        now = self._clock()
        with self._lock:
            q = self._busy
            q.append((now, busy_seconds, seq_seconds))
            while len(q) > 2 and q[1][0] <= now - self.window_s:
                q.popleft()  # keep one reading at or before the window's start
            (t0, b0, s0), (t1, b1, s1) = q[0], q[-1]
        if t1 <= t0:
            return 0.0, 0.0
        span = t1 - t0
        slots = (s1 - s0) / (span * max_num_seqs) if max_num_seqs >= 1 else 0.0
        return min(1.0, max(0.0, (b1 - b0) / span)), min(1.0, max(0.0, slots))


def _p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(0.9 * len(s)) - 1))]


def replica_metrics(stats: dict[str, Any], latency: LatencyWindow) -> dict[str, float]:
    """One worker replica's custom autoscaling metrics, from its engine's stats()."""
    ttft, tpot = latency.p90()
    busy, slots = latency.usage(float(stats.get("busy_seconds", 0.0)), float(stats.get("seq_seconds", 0.0)),
                                int(stats.get("max_num_seqs", 0)))
    return {QUEUE: float(stats.get("num_waiting", 0)), KV_USAGE: float(stats.get("kv_usage", 0.0)),
            TTFT_P90: _NONE if ttft is None else ttft, TPOT_P90: _NONE if tpot is None else tpot,
            OLDEST_WAIT: float(stats.get("oldest_wait_s", 0.0)),
            SLOT_USAGE: slots, BUSY: busy}


def role_signals(role: str, replicas: int, metrics: dict[str, dict[Any, float]]) -> ScaleSignals:
    """Fold per-replica metrics (name -> replica -> value, Ray's aggregated_metrics) into
    the role's signals: queues summed, KV usage, slot usage and busy averaged, latency
    (p90s and the oldest wait) the worst replica's."""
    def values(name: str) -> list[float]:
        return list((metrics.get(name) or {}).values())

    kv = values(KV_USAGE)
    ttft = [v for v in values(TTFT_P90) if v >= 0]
    tpot = [v for v in values(TPOT_P90) if v >= 0]
    wait = values(OLDEST_WAIT)
    slots, busy = values(SLOT_USAGE), values(BUSY)
    return ScaleSignals(role, replicas, int(round(sum(values(QUEUE)))), sum(kv) / len(kv) if kv else 0.0,
                        max(ttft) if ttft else None, max(tpot) if tpot else None, max(wait) if wait else None,
                        sum(slots) / len(slots) if slots else None, sum(busy) / len(busy) if busy else None)


class KvmeshAutoscalingPolicy:
    """Ray Serve custom autoscaling policy (a class: Ray builds it once per deployment with
    the policy's `policy_kwargs` and calls it with an AutoscalingContext every tick)."""

    def __init__(self, role: str, ttft_s: float, tpot_s: float, target_queue_per_replica: float = 4.0,
                 kv_usage_high: float = 0.9, slo_headroom: float = 0.8, scale_down_below: float = 0.4,
                 max_growth: float = 2.0, slot_usage_high: float = 0.75, busy_high: float | None = None):
        if role not in ("prefill", "decode", "unified"):
            raise ValueError(f"role must be prefill, decode or unified, got {role!r}")
        self.role = role
        self.slo = SLO(ttft_s, tpot_s)
        self.knobs = dict(target_queue_per_replica=target_queue_per_replica, kv_usage_high=kv_usage_high,
                          slo_headroom=slo_headroom, scale_down_below=scale_down_below, max_growth=max_growth,
                          slot_usage_high=slot_usage_high, busy_high=busy_high)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        replicas = ctx.current_num_replicas
        if replicas == 0:  # nothing reports: start the minimum (Ray's cold start does the rest)
            return ctx.target_num_replicas, {}
        signals = role_signals(self.role, replicas, ctx.aggregated_metrics or {})
        policy = ScalePolicy(min_replicas=ctx.capacity_adjusted_min_replicas,
                             max_replicas=max(ctx.capacity_adjusted_max_replicas, ctx.capacity_adjusted_min_replicas),
                             **self.knobs)
        want = desired_replicas(signals, self.slo, policy)
        if (want == replicas and ctx.target_num_replicas > replicas
                and pressure(signals, self.slo, policy) >= policy.scale_down_below):
            # Holding while a scale-up is still starting keeps it: answering with the
            # running count would cancel the starting replica after the downscale delay,
            # and under a steady load the deployment would flap and never grow.
            want = ctx.target_num_replicas
        return want, {"kvmesh_signals": signals.__dict__, "kvmesh_desired": want}


def policy_config(role: str, slo_ttft_s: float, slo_tpot_s: float, busy_high: float | None = None) -> dict[str, Any]:
    """The `autoscaling_config.policy` entry of a worker deployment."""
    kwargs: dict[str, Any] = {"role": role, "ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s}
    if busy_high is not None:
        kwargs["busy_high"] = busy_high
    return {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": kwargs}
