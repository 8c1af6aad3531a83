"""The fleet on a simulated clock: requests arrive from a trace, a router replica's real
plugins pick a worker (sim.routers), workers step their real schedulers, Stats polls refresh the
router's view (load, sampled hashes, KV events), an optional autoscaler adds and
retires replicas.

Events are processed in time order (a heap); at equal times step completions come
first, then arrivals, then polls and scaling ticks. The run is deterministic: no wall
clock; round-robin and tie rotation are counters, a random router spread is seeded.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.router.autoscale import Autoscaler, ScaleSignals
from kvmesh.router.plugins import RouteRequest, WorkerScheduler
from kvmesh.sim.metrics import RequestRecord, SimResult, percentile
from kvmesh.sim.profile import StepProfile
from kvmesh.sim.routers import RouterTier, Spread
from kvmesh.sim.trace import TRACE_BLOCK_SIZE, TraceRequest, block_hashes
from kvmesh.sim.worker import FastForward, SimHandle, SimWorker

_STEP, _FF, _ARRIVAL, _READY, _POLL, _SCALE = range(6)


@dataclass
class FleetConfig:
    """A simulated fleet. The KV block size is the trace's (512 tokens a hash id): the
    trace says nothing finer about sharing."""

    num_workers: int = 16
    profile: StepProfile | None = None
    kv_capacity_tokens: int | None = None  # per worker; None: the profile's
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    stats_interval_s: float = 0.5  # RouterConfig.stats_interval_s
    # The router's approximate view, scaled to 512-token blocks from its defaults at block
    # size 16 (same tokens covered): max_block_hashes 4096 -> 128, affinity_capacity 65536 -> 2048.
    reported_hashes: int = 128
    affinity_capacity: int = 2048
    kv_events: bool = True
    # Router replicas, each with its own approximate index (sim.routers), and how the load
    # balancer in front spreads requests over them.
    num_routers: int = 1
    router_spread: Spread = "round_robin"
    startup_s: float = 30.0  # a scaled-up replica serves after this long
    scale_interval_s: float = 5.0
    fingerprint: str = "kvmesh-sim"
    fast_forward: bool = True  # apply runs of identical decode steps at once (same results, faster)

    @property
    def block_size(self) -> int:
        return TRACE_BLOCK_SIZE


class Fleet:
    def __init__(self, cfg: FleetConfig, policy: WorkerScheduler | Sequence[WorkerScheduler], policy_name: str = "",
                 autoscaler: Autoscaler | None = None):
        """`policy`: one WorkerScheduler per router replica (`cfg.num_routers` of them; a
        single one when there is one router)."""
        if cfg.profile is None:
            raise ValueError("FleetConfig.profile is required (a GPU_PROFILES entry or a calibrated profile)")
        policies = [policy] if isinstance(policy, WorkerScheduler) else list(policy)
        if len(policies) != cfg.num_routers:
            raise ValueError(f"FleetConfig.num_routers is {cfg.num_routers} but {len(policies)} WorkerScheduler(s) "
                             "were given: pass one per router replica (each keeps its own state)")
        self.cfg = cfg
        self.routers = RouterTier(policies, cfg.affinity_capacity, cfg.router_spread)
        self.policy_name = policy_name
        self.autoscaler = autoscaler
        capacity = cfg.kv_capacity_tokens or cfg.profile.kv_capacity_tokens
        self.num_blocks = capacity // cfg.block_size + 1  # + the null block
        self.max_model_len = (self.num_blocks - 1) * cfg.block_size
        self.workers: list[SimWorker] = []
        self._heap: list[tuple[float, int, int, object]] = []
        self._order = 0
        self.now = 0.0
        self._records: list[RequestRecord] = []
        self._rec_by_id: dict[str, RequestRecord] = {}
        self._routed_by: dict[str, SimHandle] = {}  # in flight: the handle of the replica that routed it
        self._recent_first: list[tuple[float, float]] = []  # (time, ttft) in the scaling window
        self._recent_tpot: list[tuple[float, float]] = []
        self.timeline: list[dict] = []
        self._arrivals_in_window = 0

    # -- plumbing -------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: object = None) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, kind, self._order, obj))

    def _add_worker(self, ready_at: float) -> SimWorker:
        c = self.cfg
        w = SimWorker(len(self.workers), "unified", self.num_blocks, c.block_size, c.profile, c.max_num_seqs,
                      c.max_num_batched_tokens, self.max_model_len, c.fingerprint, started_at=self.now)
        w.ready_at = ready_at
        self.workers.append(w)
        self.routers.add_worker(w)
        self.routers.poll(w, c.reported_hashes, c.kv_events)
        return w

    def _serving(self) -> list[SimWorker]:
        return [w for w in self.workers if w.stopped_at is None and not w.retiring and w.ready_at <= self.now]

    def _kick(self, w: SimWorker) -> None:
        if w.busy:
            return
        if self.cfg.fast_forward:
            k, ctx = w.plan_fast_forward()
            if k >= 2:
                self._order += 1
                w.ff = FastForward(self.now, k, w.scheduler.num_running, ctx, self._order)
                self._push(w.ff.end(w.profile), _FF, (w, w.ff.version))
                return
        dt = w.start_step()
        if dt is not None:
            self._push(self.now + dt, _STEP, w)

    def _interrupt(self, w: SimWorker) -> None:
        """A request joined a worker in a decode run: the run stops after the step in progress
        (the next schedule admits the newcomer), as it would step by step."""
        ff, profile = w.ff, w.profile
        done = 0
        while done < ff.steps and ff.end(profile, done + 1) <= self.now:
            done += 1
        if done + 1 < ff.steps:
            self._order += 1
            ff.steps, ff.version = done + 1, self._order
            self._push(ff.end(profile), _FF, (w, ff.version))

    def _ff_done(self, w: SimWorker, version: int) -> None:
        ff = w.ff
        if ff is None or ff.version != version:
            return  # superseded by an interrupt
        w.ff = None
        w.busy_s += self.now - ff.start
        w.fast_forward(ff.steps)
        self._kick(w)
        if w.retiring and not w.busy and not w.scheduler.has_unfinished():
            w.stopped_at = self.now

    # -- events ---------------------------------------------------------------------

    def _arrive(self, i: int, tr: TraceRequest) -> None:
        c = self.cfg
        rec = RequestRecord(tr.arrival_s, tr.input_length, tr.output_length)
        self._records.append(rec)
        self._arrivals_in_window += 1
        if tr.input_length + tr.output_length > self.max_model_len:
            rec.rejected = "longer than a worker's KV cache"
            return
        rid = f"r{i}"
        prompt = [0] * tr.input_length
        hashes = block_hashes(tr.hash_ids[: tr.input_length // c.block_size], c.fingerprint)
        handle = self.routers.route(RouteRequest(rid, prompt, hashes, c.block_size), self._serving())
        if handle is None:
            rec.rejected = "no serving worker"
            return
        req = Request(rid, prompt, SamplingParams(max_tokens=tr.output_length, ignore_eos=True),
                      arrival_time=tr.arrival_s)
        req.block_hashes = hashes
        w = handle.worker
        rec.worker = w.index
        self._rec_by_id[rid] = rec
        self._routed_by[rid] = handle
        w.add(req)
        if w.ff is not None:
            self._interrupt(w)
        self._kick(w)

    def _step_done(self, w: SimWorker) -> None:
        for res in w.finish_step():
            rec = self._rec_by_id[res.request.request_id]
            if rec.first_token_s is None:
                rec.first_token_s = self.now
                rec.cached_tokens = max(res.request.num_cached_tokens, 0)
                self._recent_first.append((self.now, rec.ttft))
            if res.finished:
                rec.finish_s = self.now
                self._routed_by.pop(res.request.request_id).in_flight -= 1
                del self._rec_by_id[res.request.request_id]
                self._recent_tpot.append((self.now, rec.tpot))
        self._kick(w)
        if w.retiring and not w.busy and not w.scheduler.has_unfinished():
            w.stopped_at = self.now

    def _scale(self) -> None:
        live = [w for w in self.workers if w.stopped_at is None and not w.retiring]
        window = self.cfg.scale_interval_s * 6
        self._recent_first = [x for x in self._recent_first if x[0] >= self.now - window]
        self._recent_tpot = [x for x in self._recent_tpot if x[0] >= self.now - window]
        ttft = percentile([x[1] for x in self._recent_first], 90) if self._recent_first else None
        tpot = percentile([x[1] for x in self._recent_tpot], 90) if self._recent_tpot else None
        usage = sum(w.kv.usage() for w in live) / max(len(live), 1)
        wait = max((w.scheduler.oldest_wait_s(self.now) for w in live), default=0.0)
        sig = ScaleSignals("unified", len(live), sum(w.scheduler.num_waiting for w in live), usage, ttft, tpot, wait)
        want = self.autoscaler.decide(sig, self.now)
        for _ in range(want - len(live)):
            w = self._add_worker(self.now + self.cfg.startup_s)
            self._push(w.ready_at, _READY, w)
        if want < len(live):
            # Retire the least loaded (its cache is the least useful and it drains soonest).
            for w in sorted(live, key=lambda w: (w.load(), -w.index))[: len(live) - want]:
                w.retiring = True
                if not w.busy and not w.scheduler.has_unfinished():
                    w.stopped_at = self.now
        self.timeline.append({"t": self.now, "replicas": want, "serving": len(self._serving()),
                              "arrival_rps": self._arrivals_in_window / self.cfg.scale_interval_s,
                              "queue_depth": sig.queue_depth, "kv_usage": usage, "ttft_p90_s": ttft,
                              "tpot_p90_s": tpot})
        self._arrivals_in_window = 0

    # -- run ------------------------------------------------------------------------

    def run(self, trace: list[TraceRequest]) -> SimResult:
        t0 = time.perf_counter()
        c = self.cfg
        for _ in range(c.num_workers):
            self._add_worker(0.0)
        for i, tr in enumerate(trace):
            self._push(tr.arrival_s, _ARRIVAL, (i, tr))
        last_arrival = trace[-1].arrival_s if trace else 0.0
        self._push(c.stats_interval_s, _POLL)
        if self.autoscaler is not None:
            self._push(c.scale_interval_s, _SCALE)
        while self._heap:
            self.now, kind, _, obj = heapq.heappop(self._heap)
            if kind == _STEP:
                self._step_done(obj)
            elif kind == _FF:
                self._ff_done(*obj)
            elif kind == _ARRIVAL:
                self._arrive(*obj)
            elif kind == _READY:
                pass  # _serving() includes it from now on
            else:
                if not self._rec_by_id and self.now > last_arrival:
                    continue  # drained: stop the periodic events
                if kind == _POLL:
                    for w in self.workers:
                        if w.stopped_at is None:
                            self.routers.poll(w, c.reported_hashes, c.kv_events)
                    self._push(self.now + c.stats_interval_s, _POLL)
                else:
                    self._scale()
                    self._push(self.now + c.scale_interval_s, _SCALE)
        end = self.now
        workers = [{
            "worker": w.index, "requests": w.num_requests, "busy_fraction": w.busy_s / max(end - w.started_at, 1e-9),
            "prefill_tokens": w.prefill_tokens, "steps": w.num_steps,
            "preemptions": w.scheduler.num_preemptions,
            "hit_rate": w.kv.hit_tokens / w.kv.query_tokens if w.kv.query_tokens else 0.0,
        } for w in self.workers]
        worker_s = sum((w.stopped_at if w.stopped_at is not None else end) - w.started_at for w in self.workers)
        return SimResult(self.policy_name, self._records, last_arrival, end, workers, worker_s, self.timeline,
                         time.perf_counter() - t0)


def simulate(trace: list[TraceRequest], cfg: FleetConfig, policy: WorkerScheduler | Sequence[WorkerScheduler],
             policy_name: str = "",
             autoscaler: Autoscaler | None = None) -> SimResult:
    """One run of `trace` on a fresh fleet."""
    return Fleet(cfg, policy, policy_name, autoscaler).run(trace)
