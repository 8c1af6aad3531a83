"""LLMEngine: the synchronous core. step() = schedule -> execute -> update -> outputs.

Requests enter with `add_request` (validated and tokenized here, so bad input fails
before it touches the scheduler), progress one step at a time, and leave when they
stop, hit a limit or are aborted; their KV blocks go back to the pool either way.

At ~400 lines on purpose: request intake, the step with its failure isolation,
speculation policy, output assembly and pinned prompts all drive the same scheduler
and output state; the pin quota's bookkeeping lives in engine/prompt_cache.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvmesh.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.interfaces import KVConnector, KVLoader, ModelExecutor, ModelInfo
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.lora import LoRAHost, LoRAInfo, LoRARequest
from kvmesh.engine.outputs import CompletionOutput, RequestOutput, SchedulerOutput, TokenLogprobs
from kvmesh.engine.prompt_cache import PinnedPrompts
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler, StepResult
from kvmesh.errors import InvalidRequestError, ResourceExhaustedError, StepFailedError

logger = logging.getLogger(__name__)

# Adaptive speculation: below this recent acceptance a request only probes.
SPEC_MIN_ACCEPTANCE = 0.3
SPEC_PROBE_EVERY = 8
# What a pinned prompt runs as: one greedy token, KV held afterwards.
_PIN_PARAMS = SamplingParams(max_tokens=1, temperature=0)


def pin_request_id(name: str) -> str:
    """The request id a pinned prompt is computed (and its blocks held) under."""
    return f"__prompt_cache__:{name}"


def choice_request_id(request_id: str, index: int) -> str:
    """The scheduler's id of choice `index` of an n > 1 request (choice 0 keeps the id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass
