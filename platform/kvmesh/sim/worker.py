"""One simulated worker: kvmesh's real Scheduler, KVCacheManager (prefix cache) and
KV event log, stepped on a simulated clock with a StepProfile for the step time. Each
router replica sees it through a real `router.registry.WorkerHandle` (a `SimHandle`: it
builds no channel until its stub is used) whose stats, reported hashes and exact KV
index simulated Stats polls refresh (sim.routers), so the plugins read exactly what
they read in the router.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.kv_events import KVEventLog
from kvmesh.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmesh.engine.request import Request
from kvmesh.engine.scheduler import Scheduler, StepResult
from kvmesh.router.registry import WorkerHandle
from kvmesh.sim.profile import StepProfile


@dataclass
class FastForward:
    """A run of `steps` identical decode steps of `num_seqs` sequences starting at `start`
    with `context` tokens in the first (each later step reads num_seqs more)."""

    start: float
    steps: int
    num_seqs: int
    context: int
    version: int

    def end(self, profile: StepProfile, steps: int | None = None) -> float:
        k, n = self.steps if steps is None else steps, self.num_seqs
        # sum over j < k of decode_time(n, context + j * n)
        return (self.start + k * profile.decode_time(n, self.context)
                + profile.decode_ctx_s * n * k * (k - 1) / 2)


@dataclass
class SimStats:
    """The StatsResponse fields the router plugins read."""

    role: str
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_usable_blocks: int = 1


class SimHandle(WorkerHandle):
    """A router replica's handle on a simulated worker (and, for the oracle, the worker itself)."""

    def __init__(self, worker: SimWorker, affinity_capacity: int):
        super().__init__(worker.address, affinity_capacity)
        self.worker = worker


class SimWorker:
    def __init__(self, index: int, role: str, num_blocks: int, block_size: int, profile: StepProfile,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, fingerprint: str,
                 started_at: float = 0.0):
        self.index = index
        self.address = f"sim-{index:03d}:0"
        self.role = role
        self.profile = profile
        self.kv = KVCacheManager(num_blocks, block_size, fingerprint)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.events = KVEventLog(self.kv.pool, epoch=index + 1)
        self.step: SchedulerOutput | None = None  # the step in flight
        self.ff: FastForward | None = None  # or the decode run in flight
        self.started_at = started_at
        self.ready_at = started_at  # accepts requests from then on (scale-up startup)
        self.retiring = False  # scale-down: takes no new requests, leaves when idle
        self.stopped_at: float | None = None
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_requests = 0
        self.prefill_tokens = 0  # computed (uncached) prompt tokens

    @property
    def busy(self) -> bool:
        return self.step is not None or self.ff is not None

    def add(self, request: Request) -> None:
        self.num_requests += 1
        self.scheduler.add_request(request)

    def start_step(self) -> float | None:
        """Schedule a step; returns its duration, or None when there is nothing to run."""
        if not self.scheduler.has_unfinished():
            return None
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        self.step = sched
        dt = self.profile.step_time(sched)
        self.busy_s += dt
        self.num_steps += 1
        return dt

    def finish_step(self) -> list[StepResult]:
        """The step in flight has run: every sampling sequence gets one (dummy) token."""
        sched, self.step = self.step, None
        sampled = {}
        for seq in sched.seqs:
            if seq.sample:
                sampled[seq.request_id] = [0]
            if len(seq.token_ids) > 1:
                self.prefill_tokens += len(seq.token_ids)
        return self.scheduler.update_from_output(sched, ModelRunnerOutput(sampled))

    # -- decode fast-forward ------------------------------------------------------------
    #
    # Most steps of a fleet are decode-only steps that change nothing but each running
    # request's length: no admission (nothing waits), no block allocated or cached, no
    # request finished. Such a run of steps is applied in one go; the first step that
    # would do any of those things runs through the real scheduler again. Tests check the
    # records equal step-by-step simulation exactly.

    def plan_fast_forward(self) -> tuple[int, int]:
        """(steps, context tokens of the first) that the scheduler would run as identical
        decode-only steps from here; steps 0 when it would not."""
        s, bs = self.scheduler, self.kv.block_size
        if s.waiting or not s.running or len(s.running) > s.max_num_batched_tokens:
            return 0, 0
        k, ctx = 1 << 30, 0
        for r in s.running:
            t, p = r.num_tokens, r.sampling_params
            if t - r.num_computed_tokens != 1 or r.spec_token_ids or p.stop_token_ids or not p.ignore_eos:
                return 0, 0
            held = len(self.kv.req_blocks[r.request_id]) * bs
            # Steps before one that fills a block (caches it), needs a block, or finishes the request.
            k = min(k, held - t, p.max_tokens - r.num_output_tokens - 1, s.max_model_len - t - 1)
            ctx += t
        return max(k, 0), ctx

    def fast_forward(self, k: int) -> None:
        """Apply `k` planned decode steps (each request gains k dummy tokens, all computed
        but the last, as after k real steps)."""
        pad = [0] * k
        for r in self.scheduler.running:
            r.output_token_ids.extend(pad)  # keeps all_token_ids == prompt + output
            r.all_token_ids.extend(pad)
            r.num_computed_tokens += k
        self.num_steps += k

    def load(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running
