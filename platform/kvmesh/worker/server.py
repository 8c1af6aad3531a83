"""The worker's gRPC server (`kvmesh.v1.Worker`): an AsyncLLMEngine behind Generate,
Prefill, Decode, PullKV, Stats and LoadLoRA / UnloadLoRA, plus standard health checking
and reflection.

LoRA: Generate / Prefill / Decode run under `request.lora` when set. An adapter this
worker does not hold is loaded first when the request carries its path (load-on-miss:
the router sends the path of every adapter it knows, so any worker it picks can serve
it); without a path the adapter must be loaded already or be one of the engine's
`lora.modules`, else the call fails with NOT_FOUND naming the adapter.

Roles (prefill / decode / unified) are advertised in Stats and only steer the
router; every worker answers every RPC. The engine is touched only by its step loop
or through `AsyncLLMEngine.run_between_steps` (held-KV release, block reads, cache
snapshots), never concurrently with a step.

Built by `kvmesh.build.build_worker`; run one with `kvmesh worker --role decode --port 50061
--model DIR`.

Over ~500 lines on purpose: each RPC is a short handler, and the P/D pair (Prefill,
PullKV with its GPU handle path, ReleaseKV, Decode's pull and fallbacks) shares the
transfer table and health checks, and the LoRA RPCs share load-on-miss with them; counters and the Stats reply live in worker/stats.py,
the transports in worker/kv_transfer.py and worker/gpu_kv_transfer.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from kvmesh._proto import llm_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.compress.proto import compress_request
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.kv_events import KVEventLog
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError, NotFoundError
from kvmesh.rpc import (
    CHANNEL_OPTIONS,
    StatusError,
    abort_with,
    add_health_and_reflection,
    output_to_proto,
    params_from_proto,
    prompt_cache_id,
    prompt_from_request,
    set_serving,
)
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.telemetry import tracing
from kvmesh.telemetry.metrics import start_metrics_server
from kvmesh.telemetry.workers import CLUSTER, CacheSourceTracker, loop_source
from kvmesh.worker.gpu_kv_transfer import GpuKVSink, GpuKVSource, pull_kv_or_bytes
from kvmesh.worker.kv_transfer import (
    KVTransferError,
    PulledKV,
    PulledKVLoader,
    TransferTable,
    blocks_per_chunk,
    make_chunk,
    make_layout,
    pull_kv,
)
from kvmesh.worker.stats import WorkerCounters, lora_info_proto, stats_response

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

Role = Literal["prefill", "decode", "unified"]


class WorkerServerConfig(BaseModel):
    """Settings of one worker process (the engine has its own EngineConfig)."""

    model_config = ConfigDict(extra="forbid")

    role: Role = Field("unified", description="What the router sends here: prefill, decode or both.")
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    model_id: str = Field("kvmesh", description="Model name reported in Stats / ListModels.")
    transfer_ttl_s: float = Field(30.0, gt=0, description="How long prefilled KV waits for a PullKV.")
    pull_timeout_s: float = Field(30.0, gt=0, description="Max time a decode waits for a PullKV.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Serve this worker's Prometheus /metrics on "
                              "this port; 0 = off (the router's /metrics covers every worker anyway).")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """`loader` must be (part of) the engine's KV loader chain: Decode stages pulled KV
    there; `cache_sources` (the chain's outer end) says where reused KV came from.
    `gpu_source` / `gpu_sink` move KV device to device (worker/gpu_kv_transfer.py); None
    (CPU workers) = bytes over gRPC only."""

    def __init__(self, aengine: AsyncLLMEngine, config: WorkerServerConfig, address: str,
                 loader: PulledKVLoader, cache_sources: CacheSourceTracker, auth: InternalAuth | None = None,
                 gpu_source: GpuKVSource | None = None, gpu_sink: GpuKVSink | None = None):
        self.aengine = aengine
        self.gpu_source, self.gpu_sink = gpu_source, gpu_sink
        self.auth = auth or InternalAuth()  # credentials of this worker's PullKV channels
        self.engine = aengine.engine
        self.runner = self.engine.executor.runner
        self.config = config
        self.address = address
        self.transfers = TransferTable(config.transfer_ttl_s)
        self.loader = loader
        self.cache_sources = cache_sources
        self.counters = WorkerCounters()
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Stored / evicted block hashes, sent to routers that ask in Stats (their exact index).
        self.kv_events = KVEventLog(self.engine.kv_manager.pool)
        # One load per adapter at a time: concurrent requests for an adapter not held yet wait
        # for the first one's load instead of reading it from disk again.
        self._lora_locks: dict[str, asyncio.Lock] = {}

    # -- helpers ------------------------------------------------------------

    async def _stream(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                      engine_id: str, span=None, lora: str | None = None
                      ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """Run a request and stream its deltas, every choice's (n > 1) with its index; leaving
        early aborts it (frees blocks)."""
        num_logprobs: dict[int, int] = {}  # per choice: logprobs sent so far
        async for out in self.aengine.generate(prompt, params, request_id=engine_id, lora=lora):
            lps = out.outputs[0].logprobs
            sent = num_logprobs.get(out.index, 0)
            new = len(lps) - sent if lps is not None else 0
            num_logprobs[out.index] = sent + new
            if out.finished:
                self._finished(out, span)
            yield output_to_proto(out, request_id, new)

    def _finished(self, out: RequestOutput, span) -> None:
        self.counters.count_finished(out, self.cache_sources.split(out.request_id, out.num_cached_tokens))
        tracing.set_request_output(span, out)

    @staticmethod
    def _check_disaggregable(params: SamplingParams, rpc: str) -> None:
        """P/D moves one prompt's KV for one continuation, computed from the prefix cache:
        n > 1 and prompt logprobs run unified (Generate) only."""
        if params.n > 1:
            raise InvalidRequestError("n", f"{rpc} serves n = 1 only; send n > 1 requests to Generate")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs", f"{rpc} does not compute prompt logprobs; send such "
                                                         "requests to Generate")

    def _held_lora_path(self, name: str) -> str | None:
        """The path of the adapter held under `name` in host memory, or None."""
        return next((i.path for i in self.aengine.list_loras() if i.name == name and i.loaded), None)

    async def _lora(self, ref: llm_pb2.LoRARef | None) -> str | None:
        """The adapter a request runs under (None: the base model), loaded first when this
        worker does not hold it and `ref` says where it lives (load-on-miss)."""
        if ref is None or not ref.name:
            return None
        if not self.engine.lora_enabled:
            raise InvalidRequestError("lora", f"adapter {ref.name!r} was asked for, but worker {self.address} "
                                              "serves no LoRA adapters; start it with --enable-lora")
        held = self._held_lora_path(ref.name)
        if held is not None and (not ref.path or held == ref.path):
            return ref.name
        if ref.path:  # not here, or other weights under the name (replaced if none of its requests runs)
            async with self._lora_locks.setdefault(ref.name, asyncio.Lock()):
                if self._held_lora_path(ref.name) != ref.path:
                    logger.info("loading LoRA adapter %s from %s on first use", ref.name, ref.path)
                    await self.aengine.load_lora(ref.name, ref.path)
            return ref.name
        modules = self.engine.config.lora.modules if self.engine.config.lora is not None else []
        if any(m.name == ref.name for m in modules):
            return ref.name  # a start-up adapter: the engine reads it on first use
        raise NotFoundError("lora", f"LoRA adapter {ref.name!r} is not loaded on worker {self.address} and the "
                                    "request gives no path; load it first (LoadLoRA) or set lora.path")

    def _check_healthy(self) -> None:
        """Refuse new work while the engine is unhealthy (UNAVAILABLE: the router skips
        this worker and retries elsewhere) instead of queueing it behind a wedged step."""
        ok, why = self.aengine.health()
        if not ok:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} is unhealthy: {why}")

    def _span_attrs(self, request_id: str) -> dict[str, str]:
        return {"kvmesh.request_id": request_id, "kvmesh.worker": self.address, "kvmesh.role": self.config.role}

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.auth.channel(address)
        return ch

    async def _release(self, transfer_id: str) -> None:
        if self.transfers.pop(transfer_id) is not None:
            await self.aengine.run_between_steps(lambda: self._free(transfer_id))

    def _free(self, transfer_id: str) -> bool:
        if self.gpu_source is not None:
            self.gpu_source.release(transfer_id)  # its staging slot, if it was offered device to device
        return self.engine.release_kv(transfer_id)

    async def expire_transfers_forever(self) -> None:
        """Release transfers nobody pulled within the TTL (a decode that never came)."""
        period = min(self.config.transfer_ttl_s / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            for tid in self.transfers.expired():
                logger.info("transfer %s expired unpulled after %.1fs; releasing its blocks",
                            tid, self.config.transfer_ttl_s)
                self.counters.transfers_expired += 1
                await self._release(tid)

    # -- RPCs ---------------------------------------------------------------

    async def Generate(self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        with tracing.server_span("kvmesh.worker.generate", context, self._span_attrs(rid)) as span:
            try:
                self._check_healthy()
                params = dataclasses.replace(params_from_proto(request.params), cache_salt=request.cache_salt)
                lora = await self._lora(request.lora if request.HasField("lora") else None)
                request, compression = await compress_request(request, self.engine.tokenizer)
                prompt = prompt_from_request(request)
                async for msg in self._stream(prompt, params, rid, f"{rid}-{uuid.uuid4().hex[:8]}", span, lora):
                    if compression is not None and msg.HasField("usage"):
                        msg.usage.original_prompt_tokens = compression.original_prompt_tokens
                    yield msg
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        engine_id = f"{rid}-{uuid.uuid4().hex[:8]}"
        with tracing.server_span("kvmesh.worker.prefill", context, self._span_attrs(rid)) as span:
            try:
                self._check_healthy()
                params = dataclasses.replace(params_from_proto(request.params), cache_salt=request.cache_salt)
                self._check_disaggregable(params, "Prefill")
                lora = await self._lora(request.lora if request.HasField("lora") else None)
                prompt = list(request.prompt_token_ids)
                # Hold the KV only if a decode will follow: more tokens wanted and room left.
                hold = params.max_tokens > 1 and len(prompt) + 1 < self.engine.max_model_len
                first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
                final, num_lp = None, 0
                async for out in self.aengine.generate(prompt, first_params, request_id=engine_id, hold_kv=hold,
                                                       lora=lora):
                    if out.finished:
                        final = out
                        if out.held_block_ids is not None:  # register before any await: never leak
                            self.transfers.add(engine_id, out.held_block_ids, len(prompt))
                        lps = out.outputs[0].logprobs
                        num_lp = len(lps) if lps is not None else 0
                self._finished(final, span)
                first = output_to_proto(final, rid, num_lp)
                resp = worker_pb2.PrefillResponse(first=first, source_address=self.address,
                                                  model_fingerprint=self.engine.fingerprint)
                held = self.transfers.get(engine_id)
                if held is not None and final.outputs[0].finish_reason == "length":
                    # Stopped only by our max_tokens=1: the request goes on at a decode worker.
                    resp.first.finish_reason = ""
                    resp.transfer_id = engine_id
                    resp.num_blocks = len(held.block_ids)
                    resp.num_prompt_tokens = held.num_tokens
                elif held is not None:  # finished for real (EOS, stop token / string)
                    await self._release(engine_id)
                return resp
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc)

    async def PullKV(self, request: worker_pb2.PullKVRequest, context: grpc.aio.ServicerContext):
        held = self.transfers.get(request.transfer_id)
        if held is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"transfer {request.transfer_id!r} is unknown, already pulled or expired "
                                f"(TTL {self.config.transfer_ttl_s}s); recompute the prompt")
        if request.model_fingerprint != self.engine.fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "model fingerprint mismatch: this worker holds KV of a different model, "
                                "dtype or block size than the puller; route P/D pairs within one model")
        runner = self.runner
        layout = make_layout(runner, len(held.block_ids), held.num_tokens, self.engine.fingerprint)
        step = blocks_per_chunk(runner, request.max_chunk_bytes)
        held.pulls_in_flight += 1
        try:
            gpu = self.gpu_source
            chunk = None if gpu is None else await self.aengine.run_between_steps(
                lambda: gpu.offer(request, held.block_ids, held.num_tokens, self.engine.fingerprint))
            if chunk is not None:  # device to device: a handle instead of bytes
                self.counters.kv_sent_blocks += chunk.num_blocks
                self.counters.kv_sent_bytes += chunk.gpu.num_bytes
                yield chunk
                await self._push_device(request.transfer_id)
                return  # the blocks stay held until the puller's ReleaseKV (or its bytes pull, or the TTL)
            for i in range(0, len(held.block_ids), step):
                ids = held.block_ids[i : i + step]
                kv = await self.aengine.run_between_steps(lambda ids=ids: runner.read_blocks(ids))
                chunk = make_chunk(kv, i, layout if i == 0 else None)
                self.counters.kv_sent_blocks += len(ids)
                self.counters.kv_sent_bytes += len(chunk.data)
                yield chunk
        finally:
            held.pulls_in_flight -= 1
        await self._release(request.transfer_id)  # pull complete

    async def _push_device(self, transfer_id: str) -> None:
        """Send a staged region when the transport pushes (NCCL); bounded by the pull
        timeout. A failure is the puller's to notice: it then pulls bytes."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.gpu_source.push, transfer_id), self.config.pull_timeout_s)
        except Exception as exc:
            logger.warning("device-to-device push of %s failed (%s); the puller falls back to bytes",
                           transfer_id, exc)

    async def ReleaseKV(self, request: worker_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext):
        held = self.transfers.get(request.transfer_id)
        if held is not None and held.pulls_in_flight == 0:
            await self._release(request.transfer_id)
            return worker_pb2.ReleaseKVResponse(released=True)
        return worker_pb2.ReleaseKVResponse(released=False)

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        engine_id = f"{rid}-{uuid.uuid4().hex[:8]}"
        with tracing.server_span("kvmesh.worker.decode", context, self._span_attrs(rid)) as span:
            try:
                self._check_healthy()
                params = dataclasses.replace(params_from_proto(request.params), cache_salt=request.cache_salt)
                self._check_disaggregable(params, "Decode")
                if params.max_tokens < 2:
                    raise InvalidRequestError("max_tokens", "Decode needs max_tokens >= 2 (prefill produced the "
                                                            "first token); finish max_tokens=1 requests at prefill")
                prompt = list(request.prompt_token_ids) + [request.first_token_id]
                self.engine.validate_prompt_ids(prompt)
                lora = await self._lora(request.lora if request.HasField("lora") else None)
                if request.transfer_id and request.source_address:
                    await self._pull(request, engine_id, context, span)
                rest = dataclasses.replace(params, max_tokens=params.max_tokens - 1,
                                           min_tokens=max(params.min_tokens - 1, 0))
                if params.structured_outputs is not None:  # the grammar goes on from prefill's first token
                    rest.structured_outputs = dataclasses.replace(
                        params.structured_outputs, prefilled_output_ids=(request.first_token_id,))
                async for msg in self._stream(prompt, rest, rid, engine_id, span, lora):
                    yield msg
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc)
            finally:
                self.loader.discard(engine_id)

    async def _pull(self, request: worker_pb2.DecodeRequest, engine_id: str,
                    context: grpc.aio.ServicerContext, span=None) -> None:
        """Pull the prompt's KV and stage it for admission; on failure the prompt is
        recomputed here (slower, same output), so a pull error never fails the request."""
        if request.model_fingerprint and request.model_fingerprint != self.engine.fingerprint:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              "model fingerprint mismatch between prefill and decode workers")
        remaining = context.time_remaining()
        timeout = min(self.config.pull_timeout_s, remaining) if remaining is not None else self.config.pull_timeout_s
        attrs = {"kvmesh.transfer_id": request.transfer_id, "kvmesh.source": request.source_address}
        with tracing.client_span("kvmesh.kv_transfer.pull", span, attrs) as pull_span:
            try:
                pulled = await self._fetch_kv(request, timeout)
            except (grpc.aio.AioRpcError, KVTransferError) as exc:
                self.counters.kv_pull_failures += 1
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                logger.warning("PullKV of %s from %s failed (%s); recomputing the prompt",
                               request.transfer_id, request.source_address, detail)
                tracing.record_error(pull_span, exc)
                return
            tracing.set_attributes(pull_span, {"kvmesh.kv_bytes": pulled.num_bytes,
                                               "kvmesh.kv_blocks": pulled.num_blocks})
        self.counters.kv_received_blocks += pulled.num_blocks
        self.counters.kv_received_bytes += pulled.num_bytes
        self.loader.stage(engine_id, pulled)

    async def _fetch_kv(self, request: worker_pb2.DecodeRequest, timeout: float) -> PulledKV:
        channel, fp = self._channel(request.source_address), self.engine.fingerprint
        if self.gpu_sink is not None:  # device to device if the source takes it, else bytes
            return await pull_kv_or_bytes(channel, self.runner, self.gpu_sink, request.transfer_id, fp, timeout)
        return await pull_kv(channel, self.runner, request.transfer_id, fp, timeout)

    async def CachePrompt(self, request: llm_pb2.CachePromptRequest, context: grpc.aio.ServicerContext):
        try:
            ids = list(request.prompt_token_ids) or (self.engine.encode(request.prompt) if request.prompt else [])
            if not ids:
                raise InvalidRequestError("prompt", "give the prompt text or prompt_token_ids to cache")
            self.engine.validate_prompt_ids(ids)
            name = request.name or prompt_cache_id(ids)
            ttl = float(request.ttl_seconds) if request.ttl_seconds > 0 else None
            # Runs as a normal request (the event loop stays free); over the pin quota it
            # fails at once with RESOURCE_EXHAUSTED.
            n = await self.aengine.cache_prompt(name, ids, ttl)
            return llm_pb2.CachePromptResponse(cache_id=name, num_tokens=n)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    async def UncachePrompt(self, request: llm_pb2.UncachePromptRequest, context: grpc.aio.ServicerContext):
        if not request.cache_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cache_id: required (from CachePrompt)")
        released = await self.aengine.run_between_steps(lambda: self.engine.uncache_prompt(request.cache_id))
        if not released:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"cache_id {request.cache_id!r} is not cached here")
        return llm_pb2.UncachePromptResponse()

    async def LoadLoRA(self, request: worker_pb2.LoadLoRARequest, context: grpc.aio.ServicerContext):
        """Read an adapter into host memory (off the step loop); idempotent for the same
        name and path."""
        try:
            ref = request.lora
            if not ref.name:
                raise InvalidRequestError("lora.name", "required: the name requests select the adapter by")
            if not ref.path:
                raise InvalidRequestError("lora.path", "required: the PEFT adapter folder to load")
            if not self.engine.lora_enabled:
                raise InvalidRequestError("lora", f"worker {self.address} serves no LoRA adapters; start it "
                                                  "with --enable-lora")
            async with self._lora_locks.setdefault(ref.name, asyncio.Lock()):
                info = await self.aengine.load_lora(ref.name, ref.path)
            logger.info("LoRA adapter %s loaded from %s (rank %d)", info.name, info.path, info.rank)
            return lora_info_proto(info)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    async def UnloadLoRA(self, request: worker_pb2.UnloadLoRARequest, context: grpc.aio.ServicerContext):
        """Drop an adapter; INVALID_ARGUMENT while requests run under it, `unloaded` False
        when it was not loaded."""
        try:
            if not request.name:
                raise InvalidRequestError("name", "required: the adapter to unload")
            if not self.engine.lora_enabled:
                return worker_pb2.UnloadLoRAResponse(unloaded=False)
            unloaded = await self.aengine.unload_lora(request.name)
            if unloaded:
                self._lora_locks.pop(request.name, None)
                logger.info("LoRA adapter %s unloaded", request.name)
            return worker_pb2.UnloadLoRAResponse(unloaded=unloaded)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        ok, why = self.aengine.health()
        if not ok:  # the router's poll then marks this worker unhealthy
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} is unhealthy: {why}")
        return await self.aengine.run_between_steps(lambda: self._stats_with_events(request))

    def _stats_with_events(self, request: worker_pb2.StatsRequest) -> worker_pb2.StatsResponse:
        resp = self.stats_now(request.max_block_hashes)
        if request.kv_events:
            ev = self.kv_events.since(request.kv_events_epoch, request.kv_events_after)
            resp.kv_stored.extend(ev.stored)
            resp.kv_removed.extend(ev.removed)
            resp.kv_events_epoch, resp.kv_events_seq, resp.kv_events_reset = ev.epoch, ev.seq, ev.reset
        return resp

    def stats_now(self, max_block_hashes: int = 0) -> worker_pb2.StatsResponse:
        """This worker's Stats; reads the engine, so only between steps (run_between_steps)."""
        return stats_response(self.engine, self.config.role, self.address, self.config.model_id, self.counters,
                              len(self.transfers), self.loader.loaded_tokens, max_block_hashes)


