"""Replica counts from kvmesh's own signals: queue depth, KV usage, batch slot usage,
the engine's busy fraction (where the policy asks for it), measured TTFT / TPOT and the age of the oldest request still waiting for its first token
against SLO targets, decided per role (prefill replicas answer for TTFT, decode
replicas for TPOT and KV room, unified ones for both).

Ray Serve's default policy counts requests that pass through Ray; kvmesh's requests
are gRPC streams from the router to the workers, so that counter does not see load.
`desired_replicas` is a pure function of a `ScaleSignals` snapshot (the router's worker
registry and Stats have every input), and `Autoscaler` adds the hysteresis (a decision
must hold for a delay before it is acted on). The simulator drives it on traces
(kvmesh.sim.fleet); a Serve custom policy or the router can drive it the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SLO:
    """Latency targets, as p90 over a recent window."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


@dataclass(frozen=True)
class ScaleSignals:
    """One role's state over the last window."""

    role: str  # prefill | decode | unified
    replicas: int  # serving or starting
    queue_depth: int  # waiting requests, summed over the replicas
    kv_usage: float  # mean fraction of KV blocks in use, 0..1
    ttft_p90_s: float | None = None  # None: no first token in the window
    tpot_p90_s: float | None = None
    # Age of the longest-waiting request that has no first token yet (the worst replica's):
    # a lower bound on its TTFT, known before that TTFT is measured. Under a sudden load
    # step it crosses the SLO seconds before the measured p90 does.
    oldest_wait_s: float | None = None
    # Mean fraction of the replicas' batch slots (max_num_seqs) in use over the window; None:
    # not reported. A batch that runs full queues every new request, so this leads TTFT
    # under a rising load by the seconds a replica needs to start.
    slot_usage: float | None = None
    # Mean fraction of the window the replicas spent in engine steps; None: not reported.
    busy: float | None = None


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int = 1
    max_replicas: int = 16
    target_queue_per_replica: float = 4.0
    kv_usage_high: float = 0.9
    slo_headroom: float = 0.8  # aim p90 at this fraction of the SLO
    scale_down_below: float = 0.4  # every pressure under this: one replica fewer
    max_growth: float = 2.0  # at most this factor up per decision
    slot_usage_high: float = 0.75  # mean batch fullness at which to add a replica
    # Mean busy fraction at which to add a replica; None (the default): busy is not a
    # signal. For replicas whose steps are compute-bound at small batches (CPU): they run
    # out of compute before their batch slots fill. A large-batch GPU engine steps
    # whenever any request runs, so busy says little there.
    busy_high: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")


def pressure(s: ScaleSignals, slo: SLO, policy: ScalePolicy) -> float:
    """How far over target the role runs: 1.0 = at target, 2.0 = twice."""
    terms = [s.queue_depth / (policy.target_queue_per_replica * max(s.replicas, 1))]
    if s.slot_usage is not None:
        terms.append(s.slot_usage / policy.slot_usage_high)
    if s.busy is not None and policy.busy_high is not None:
        terms.append(s.busy / policy.busy_high)
    if s.role in ("decode", "unified"):
        terms.append(s.kv_usage / policy.kv_usage_high)
        if s.tpot_p90_s is not None:
            terms.append(s.tpot_p90_s / (slo.tpot_s * policy.slo_headroom))
    if s.role in ("prefill", "unified"):
        for ttft in (s.ttft_p90_s, s.oldest_wait_s):
            if ttft is not None:
                terms.append(ttft / (slo.ttft_s * policy.slo_headroom))
    return max(terms)


def desired_replicas(s: ScaleSignals, slo: SLO, policy: ScalePolicy) -> int:
    """Replicas the role should have: grow in proportion to the pressure, shrink one at a time."""
    p = pressure(s, slo, policy)
    n = max(s.replicas, 1)
    if p > 1.0:
        want = math.ceil(n * min(p, policy.max_growth))
    elif p < policy.scale_down_below:
        want = s.replicas - 1
    else:
        want = s.replicas
    return min(max(want, policy.min_replicas), policy.max_replicas)


@dataclass
class Autoscaler:
    """`desired_replicas` with hysteresis: act on a change only after it held for the delay."""

    slo: SLO
    policy: ScalePolicy
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    _since: dict[str, tuple[int, float]] = field(default_factory=dict)  # role -> (direction, since)

    def decide(self, s: ScaleSignals, now: float) -> int:
        want = desired_replicas(s, self.slo, self.policy)
        direction = (want > s.replicas) - (want < s.replicas)
        if direction == 0:
            self._since.pop(s.role, None)
            return s.replicas
        prev = self._since.get(s.role)
        if prev is None or prev[0] != direction:
            self._since[s.role] = (direction, now)
            prev = self._since[s.role]
        delay = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        if now - prev[1] >= delay:
            self._since.pop(s.role, None)
            return want
        return s.replicas
