"""The router's Python API: one request's path through the workers, as typed calls.

`RouterAPI` is what both front ends call: the gRPC servicer (router/service.py) and the
OpenAI HTTP layer (serve/openai, on the router's event loop). A call takes the request
message and a `Call` (the caller's metadata and deadline), yields `GenerateResponse`s,
and fails with a typed `KVMeshError` (InvalidRequestError naming the field,
RateLimitedError with its retry delay, UnavailableError, NotFoundError, or StatusError
for the rest), never by aborting a transport context; each front end renders that
error its own way (a gRPC status with google.rpc details, an OpenAI error body).
The request and response types are the `kvmesh.v1` messages: one typed schema for
gRPC, HTTP and the workers, rather than a second set of Python classes to keep in step.

P/D path: Prefill on a prefill worker (first token, KV held under a transfer id) ->
the first token goes to the client at once -> Decode on a decode worker, which pulls
the KV and streams the rest. Direct path: Generate on one decode / unified worker.

Failures: a phase whose worker is unreachable or fails (UNAVAILABLE, INTERNAL) is
retried on another worker, and a broken token stream *resumes* elsewhere: the new worker gets the
prompt plus every token already sent, so greedy output is unchanged. Client cancel
and deadlines propagate: worker calls carry the remaining deadline and are cancelled
with the client's call (the workers then abort and free the blocks). A request that
made POISON_STRIKES workers fail (died under it, or INTERNAL) is quarantined: it is not
retried again, so one poisoned request cannot walk through the whole fleet.

The router detokenizes the combined token stream itself, so text and stop strings
are right across the prefill/decode (or retry) boundary.

LoRA (router/lora.py): `model` names the base model or an adapter; an adapter's requests
carry its `LoRARef` (name and path) to every worker call, score by `lora_affinity`, and
hash their blocks with the adapter's content key. `load_lora_adapter`,
`unload_lora_adapter` and `sync_adapters` change the served adapters at run time.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kvmesh._proto import llm_pb2, worker_pb2
from kvmesh.compress.proto import compress_request
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.hashing import block_hashes
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError, NotFoundError, RateLimitedError, UnavailableError
from kvmesh.router.config import RouterConfig
from kvmesh.router.lora import LoRAAdapters
from kvmesh.router.plugins import RouteRequest, WorkerScheduler
from kvmesh.router.ratelimit import RateLimitConfig, RateLimiter
from kvmesh.router.registry import WorkerHandle, WorkerPool
from kvmesh.rpc import (
    StatusError,
    check_token_ids,
    params_from_proto,
    params_to_proto,
    prompt_cache_id,
    prompt_from_request,
)
from kvmesh.rpc.auth import ApiKeys, metadata_value, tenant_salt
from kvmesh.rpc.status import error_of_rpc
from kvmesh.telemetry.router import RequestTelemetry, ScoreRecorder, retried

logger = logging.getLogger(__name__)

# Worker faults: retried on another worker (a refused connection is no strike).
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
POISON_STRIKES = 2


@dataclass
class RouteDecision:
    """Where one request went (kept for tests and debugging, sent as trailing metadata)."""

    request_id: str
    path: str  # "pd" | "direct"
    prefill: str = ""
    decode: list[str] = field(default_factory=list)  # more than one after a retry
    prompt_tokens: int = 0
    prefix_blocks: dict[str, int] = field(default_factory=dict)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("kvmesh-route", self.path), ("kvmesh-prefill", self.prefill),
                ("kvmesh-decode", ",".join(self.decode)))


class Call:
    """One caller's call, as data: its metadata (API key, W3C trace context) and deadline.
    The router sets `decision` once the request is routed (the gRPC servicer sends it
    as trailing metadata)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), timeout_s: float | None = None):
        self.metadata = tuple(metadata)
        self._deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        self.decision: RouteDecision | None = None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def header(self, key: str) -> str | None:
        return metadata_value(self.metadata, key)


@dataclass
class _Transfer:
    """KV held on a prefill worker for this request."""

    resp: worker_pb2.PrefillResponse
    pulled: bool = False  # the decode worker answered, so it has pulled (or recomputed)