class WorkerServer:
    """A started worker: gRPC server, servicer and the TTL sweeper."""

    def __init__(self, aengine: AsyncLLMEngine, config: WorkerServerConfig, loader: PulledKVLoader,
                 cache_sources: CacheSourceTracker, auth: InternalAuth | None = None,
                 gpu_source: GpuKVSource | None = None, gpu_sink: GpuKVSink | None = None):
        self.aengine = aengine
        self.config = config
        # Every worker RPC but health checks needs the internal token when one is set
        # (KVMESH_INTERNAL_TOKEN / _FILE): worker ports refuse outsiders.
        self.auth = auth if auth is not None else InternalAuth.load()
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=self.auth.server_interceptors() or None)
        self.port = self.auth.add_port(self.server, f"{config.host}:{config.port}")
        if self.port == 0:
            raise OSError(f"could not listen on {config.host}:{config.port}; pick another --port")
        self.address = f"{config.host}:{self.port}"
        self.servicer = WorkerServicer(aengine, config, self.address, loader, cache_sources, self.auth,
                                       gpu_source, gpu_sink)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self._sweeper: asyncio.Task | None = None
        self._health_watch: asyncio.Task | None = None
        self.metrics_server = None  # prometheus HTTP server when config.metrics_port is set

    async def start(self) -> None:
        await self.server.start()
        self._sweeper = asyncio.create_task(self.servicer.expire_transfers_forever())
        self.metrics_server = start_metrics_server(self.config.metrics_port, self.config.host)
        if self.metrics_server is not None:
            stats = lambda: self.aengine.run_between_steps(self.servicer.stats_now)  # noqa: E731
            CLUSTER.add(self, loop_source(stats, asyncio.get_running_loop()))
        await set_serving(self.health, [SERVICE_NAME], True)
        self._health_watch = asyncio.create_task(self._watch_health())

    async def _watch_health(self, period_s: float = 1.0) -> None:
        """gRPC health follows the engine's (step watchdog, dead loop): NOT_SERVING makes
        supervisors (serve --local, Kubernetes probes) replace this worker."""
        serving = True
        while True:
            await asyncio.sleep(period_s)
            ok, why = self.aengine.health()
            if ok != serving:
                if not ok:
                    logger.error("worker unhealthy, reporting NOT_SERVING: %s", why)
                await set_serving(self.health, [SERVICE_NAME], ok)
                serving = ok

    async def stop(self, grace: float = 2.0) -> None:
        if self._health_watch is not None:
            self._health_watch.cancel()
        await set_serving(self.health, [SERVICE_NAME], False)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.metrics_server is not None:
            CLUSTER.remove(self)
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        await self.server.stop(grace)
        for ch in self.servicer._channels.values():
            await ch.close()
        await self.aengine.shutdown()