class _OutputState:
    """Per-request state of the output side (text, logprobs)."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    token_ids: list[int] = field(default_factory=list)
    original_prompt_tokens: int | None = None  # before compression; None: not compressed
    # n > 1: the request's id (outputs carry it) and this choice's index.
    group_id: str = ""
    index: int = 0
    # With prompt_logprobs: the logprobs of prompt tokens 1.., shared by all the choices
    # (choice 0 computes them); `prompt_logprobs_sent` once this choice delivered them.
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_sent: bool = False


class LLMEngine:
    """Bookkeeping around a model executor: requests in, outputs out.

    Built by `kvmesh.build.build_engine` (which loads the model, sizes the cache and
    wires the executor and KV connectors); constructed directly only with fakes in
    tests. Imports and constructs without torch.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: ModelExecutor,
        tokenizer,
        model: ModelInfo,
        kv_loader: KVLoader | None = None,
        kv_connector: KVConnector | None = None,
    ):
        """`kv_loader` is what the scheduler consults at admission; it defaults to
        `kv_connector` (the shared store) and may wrap it (P/D transfer, telemetry)."""
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.model_info = model
        self.model_path = model.path
        self.fingerprint = model.fingerprint
        self.max_model_len = model.max_model_len
        self.eos_token_id = model.eos_token_id
        self.eos_token_ids = model.eos_token_ids
        cc, sc = config.cache, config.scheduler
        # A draft model's cache shares the target's block ids and catches up from behind the
        # target's window (its first proposal prefills from position 0): keep every block.
        window = model.kv_window if executor.proposer_method != "draft" else None
        self.kv_manager = KVCacheManager(executor.num_blocks, cc.block_size, model.fingerprint,
                                         cc.enable_prefix_caching, sliding_window=window)
        self.kv_connector = kv_connector
        # Multi-LoRA: the worker's adapter store (worker/lora.py), when config.lora is set.
        self.lora: LoRAHost | None = getattr(executor, "lora", None) if config.lora is not None else None
        self.scheduler = Scheduler(self.kv_manager, sc.max_num_seqs, sc.max_num_batched_tokens, model.max_model_len,
                                   kv_loader=kv_loader if kv_loader is not None else kv_connector,
                                   max_loras=self.lora.max_loras if self.lora is not None else None,
                                   max_deferred_decode_steps=sc.max_deferred_decode_steps)
        self._states: dict[str, _OutputState] = {}
        # n > 1: request id -> the scheduler ids of its unfinished choices (abort takes all).
        self._groups: dict[str, list[str]] = {}
        # Outputs of other requests produced while cache_prompt drove the engine.
        self._buffered: list[RequestOutput] = []
        self._pins = PinnedPrompts(self.kv_manager.num_usable_blocks, cc.block_size, model.max_model_len,
                                   cc.max_pinned_fraction)
        self.spec_counters = {"proposed": 0, "accepted": 0, "verify_steps": 0}
        # Seconds spent in steps, and their sum weighted by the sequences in each step: their
        # growth over a window, divided by the window (and max_num_seqs), is how busy the
        # engine was and how full its batch ran (autoscaling signals, serve.autoscale).
        self.busy_seconds = 0.0
        self.seq_seconds = 0.0

    def _propose(self) -> None:
        """Draft tokens for the next step of every request that is decoding."""
        spec = self.config.speculative
        running = self.scheduler.running
        method = self.executor.proposer_method
        if method is None or spec is None or not running or len(running) > spec.max_batch_size:
            return
        k = spec.num_speculative_tokens
        # Adaptive: a request whose recent drafts were mostly rejected stops paying for
        # verification, except for a probe every SPEC_PROBE_EVERY tokens to notice
        # when its text turns predictable again (e.g. starts quoting its input).
        cands = [r for r in running
                 if r.num_computed_tokens == r.num_tokens - 1 and r.sampling_params.can_speculate
                 and r.num_output_tokens < r.sampling_params.max_tokens - 1
                 and (r.spec_acceptance_ema >= SPEC_MIN_ACCEPTANCE or r.num_output_tokens % SPEC_PROBE_EVERY == 0)]
        if method == "draft":
            # The draft writes KV at the k draft positions: reserve the target's slots
            # now (the next schedule needs exactly these for 1 + k tokens anyway).
            cands = [r for r in cands if self.kv_manager.allocate_slots(r, 1 + k) is not None]
        if not cands:
            return
        tables = {r.request_id: self.kv_manager.get_block_ids(r.request_id) for r in cands}
        for rid, token_ids in self.executor.propose(cands, tables, k).items():
            self.scheduler.requests[rid].spec_token_ids = token_ids

    # -- input ------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation under the checkpoint's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        hold_kv: bool = False,
        original_prompt_tokens: int | None = None,
        lora: str | LoRARequest | None = None,
    ) -> str:
        """Validate, tokenize and queue a request; returns its id.

        `prompt` is text or token ids; `prompt_text` labels a pre-tokenized prompt
        with its text in the outputs. With `hold_kv` the request's KV blocks outlive it
        (see RequestOutput.held_block_ids) until `release_kv(request_id)`.
        `original_prompt_tokens`: the prompt was compressed (kvmesh.compress) from this many
        tokens; outputs' metrics then carry it. `lora`: the adapter to run under, by name
        (loaded, or one of config.lora.modules, which is loaded now); None: the base model.
        """
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._states:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else prompt_text
        if prompt is None or (isinstance(prompt, str) and not prompt):
            raise InvalidRequestError("prompt", "must not be empty")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt_ids(ids)
        self.validate_params(params, hold_kv)
        lora_req = self.lora_request(lora)
        if hold_kv:
            self._check_held_fits(len(ids), params.max_tokens)
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        rids = [choice_request_id(request_id, i) for i in range(params.n)]
        if any(r in self._states for r in rids[1:]):
            raise InvalidRequestError("request_id", f"{request_id!r} clashes with a choice of another request")
        reqs = [Request(rid, ids, params.for_choice(i) if params.n > 1 else params, self.eos_token_id, prompt=text,
                        arrival_time=arrival_time, eos_token_ids=self.eos_token_ids, lora=lora_req)
                for i, rid in enumerate(rids)]
        reqs[0].hold_kv = hold_kv
        self.scheduler.add_request(reqs[0], reqs[1:])
        prompt_lps = [] if params.prompt_logprobs is not None else None
        for i, req in enumerate(reqs):
            self._states[req.request_id] = _OutputState(
                req, IncrementalDetokenizer(self.tokenizer, ids, req.sampling_params),
                [] if params.logprobs is not None else None, original_prompt_tokens=original_prompt_tokens,
                group_id=request_id, index=i, prompt_logprobs=prompt_lps,
            )
        if params.n > 1:
            self._groups[request_id] = rids
        return request_id

    # -- LoRA adapters ------------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        return self.lora is not None

    def lora_host(self) -> LoRAHost:
        if self.lora is None:
            raise InvalidRequestError("lora", "this server has LoRA off; start it with --enable-lora (and "
                                              "--lora-modules name=path) to serve adapters")
        return self.lora

    def configured_lora_path(self, name: str) -> str | None:
        """The path of a `--lora-modules` adapter named `name`, else None."""
        lc = self.config.lora
        return next((m.path for m in lc.modules if m.name == name), None) if lc is not None else None

    def lora_request(self, lora: str | LoRARequest | None) -> LoRARequest | None:
        """The adapter a request names, loading a configured (`--lora-modules`) one now."""
        if lora is None or lora == "":
            return None
        name = lora.name if isinstance(lora, LoRARequest) else lora
        host = self.lora_host()
        info = host.get(name)
        if info is None:
            path = self.configured_lora_path(name)
            if path is None:
                known = ", ".join(sorted(i.name for i in host.adapters())) or "none"
                raise InvalidRequestError("lora", f"adapter {name!r} is not loaded (loaded: {known}); load it first "
                                          "(POST /v1/load_lora_adapter, or --lora-modules at start-up)")
            info = self.load_lora(name, path)
        if isinstance(lora, LoRARequest) and lora.key and lora.key != info.key:
            raise InvalidRequestError("lora", f"adapter {name!r} was reloaded with other weights; resend the request")
        host.touch(name)
        return LoRARequest(info.name, info.key)

    def _busy_loras(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for req in list(self.scheduler.requests.values()):  # a snapshot: servers read it off the step thread
            if req.lora is not None:
                counts[req.lora.name] = counts.get(req.lora.name, 0) + 1
        return counts

    def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Read a PEFT adapter folder and hold it under `name` (on this thread; servers use
        AsyncLLMEngine.load_lora, which reads off the step loop). Idempotent for the same
        path; another path under a loaded name replaces it only while nothing runs under it."""
        host = self.lora_host()
        info = host.get(name)
        if info is not None and info.path == path:
            return info
        return self.add_lora(name, path, host.read(name, path))

    def add_lora(self, name: str, path: str, loaded: object) -> LoRAInfo:
        """Hold an adapter `LoRAHost.read` returned (the step-thread half of load_lora)."""
        host = self.lora_host()
        info = host.get(name)
        if info is not None and info.path == path:
            return info
        busy = self._busy_loras()
        if name in busy:
            raise InvalidRequestError("lora_name", f"adapter {name!r} has {busy[name]} request(s) in flight; "
                                      "load the new weights under another name, or retry when they finish")
        return host.add(name, path, loaded, frozenset(busy))

    def unload_lora(self, name: str) -> bool:
        """Drop an adapter (host memory and device slot); False if it was not loaded."""
        host = self.lora_host()
        busy = self._busy_loras()
        if name in busy:
            raise InvalidRequestError("lora_name", f"adapter {name!r} has {busy[name]} request(s) in flight; "
                                      "retry when they finish")
        return host.remove(name)

    def list_loras(self) -> list[LoRAInfo]:
        """Every adapter in host memory, with its waiting and running requests counted."""
        if self.lora is None:
            return []
        busy = self._busy_loras()
        return [replace(i, num_requests=busy.get(i.name, 0)) for i in self.lora.adapters()]

    def validate_params(self, params: SamplingParams, hold_kv: bool = False) -> None:
        """What SamplingParams cannot check alone: limits of this model and engine."""
        vocab = self.model_info.vocab_size
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise InvalidRequestError("logit_bias", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.n > 1 and hold_kv:
            raise InvalidRequestError("n", "n > 1 cannot be prefilled for a KV transfer or a pinned prompt")
        if params.n > self.scheduler.max_num_seqs:
            raise InvalidRequestError("n", f"{params.n} choices exceed this engine's batch of max_num_seqs="
                                           f"{self.scheduler.max_num_seqs}; ask for fewer")

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        check = getattr(self.executor, "check_structured_outputs", None)
        if check is None:
            raise InvalidRequestError("structured_outputs", "not supported by this engine's executor")
        check(params.structured_outputs)

    def _check_held_fits(self, num_prompt: int, max_tokens: int) -> None:
        """A request that holds its KV keeps every block, even past a sliding window (whose
        freeing lets max_model_len exceed the cache): it must fit in the whole cache, or it
        would preempt itself forever."""
        kv = self.kv_manager
        need = -(-min(num_prompt + max_tokens, self.max_model_len) // kv.block_size)
        if kv.sliding_window is not None and need > kv.num_usable_blocks:
            raise ResourceExhaustedError(
                "prompt", f"{num_prompt} tokens (+{max_tokens} to generate) need {need} KV blocks held at "
                f"once for a transfer or pin, more than this worker's {kv.num_usable_blocks}; shorten the "
                "prompt or give the worker more KV cache")

    def validate_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.model_info.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"every token id must be an integer in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {len(ids)} tokens but max_model_len is {self.max_model_len}; the prompt must "
                "leave room for at least one output token: shorten it or raise max_model_len",
            )

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (every choice of an n > 1 request by its id, or one choice by its
        scheduler id)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [c for rid in ids for c in self._groups.pop(rid, [rid])]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._states.pop(rid, None)
            if self.kv_connector is not None:
                self.kv_connector.forget(rid)
            self.executor.forget(rid)

    def executor_health(self) -> tuple[bool, str]:
        """The executor's (healthy, why not): a tensor-parallel group is down once a rank died."""
        check = getattr(self.executor, "health", None)
        return check() if check is not None else (True, "")

    def close(self) -> None:
        """Stop the executor's processes (rank processes of a tensor-parallel group); idempotent."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._buffered)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (vLLM's `reset_prefix_cache`), e.g. between
        benchmark passes; only possible when no request holds blocks. True if done."""
        return self.kv_manager.pool.reset_prefix_cache()

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a hold_kv request kept; False if none are held under the id."""
        return self.kv_manager.release(request_id)

    # -- the step ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that produced tokens."""
        if self._buffered:
            outputs, self._buffered = self._buffered, []
            return outputs
        return self._step_once()

    def _step_once(self) -> list[RequestOutput]:
        """One step. An exception anywhere in it fails only the requests it concerns
        (StepFailedError names them; their blocks are freed) and leaves the engine
        consistent for the next step: one poisoned request cannot stop the others."""
        t0 = time.monotonic()
        self._expire_pins()
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:  # what was admitted is unknown: fail every request
            self._fail(list(self.scheduler.requests), exc)
        try:
            return self._run_scheduled(sched)
        except Exception as exc:
            self._fail([seq.request_id for seq in sched.seqs], exc)
        finally:
            elapsed = time.monotonic() - t0
            self.busy_seconds += elapsed
            self.seq_seconds += len(sched.seqs) * elapsed

    def _fail(self, request_ids: list[str], exc: Exception) -> None:
        """Abort `request_ids` after a failed step (blocks freed, held KV released) and
        raise StepFailedError for them."""
        logger.exception("engine step failed; failing its %d request(s): %s", len(request_ids), request_ids,
                         exc_info=exc)
        # The callers' ids: a failed choice fails its whole request.
        groups = list(dict.fromkeys(self._group_of(rid) for rid in request_ids))
        self.abort(groups + request_ids)
        for rid in request_ids:
            self.kv_manager.release(rid)  # finished (hold_kv) within the failed step
        raise StepFailedError(groups, exc) from exc

    def _group_of(self, rid: str) -> str:
        state = self._states.get(rid)
        return rid if state is None else state.group_id

    def _run_scheduled(self, sched: SchedulerOutput) -> list[RequestOutput]:
        runner_out = self.executor.execute(sched)
        results = self.scheduler.update_from_output(sched, runner_out)
        for seq in sched.seqs:
            if seq.spec_token_ids and seq.request_id in runner_out.sampled_token_ids:
                self.spec_counters["proposed"] += len(seq.spec_token_ids)
                self.spec_counters["accepted"] += len(runner_out.sampled_token_ids[seq.request_id]) - 1
                self.spec_counters["verify_steps"] += 1
        for res in results:  # draft state and grammar matchers go now, not at the next step
            if res.finished and (self.executor.proposer_method is not None
                                 or res.request.sampling_params.structured_outputs is not None):
                self.executor.forget(res.request.request_id)
        if self.executor.proposer_method is not None:
            self._propose()
        if self.kv_connector is not None and sched.seqs:
            live = dict(self.scheduler.requests)
            live.update((r.request.request_id, r.request) for r in results)
            self.kv_connector.save_after_step(sched, live)
        for rid, plp in runner_out.prompt_logprobs.items():
            state = self._states.get(rid)
            if state is not None and state.prompt_logprobs is not None:
                # Entries hold prompt tokens 1..; a recompute after preemption repeats some: kept once.
                have = len(state.prompt_logprobs)
                if plp.start <= have + 1:
                    state.prompt_logprobs.extend(plp.items[have + 1 - plp.start:])
        now = time.monotonic()
        outputs = []
        for res in results:
            state = self._states.get(res.request.request_id)
            if state is None:
                continue
            lp = runner_out.logprobs.get(res.request.request_id)
            if state.logprobs is not None and lp is not None:
                state.logprobs.append(lp)
            outputs.append(self._make_output(state, res, now))
        return outputs

    def _make_output(self, state: _OutputState, res: StepResult, now: float) -> RequestOutput:
        req = state.request
        if req.first_token_time is None:
            req.first_token_time = now
        finished = res.finished
        delta, stop_hit = state.detok.update(res.new_token_ids, finished)
        if stop_hit and not finished:
            self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = state.detok.stop_string
            finished = True
        state.token_ids.extend(res.new_token_ids)
        metrics = {"ttft_s": req.first_token_time - req.arrival_time}
        if state.original_prompt_tokens is not None:
            metrics["original_prompt_tokens"] = state.original_prompt_tokens
        if finished:
            self._states.pop(req.request_id, None)
            self._choice_done(state)
            metrics["e2e_s"] = now - req.arrival_time
        prompt_lps = None
        lps = state.prompt_logprobs
        if lps is not None and not state.prompt_logprobs_sent and len(lps) == req.num_prompt_tokens - 1:
            prompt_lps = [None, *lps]
            state.prompt_logprobs_sent = True
        completion = CompletionOutput(
            index=state.index,
            text=state.detok.text,
            token_ids=list(state.token_ids),
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            delta_text=delta,
            delta_token_ids=list(res.new_token_ids),
        )
        return RequestOutput(
            state.group_id, req.prompt, req.prompt_token_ids, [completion], finished,
            num_cached_tokens=max(req.num_cached_tokens, 0), metrics=metrics,
            held_block_ids=req.held_block_ids if finished else None,
            index=state.index, prompt_logprobs=prompt_lps,
        )

    def _choice_done(self, state: _OutputState) -> None:
        """Forget a finished choice of an n > 1 request; the request once all are."""
        rids = self._groups.get(state.group_id)
        if rids is not None and state.request.request_id in rids:
            rids.remove(state.request.request_id)
            if not rids:
                del self._groups[state.group_id]

    # -- prompt cache -------------------------------------------------------

    def cache_prompt(self, name: str, prompt: str | list[int], ttl_s: float | None = None) -> int:
        """Compute a prompt's KV once and pin it: its blocks stay referenced locally (never
        evicted; every request starting with this prompt hits them) and its full blocks
        are written to the KV store without TTL. Returns the number of pinned tokens.

        A pin over the quota (see engine/prompt_cache.py) raises ResourceExhaustedError at
        once. Drives the engine until the prompt is computed; other requests progress too
        and their outputs are returned by the next `step()` calls. Servers use
        AsyncLLMEngine.cache_prompt instead, which never blocks their event loop.
        """
        rid, ids = self.begin_pin(name, prompt)
        final = None
        try:
            while final is None:
                for out in self._step_once():
                    if out.request_id == rid:
                        final = out if out.finished else None
                    else:
                        self._buffered.append(out)
                req = self.scheduler.requests.get(rid)
                if final is None and req is not None and not self.scheduler.running:
                    # Nothing runs and the pin was not admitted: its blocks are held elsewhere
                    # (transfers); refuse rather than spin.
                    self.abort(rid)
                    raise ResourceExhaustedError("prompt_cache", "no free KV blocks to compute the prompt now "
                                                                 "(held by KV transfers); retry later")
        except BaseException:
            self.cancel_pin(name)
            raise
        return self.finish_pin(name, final, ttl_s)

    def begin_pin(self, name: str, prompt: str | list[int]) -> tuple[str, list[int]]:
        """Validate a pin, release an older pin of the same name, and reserve its blocks
        under the quota (ResourceExhaustedError when it does not fit). The caller then
        runs request `rid` on `ids` with `_PIN_PARAMS` and hold_kv, and ends with
        `finish_pin` (or `cancel_pin` on failure). Returns (rid, ids)."""
        if not name:
            raise InvalidRequestError("name", "prompt cache entries need a non-empty name")
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt_ids(ids)
        self.uncache_prompt(name)
        self._pins.reserve(name, len(ids))
        rid = pin_request_id(name)
        try:
            self.add_request(rid, ids, _PIN_PARAMS, hold_kv=True)
        except BaseException:
            self._pins.unreserve(name)
            raise
        return rid, ids

    def finish_pin(self, name: str, final: RequestOutput, ttl_s: float | None) -> int:
        """Commit a computed pin (the finished output of begin_pin's request)."""
        ids = final.prompt_token_ids
        keys = [] if self.kv_connector is None else self.kv_connector.pin_prompt(ids, final.held_block_ids)
        self._pins.commit(name, final.request_id, keys, ttl_s)
        return len(ids) // self.kv_manager.block_size * self.kv_manager.block_size

    def cancel_pin(self, name: str) -> None:
        """Undo begin_pin: drop the reservation and any blocks the pin request holds."""
        rid = pin_request_id(name)
        self.abort(rid)
        self.kv_manager.release(rid)
        self._pins.unreserve(name)

    def uncache_prompt(self, name: str) -> bool:
        """Release a pinned prompt: local blocks become evictable, store keys get a TTL."""
        pin = self._pins.pop(name)
        if pin is None:
            return False
        self.kv_manager.release(pin.hold_id)
        if self.kv_connector is not None and pin.keys:
            self.kv_connector.unpin(pin.keys)
        return True

    def _expire_pins(self) -> None:
        for name in self._pins.expired(time.monotonic()):
            self.uncache_prompt(name)

    @property
    def pinned_prompts(self) -> list[str]:
        return list(self._pins.pins)

    # -- introspection ----------------------------------------------------

    def _spec_stats(self) -> dict[str, float]:
        if self.executor.proposer_method is None:
            return {}
        c = self.spec_counters
        return {
            "spec_method": self.executor.proposer_method,
            "spec_proposed_tokens": c["proposed"],
            "spec_accepted_tokens": c["accepted"],
            "spec_acceptance_rate": c["accepted"] / c["proposed"] if c["proposed"] else 0.0,
            # tokens emitted per verification step (accepted drafts + 1)
            "spec_mean_accepted_length": (c["accepted"] + c["verify_steps"]) / c["verify_steps"]
            if c["verify_steps"] else 0.0,
        }

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.kv_manager.num_usable_blocks

    def stats(self) -> dict[str, float]:
        kv = self.kv_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "oldest_wait_s": self.scheduler.oldest_wait_s(time.monotonic()),
            "busy_seconds": self.busy_seconds,
            "seq_seconds": self.seq_seconds,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "num_free_blocks": kv.num_free_blocks,
            "num_usable_blocks": kv.num_usable_blocks,
            "kv_usage": kv.usage(),
            "prefix_query_tokens": kv.query_tokens,
            "prefix_hit_tokens": kv.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_pinned_prompts": len(self._pins.pins),
            "num_pinned_blocks": self._pins.num_blocks,
            **self._spec_stats(),
            **(self.kv_connector.stats() if self.kv_connector is not None else {}),
        }