class _Choice:
    """One choice of a request's stream (n > 1 has several): its detokenizer, stop
    strings and the tokens sent so far."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        self.tokens: list[int] = []
        self.cached_prompt_tokens: int | None = None
        self.finished = False


class _Stream:
    """The client-facing stream of one request: router-side detokenization, stop
    strings, and the tokens sent so far (what a retry resumes from), per choice."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer,
                 telemetry: RequestTelemetry, cache_salt: str = "", lora: llm_pb2.LoRARef | None = None):
        self.request_id = request_id
        self.lora = lora  # the adapter, sent to every worker call (None: the base model)
        self.cache_salt = cache_salt  # effective (tenant-scoped) salt, sent to every worker call
        self.telemetry = telemetry
        self.prompt_ids = prompt_ids
        self.params = params
        self.choices = [_Choice(prompt_ids, params, tokenizer) for _ in range(params.n)]
        self.original_prompt_tokens = 0  # before compression; 0: not compressed
        self.worker_failures = 0  # workers that failed while serving this request

    @property
    def tokens(self) -> list[int]:
        """The first choice's tokens (the only choice on the paths that resume or disaggregate)."""
        return self.choices[0].tokens

    @property
    def sent_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def emit(self, msg: llm_pb2.GenerateResponse) -> llm_pb2.GenerateResponse:
        if not 0 <= msg.index < len(self.choices):
            raise StatusError(grpc.StatusCode.INTERNAL, f"a worker sent choice {msg.index} of a request with "
                                                        f"n={len(self.choices)}")
        c = self.choices[msg.index]
        if c.cached_prompt_tokens is None and msg.HasField("usage"):
            c.cached_prompt_tokens = msg.usage.cached_prompt_tokens
        c.tokens.extend(msg.token_ids)
        done = bool(msg.finish_reason) or len(c.tokens) >= self.params.max_tokens
        delta, stop_hit = c.detok.update(list(msg.token_ids), done)
        out = llm_pb2.GenerateResponse(request_id=self.request_id, text=delta, token_ids=msg.token_ids,
                                       logprobs=msg.logprobs, prompt_logprobs=msg.prompt_logprobs, index=msg.index)
        if stop_hit:
            out.finish_reason, out.stop_reason = "stop", c.detok.stop_string or ""
        elif done:
            out.finish_reason = msg.finish_reason or "length"
            out.stop_reason = msg.stop_reason
        if out.finish_reason:
            c.finished = True
            out.usage.CopyFrom(llm_pb2.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(c.tokens),
                                             cached_prompt_tokens=c.cached_prompt_tokens or 0,
                                             original_prompt_tokens=self.original_prompt_tokens))
        self.telemetry.on_message(len(out.token_ids), out.finish_reason if self.finished else "",
                                  c.cached_prompt_tokens)
        return out

    def resume_request(self) -> llm_pb2.GenerateRequest:
        """Generate request that continues after the tokens already sent. Choices that
        have diverged cannot be resumed as one request: an n > 1 request is retried
        only while none of its tokens were sent."""
        proto = params_to_proto(self.params)
        if self.sent_tokens and len(self.choices) > 1:
            raise UnavailableError(f"request {self.request_id}: its worker failed after {self.sent_tokens} tokens "
                                   f"of its {len(self.choices)} choices were sent, and parallel choices cannot "
                                   "resume elsewhere; retry the request")
        if self.tokens:
            proto.max_tokens = self.params.max_tokens - len(self.tokens)
            proto.min_tokens = max(self.params.min_tokens - len(self.tokens), 0)
            proto.ClearField("prompt_logprobs")  # already sent with the first token; the new prompt is longer
        return llm_pb2.GenerateRequest(request_id=self.request_id, prompt_token_ids=self.prompt_ids + self.tokens,
                                       params=proto, cache_salt=self.cache_salt, lora=self.lora)


