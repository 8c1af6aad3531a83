"""Iteration-level scheduler: chunked prefill mixed with decodes, preemption by recompute.

There is no prefill or decode phase. Each step, every running request is given the
tokens it still needs (num_tokens - num_computed_tokens; 1 for a decode), capped by
a per-step token budget, so long prompts are computed in chunks alongside other
requests' decodes. Waiting requests are admitted FIFO while the budget, the
max-running cap and free KV blocks last. When a running request cannot grow, the
newest running request is preempted: its blocks are freed and it rejoins the front of
the waiting queue to be recomputed (the prefix cache usually makes that cheap).

Parallel sampling (n > 1): choice 0 runs as an ordinary request; choices 1.. wait
(WAITING_FOR_FORK) until the step that computes choice 0's prompt has run, then fork its
full prompt blocks (KVCacheManager.fork: shared by reference count, with or without prefix
caching) and join the running list having only the prompt's last partial block left to
compute. Choice 0 is admitted only when the batch has room for all n, so the forks never
exceed max_num_seqs. After the fork each choice is an ordinary request: preempted, it
frees its own references and recomputes like any other.

Multi-LoRA (`max_loras`): the running requests use at most that many distinct adapters
(the device slots one step can batch; base-model requests use none). A waiting request
whose adapter would be one too many is passed over, keeping its place, and the requests
behind it are admitted as usual; it runs once an adapter's requests drain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvmesh.engine.interfaces import KVLoader
from kvmesh.engine.kv_cache_manager import KVCacheManager, blocks_per_request
from kvmesh.engine.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from kvmesh.engine.request import Request, RequestStatus


@dataclass
class StepResult:
    """What one step did to one request, for the output processor."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        kv_loader: KVLoader | None = None,
        max_loras: int | None = None,
        max_deferred_decode_steps: int = 0,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        kv = kv_cache_manager
        need = blocks_per_request(max_model_len, kv.block_size, kv.sliding_window, max_num_batched_tokens)
        if need > kv.num_usable_blocks:
            # Otherwise one long request could preempt itself forever (livelock).
            raise ValueError(
                f"the KV cache holds {kv.num_usable_blocks} blocks of {kv.block_size} tokens, less than the "
                f"{need} one request of max_model_len={max_model_len} needs"
            )
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        # Choice 0's id -> the choices waiting to fork its prompt blocks (n > 1).
        self._forks: dict[str, list[Request]] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # KV computed elsewhere (shared store, prefill worker), consulted at admission.
        self.kv_loader = kv_loader
        self.max_loras = max_loras
        # Prefill-first steps (see schedule()): how many steps in a row the running decodes
        # may sit out while prompt chunks run, and how many they have sat out so far.
        if max_deferred_decode_steps < 0:
            raise ValueError("max_deferred_decode_steps must be >= 0")
        self.max_deferred_decode_steps = max_deferred_decode_steps
        self._decode_deferrals = 0

    # -- queue management -------------------------------------------------

    def add_request(self, request: Request, forks: list[Request] | tuple[Request, ...] = ()) -> None:
        """Queue `request`; `forks` are the other choices of an n > 1 request, which fork
        its prompt blocks once it has computed them."""
        for req in (request, *forks):
            if req.request_id in self.requests:
                raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if not forks:
            return
        if len(forks) + 1 > self.max_num_seqs:
            raise ValueError(f"{len(forks) + 1} choices never fit a batch of max_num_seqs={self.max_num_seqs}")
        share = self.kv.fork_point(request.num_prompt_tokens) > 0
        for child in forks:
            self.requests[child.request_id] = child
            child.parent_id = request.request_id
            if share:
                child.status = RequestStatus.WAITING_FOR_FORK
            else:  # a prompt shorter than a block plus one token: nothing to share
                self.waiting.append(child)
        if share:
            self._forks[request.request_id] = list(forks)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Finish (e.g. abort, or stop on a stop string) requests wherever they are."""
        assert status.finished
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_FORK:
                self._forks[req.parent_id].remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        # Choices still waiting for this one's prompt KV (it failed or was aborted alone)
        # compute their own prompts instead.
        for child in self._forks.pop(req.request_id, ()):
            child.status = RequestStatus.WAITING
            self.waiting.append(child)
        req.status = status
        if req.hold_kv and status != RequestStatus.FINISHED_ABORTED:
            req.held_block_ids = self.kv.hold(req)
        else:
            self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def oldest_wait_s(self, now: float) -> float:
        """How long the longest-waiting request without a first token has waited (0 when
        none): its TTFT will be at least this, so it leads the measured TTFT, which a
        request reports only once its first token exists."""
        return max((now - r.arrival_time for r in self.waiting if not r.output_token_ids), default=0.0)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _seats_needed(self, req: Request) -> int:
        """Batch seats admitting `req` takes: itself and its pending forks."""
        return 1 + len(self._forks.get(req.request_id, ()))

    def _seats_reserved(self) -> int:
        """Seats promised to the pending forks of running choices."""
        return sum(len(c) for pid, c in self._forks.items() if self.requests[pid].status == RequestStatus.RUNNING)

    def _fork(self, parent: Request) -> None:
        """Choices waiting on `parent` share its computed prompt blocks and start running."""
        for child in self._forks.pop(parent.request_id, ()):
            shared = self.kv.fork(parent, child)
            child.num_computed_tokens = shared
            if child.num_cached_tokens < 0:
                child.num_cached_tokens = shared
            child.status = RequestStatus.RUNNING
            self.running.append(child)

    # -- scheduling -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step's work, within the token budget and max_num_seqs.

        Two ways to fill a step (`max_deferred_decode_steps`):
        - mixed (0, vLLM's policy): every running decode gets its token, and prompt chunks
          (unfinished chunked prompts first, then new requests in arrival order) take the
          rest of the budget;
        - prefill-first (> 0, SGLang's default): while there is prompt work, a step runs
          prompt chunks only, with the whole budget, and the decodes wait, for at most
          that many steps in a row. A new request's first token then pays for no decode
          rows, and requests that arrive meanwhile wait for a shorter step; the streams
          pay one short decode step per prompt instead. When no prompt chunk can be
          scheduled (no seat, no KV blocks) the decodes run at once.
        """
        defer = self._decode_deferrals < self.max_deferred_decode_steps
        scheduled, preempted = self._plan(defer_decodes=defer)
        if defer and not scheduled:  # no prompt work could run: the decodes go now
            scheduled, more = self._plan(defer_decodes=False)
            preempted += more
        if self.max_deferred_decode_steps:  # mixed steps (0) keep no count: no extra pass per step
            picked = {id(req) for req, _, _ in scheduled}
            left_out = any(id(r) not in picked and r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
            self._decode_deferrals = self._decode_deferrals + 1 if left_out else 0
        return self._output(scheduled, preempted)

    def _plan(self, defer_decodes: bool) -> tuple[list[tuple[Request, int, list[int]]], list[Request]]:
        """(request, tokens to compute, draft tokens) per scheduled request, and the
        requests preempted to make room. `defer_decodes`: leave out running requests that
        compute one token (decodes), for prompt chunks only."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int, list[int]]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if defer_decodes and num_new == 1:
                i += 1  # its drafts (if any) stay for the step it runs in
                continue
            spec: list[int] = []
            if num_new == 1 and req.spec_token_ids:
                # Drafts ride along with the decode token; never past the budget, the
                # context limit, or the request's remaining max_tokens.
                room = min(budget - 1, self.max_model_len - req.num_tokens,
                           req.sampling_params.max_tokens - req.num_output_tokens - 1)
                spec = req.spec_token_ids[: max(room, 0)]
            req.spec_token_ids = []
            num_new = min(num_new + len(spec), budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new, spec))
                budget -= num_new
                i += 1
                continue
            break  # `req` itself was preempted: nothing after it can grow either

        # Admitting while preempting would just thrash.
        if not preempted:
            adapters = {r.lora_name for r in self.running if r.lora is not None}
            idx = 0  # waiting[:idx] were passed over (their adapter would exceed max_loras)
            while idx < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[idx]
                if (self.max_loras is not None and req.lora is not None and req.lora_name not in adapters
                        and len(adapters) >= self.max_loras):
                    idx += 1
                    continue
                if len(self.running) + self._seats_reserved() + self._seats_needed(req) > self.max_num_seqs:
                    break
                prefix = self.kv.get_computed_blocks(req)
                # Loaded KV costs no compute budget; at least one token is always left
                # to compute so the step produces logits. Prompt logprobs need every position.
                num_ext = 0
                if self.kv_loader is not None and req.sampling_params.prompt_logprobs is None:
                    num_ext = min(self.kv_loader.lookup(req, prefix.num_tokens),
                                  req.num_tokens - 1 - prefix.num_tokens)
                num_new = min(req.num_tokens - prefix.num_tokens - num_ext, budget)
                if self.kv.allocate_slots(req, num_ext + num_new, prefix) is None:
                    break
                if num_ext:
                    got = self.kv_loader.load(req, self.kv.get_block_ids(req.request_id),
                                              prefix.num_tokens, num_ext)
                    if got < num_ext:  # fault mid-load: compute the rest ourselves
                        num_new = min(num_new + num_ext - got, budget)
                        num_ext = got
                del self.waiting[idx]
                if req.lora is not None:
                    adapters.add(req.lora_name)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = prefix.num_tokens + num_ext
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = prefix.num_tokens + num_ext
                scheduled.append((req, num_new, []))
                budget -= num_new
        return scheduled, preempted

    def _output(self, scheduled: list[tuple[Request, int, list[int]]], preempted: list[Request]) -> SchedulerOutput:
        seqs = []
        for req, n, spec in scheduled:
            start = req.num_computed_tokens
            real = n - len(spec)
            seqs.append(
                ScheduledSeq(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids[start : start + real] + spec,
                    start_pos=start,
                    block_ids=self.kv.get_block_ids(req.request_id),
                    sample=start + real == req.num_tokens,
                    sampling_params=req.sampling_params,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    spec_token_ids=spec,
                    lora_name=req.lora_name,
                    banned_token_ids=_min_tokens_ban(req) if start + real == req.num_tokens else (),
                )
            )
            # Tokens count as computed once scheduled; the step that runs them is
            # the next thing to happen, and a request is never scheduled twice a step.
            req.num_computed_tokens = start + n

        out = SchedulerOutput(
            seqs=seqs,
            finished_req_ids=self._finished_ids,
            preempted_req_ids=[r.request_id for r in preempted],
        )
        self._finished_ids = set()
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- results ----------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[StepResult]:
        results = []
        for seq in sched.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            if req.request_id in self._forks and req.num_computed_tokens >= self.kv.fork_point(req.num_prompt_tokens):
                self._fork(req)  # its shared prompt blocks are computed now
            tokens = runner_out.sampled_token_ids.get(seq.request_id)
            if tokens is None:
                continue  # a prefill chunk that does not reach the end of the prompt
            if seq.spec_token_ids:
                # Roll back the slots of rejected drafts: their KV is garbage and will be
                # overwritten. Accepted drafts = all new tokens but the last.
                accepted = len(tokens) - 1
                req.num_computed_tokens -= len(seq.spec_token_ids) - accepted
                req.num_spec_proposed += len(seq.spec_token_ids)
                req.num_spec_accepted += accepted
                req.spec_acceptance_ema = 0.6 * req.spec_acceptance_ema + 0.4 * accepted / len(seq.spec_token_ids)
            new, status = [], None
            for token in tokens:
                req.append_output_token(token)
                new.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            results.append(StepResult(req, new, status is not None))
        return results

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        # Under min_tokens EOS and stop tokens are banned from sampling (_min_tokens_ban), so
        # the checks below cannot end a request early.
        params = req.sampling_params
        if not params.ignore_eos and token in req.eos_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _min_tokens_ban(req: Request) -> tuple[int, ...]:
    """The ids the request's next token must not be: EOS (unless ignore_eos) and its stop
    tokens while it has fewer than min_tokens output tokens (vLLM's min_tokens)."""
    params = req.sampling_params
    if req.num_output_tokens >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else sorted(req.eos_ids)
    return tuple(dict.fromkeys((*eos, *params.stop_token_ids)))