class RouterAPI:
    """The router's calls (see the module docstring); `decisions` keeps the recent routes."""

    def __init__(self, pool: WorkerPool, config: RouterConfig, tokenizer, model_id: str,
                 keys: ApiKeys | None = None, limiter: RateLimiter | None = None,
                 adapters: list[tuple[str, str]] | tuple = ()):
        self.pool = pool
        self.keys = keys or ApiKeys()  # tenants: cache salt and rate-limit bucket per API key
        self.limiter = limiter or RateLimiter(RateLimitConfig())
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.scheduler = WorkerScheduler.from_config(config)
        self.scores = ScoreRecorder(self.scheduler, [s.name for s in config.scorers])
        # LoRA adapters served (name -> path: the engine config's lora.modules, then run-time loads).
        self.loras = LoRAAdapters(pool, self.scheduler, model_id, adapters)
        self.decisions: deque[RouteDecision] = deque(maxlen=1024)
        self._background: set[asyncio.Task] = set()

    # -- request preparation --------------------------------------------------

    async def _encode(self, text: str, field: str = "prompt") -> list[int]:
        """Tokenize off the event loop (a huge prompt must not stall every other stream),
        after the size limit."""
        if len(text) > self.config.max_prompt_chars:
            raise InvalidRequestError(field, f"has {len(text)} characters, over the router's limit of "
                                             f"{self.config.max_prompt_chars} (max_prompt_chars); shorten it")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=True)

    async def _prompt_ids(self, request: llm_pb2.GenerateRequest) -> list[int]:
        prompt = prompt_from_request(request)
        ids = await self._encode(prompt) if isinstance(prompt, str) else prompt
        limits = [w.stats.max_model_len for w in self.pool.handles() if w.stats is not None]
        if limits and len(ids) >= min(limits):
            raise InvalidRequestError("prompt", f"has {len(ids)} tokens but max_model_len is {min(limits)}; "
                                                "shorten it to leave room for at least one output token")
        return ids

    def _route_request(self, rid: str, ids: list[int], cache_salt: str = "",
                       lora: llm_pb2.LoRARef | None = None) -> RouteRequest:
        if self.pool.fingerprint is None:
            raise UnavailableError("no worker has answered yet; retry shortly")
        # An adapter's KV is its own: its blocks hash under its content key, as the workers' do.
        key = self.loras.key_of(lora.name) if lora is not None else ""
        hashes = block_hashes(ids, self.pool.block_size, self.pool.fingerprint, cache_salt=cache_salt, lora_key=key)
        return RouteRequest(rid, ids, hashes, self.pool.block_size, lora=lora.name if lora is not None else None)

    def _pick(self, req: RouteRequest, stage: str) -> WorkerHandle | None:
        req.stage = stage
        worker = self.scheduler.pick(req, self.pool.handles())
        if worker is not None:
            self.scores.observe(stage, worker)
            if req.lora is not None:
                worker.note_lora(req.lora)  # it holds the adapter once this request loaded it there
        return worker

    def _failed(self, worker: WorkerHandle, req: RouteRequest, exc: grpc.aio.AioRpcError,
                stream: _Stream) -> None:
        """A worker failed this request: skip it, or quarantine the request when it has
        now made POISON_STRIKES workers fail."""
        worker.mark_unhealthy(self.config.unhealthy_cooldown_s)
        req.exclude.add(worker.address)
        refused = exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower()
        if not refused:
            stream.worker_failures += 1
        if stream.worker_failures >= POISON_STRIKES:
            logger.error("request %s made %d workers fail (last %s: %s %s); quarantined, not retried",
                         req.request_id, stream.worker_failures, worker.address, exc.code().name, exc.details())
            raise StatusError(grpc.StatusCode.INTERNAL,
                              f"request {req.request_id} failed on {stream.worker_failures} workers and is not "
                              "retried again (quarantined); check its parameters, or report it if it is valid")
        logger.warning("worker %s failed request %s (%s: %s); trying another",
                       worker.address, req.request_id, exc.code().name, exc.details())
        retried(req.stage)

    def _tenant(self, call: Call) -> str | None:
        """The caller's tenant (API key id); None when the API is open."""
        if not self.keys.enabled:
            return None
        return self.keys.tenant_of(call.header("authorization"))

    async def _admit(self, tenant: str | None, tokens: int) -> None:
        """Charge the tenant's rate-limit buckets, or refuse with how long to wait."""
        decision = await self.limiter.check(tenant, tokens)
        if decision.allowed:
            return
        if decision.impossible:
            raise InvalidRequestError("max_tokens", decision.impossible)
        raise RateLimitedError(f"rate limit exceeded for this API key; retry after {decision.retry_after_s:.0f} s",
                               decision.retry_after_s)

    # -- calls ------------------------------------------------------------------

    async def generate(self, request: llm_pb2.GenerateRequest, call: Call) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """Stream the request's outputs; fails with a typed KVMeshError. Closing the stream
        cancels the worker calls (the workers then abort and free the blocks)."""
        rid = request.request_id or uuid.uuid4().hex
        with RequestTelemetry(self.model_id, rid, call.metadata) as tel:
            params = params_from_proto(request.params)
            lora = self.loras.resolve(request.model, request.lora if request.HasField("lora") else None)
            request, compression = await compress_request(request, self.tokenizer)
            ids = await self._prompt_ids(request)
            tenant = self._tenant(call)
            salt = tenant_salt(tenant, request.cache_salt)
            await self._admit(tenant, len(ids) + params.max_tokens * params.n)
            route = self._route_request(rid, ids, salt, lora)
            stream = _Stream(rid, ids, params, self.tokenizer, tel, salt, lora)
            if compression is not None:
                stream.original_prompt_tokens = compression.original_prompt_tokens
            try:
                async for msg in self._generate(route, stream, call):
                    yield msg
            finally:
                await self.limiter.refund(tenant, params.max_tokens * params.n - stream.sent_tokens)

    async def _generate(self, route: RouteRequest, stream: _Stream, call: Call
                        ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        # Parallel choices and prompt logprobs run where the prompt is computed (the P/D
        # RPCs carry one choice and no prompt logprobs).
        one_stage = stream.params.n > 1 or stream.params.prompt_logprobs is not None
        use_pd = not one_stage and self.scheduler.use_pd(route, self.pool.handles())
        decision = RouteDecision(route.request_id, "pd" if use_pd else "direct",
                                 prompt_tokens=len(route.prompt_token_ids),
                                 prefix_blocks={w.address: w.prefix_blocks(route.block_hashes)
                                                for w in self.pool.handles()})
        self.decisions.append(decision)
        call.decision = decision
        stream.telemetry.routed(decision)
        transfer: _Transfer | None = None
        try:
            if use_pd:
                resp = await self._prefill(route, stream, decision, call)
                if resp is not None:
                    if resp.transfer_id:
                        transfer = _Transfer(resp)
                    yield stream.emit(resp.first)
                    if stream.finished:
                        return
                else:
                    decision.path = "direct"  # every prefill worker failed: prefill in place
            async for msg in self._decode(route, stream, transfer, decision, call):
                yield msg
        finally:
            if transfer is not None and not transfer.pulled:
                self._release_later(transfer.resp)

    async def _prefill(self, route: RouteRequest, stream: _Stream, decision: RouteDecision,
                       call: Call) -> worker_pb2.PrefillResponse | None:
        req = worker_pb2.PrefillRequest(request_id=route.request_id, prompt_token_ids=route.prompt_token_ids,
                                        params=params_to_proto(stream.params), cache_salt=stream.cache_salt,
                                        lora=stream.lora)
        for _ in range(self.config.max_attempts):
            worker = self._pick(route, "prefill")
            if worker is None:
                return None
            decision.prefill = worker.address
            worker.in_flight += 1
            worker.remember(route.block_hashes)
            try:
                return await worker.stub.Prefill(req, timeout=call.time_remaining(),
                                                 metadata=stream.telemetry.metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise error_of_rpc(exc) from None
                self._failed(worker, route, exc, stream)
            finally:
                worker.in_flight -= 1
        return None

    async def _decode(self, route: RouteRequest, stream: _Stream, transfer: _Transfer | None,
                      decision: RouteDecision, call: Call) -> AsyncIterator[llm_pb2.GenerateResponse]:
        route.exclude.clear()  # a prefill failure says nothing about decode candidates
        for attempt in range(self.config.max_attempts):
            worker = self._pick(route, "decode")
            if worker is None:
                break
            decision.decode.append(worker.address)
            if attempt == 0 and transfer is not None:
                t = transfer.resp
                rpc = worker.stub.Decode(worker_pb2.DecodeRequest(
                    request_id=route.request_id, prompt_token_ids=route.prompt_token_ids,
                    first_token_id=stream.tokens[0], params=params_to_proto(stream.params),
                    transfer_id=t.transfer_id, source_address=t.source_address,
                    model_fingerprint=t.model_fingerprint, cache_salt=stream.cache_salt, lora=stream.lora),
                    timeout=call.time_remaining(),
                    metadata=stream.telemetry.metadata)
            else:
                rpc = worker.stub.Generate(stream.resume_request(), timeout=call.time_remaining(),
                                            metadata=stream.telemetry.metadata)
            worker.in_flight += 1
            worker.remember(route.block_hashes)
            try:
                async for msg in rpc:
                    if transfer is not None:
                        transfer.pulled = True
                    yield stream.emit(msg)
                    if stream.finished:
                        return
                raise StatusError(grpc.StatusCode.INTERNAL, f"worker {worker.address} ended the stream early")
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise error_of_rpc(exc) from None
                self._failed(worker, route, exc, stream)
            finally:
                worker.in_flight -= 1
                rpc.cancel()  # no-op when complete; otherwise the worker aborts and frees blocks
        raise UnavailableError(f"no healthy worker could serve request {route.request_id} "
                               f"(tried: {', '.join(decision.decode) or 'none available'}); retry later")

    def _release_later(self, transfer: worker_pb2.PrefillResponse) -> None:
        """Tell the prefill worker to drop KV nobody will pull (fire and forget; its
        TTL is the backstop)."""
        worker = self.pool.workers.get(transfer.source_address)
        if worker is None:
            return

        async def release() -> None:
            try:
                await worker.stub.ReleaseKV(worker_pb2.ReleaseKVRequest(transfer_id=transfer.transfer_id),
                                            timeout=self.config.stats_timeout_s)
            except grpc.aio.AioRpcError as exc:
                logger.info("ReleaseKV of %s failed (%s); its TTL will free it", transfer.transfer_id,
                            exc.code().name)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def tokenize(self, text: str, model: str = "") -> list[int]:
        self.loras.resolve(model)  # the base model or an adapter (same tokenizer); else NOT_FOUND
        return await self._encode(text, "text")

    def list_models(self) -> llm_pb2.ListModelsResponse:
        """The base model, then every LoRA adapter served (`parent`: the base model, `root`: its path)."""
        limits = [w.stats.max_model_len for w in self.pool.handles() if w.stats is not None]
        base = llm_pb2.ModelInfo(id=self.model_id, max_model_len=min(limits, default=0),
                                 block_size=self.pool.block_size or 0, fingerprint=self.pool.fingerprint or "")
        return llm_pb2.ListModelsResponse(models=self.loras.model_infos(base))

    # -- LoRA adapters ---------------------------------------------------------------

    async def load_lora_adapter(self, request: llm_pb2.LoadLoRAAdapterRequest,
                                call: Call) -> llm_pb2.LoadLoRAAdapterResponse:
        """Load an adapter on at least one worker (one per P/D stage) and serve it by name."""
        return await self.loras.load(request.lora_name, request.lora_path, call.time_remaining())

    async def unload_lora_adapter(self, name: str, call: Call) -> None:
        """Stop serving an adapter and unload it from every worker (NOT_FOUND if unknown)."""
        await self.loras.unload(name, call.time_remaining())

    async def sync_adapters(self, adapters: list[tuple[str, str]]) -> None:
        """Make the served adapters equal to `adapters` ((name, path) pairs): removed ones
        are unloaded from every worker, new ones load on first use (the operator's
        reconcile, RouterDeployment.reconfigure)."""
        await self.loras.sync(list(adapters))

    async def cache_prompt(self, request: llm_pb2.CachePromptRequest, call: Call) -> llm_pb2.CachePromptResponse:
        """Pin the prompt on every worker, so any of them serves it without recompute."""
        ids = check_token_ids(list(request.prompt_token_ids)) or (
            await self._encode(request.prompt) if request.prompt else [])
        if not ids:
            raise InvalidRequestError("prompt", "give the prompt text or prompt_token_ids to cache")
        fwd = llm_pb2.CachePromptRequest(prompt_token_ids=ids, ttl_seconds=request.ttl_seconds,
                                         name=request.name or prompt_cache_id(ids))
        workers = self.pool.handles()
        if not workers:
            raise UnavailableError("no workers registered; retry shortly")
        try:
            replies = await asyncio.gather(*(w.stub.CachePrompt(fwd, timeout=call.time_remaining())
                                             for w in workers))
        except grpc.aio.AioRpcError as exc:
            raise error_of_rpc(exc, prefix="worker: ") from None
        return llm_pb2.CachePromptResponse(cache_id=fwd.name, num_tokens=min(r.num_tokens for r in replies))

    async def uncache_prompt(self, cache_id: str, call: Call) -> None:
        if not cache_id:
            raise InvalidRequestError("cache_id", "required (from CachePrompt)")
        request = llm_pb2.UncachePromptRequest(cache_id=cache_id)
        results = await asyncio.gather(*(w.stub.UncachePrompt(request, timeout=call.time_remaining())
                                         for w in self.pool.handles()), return_exceptions=True)
        if not any(not isinstance(r, BaseException) for r in results):
            raise NotFoundError("cache_id", f"cache_id {cache_id!r} is not cached")


__all__ = ["Call", "RouteDecision", "RouterAPI"]
