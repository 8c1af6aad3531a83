"""Glue between the gRPC messages (kvmesh._proto) and engine types, shared by the
router and the workers: proto <-> SamplingParams, RequestOutput -> GenerateResponse,
exception -> gRPC status, and the server boilerplate every kvmesh server gets
(standard health checking and reflection).

No torch here: the router imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh._proto import llm_pb2
from kvmesh.engine.outputs import RequestOutput, TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError

logger = logging.getLogger(__name__)


def prompt_cache_id(token_ids: list[int]) -> str:
    """Default CachePrompt id: the same prompt gets the same id on every worker."""
    import hashlib
    import struct

    return "pc-" + hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()[:16]

# Message size cap for every channel and server: KV chunks are <= 1 MiB by default,
# but a caller may ask for bigger ones.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# proto field -> SamplingParams field, for the optional scalars (unset = engine default).
_OPTIONAL_SCALARS = (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
)


def params_from_proto(msg: llm_pb2.SamplingParams) -> SamplingParams:
    """Build validated SamplingParams; raises InvalidRequestError naming the field."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)}
    kwargs.update(
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output, ignore_eos=msg.ignore_eos,
    )
    return SamplingParams(**kwargs)


def params_to_proto(p: SamplingParams) -> llm_pb2.SamplingParams:
    msg = llm_pb2.SamplingParams(
        stop=p.stop, stop_token_ids=p.stop_token_ids,
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
    )
    for name in _OPTIONAL_SCALARS:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def logprobs_to_proto(items: Iterable[TokenLogprobs]) -> list[llm_pb2.TokenLogprob]:
    return [
        llm_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[llm_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in items
    ]


def output_to_proto(out: RequestOutput, request_id: str, num_new_logprobs: int = 0) -> llm_pb2.GenerateResponse:
    """One streamed message: the delta of `out`, plus finish reason and usage when done.

    `num_new_logprobs` is how many entries at the end of the cumulative logprobs
    list belong to this delta (the engine keeps them cumulative).
    """
    c = out.outputs[0]
    msg = llm_pb2.GenerateResponse(request_id=request_id, text=c.delta_text, token_ids=c.delta_token_ids)
    if c.logprobs and num_new_logprobs:
        msg.logprobs.extend(logprobs_to_proto(c.logprobs[-num_new_logprobs:]))
    if out.finished:
        msg.finish_reason = c.finish_reason or ""
        msg.stop_reason = "" if c.stop_reason is None else str(c.stop_reason)
        msg.usage.CopyFrom(llm_pb2.Usage(
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(c.token_ids),
            cached_prompt_tokens=out.num_cached_tokens,
        ))
    return msg


def prompt_from_request(req: llm_pb2.GenerateRequest) -> str | list[int]:
    """The request's prompt: text or token ids, exactly one of them."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidRequestError("prompt", "set either prompt or prompt_token_ids, not both")
    if req.prompt_token_ids:
        return list(req.prompt_token_ids)
    if not req.prompt:
        raise InvalidRequestError("prompt", "must not be empty: set prompt or prompt_token_ids")
    return req.prompt


class StatusError(Exception):
    """An error that already knows its gRPC status code (raised inside handlers)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception from the engine (or a downstream call) to a gRPC status."""
    from kvmesh.engine.async_engine import EngineDeadError

    if isinstance(exc, StatusError):
        return exc.code, exc.message
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, f"engine is down: {exc}"
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory"
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status `exc` maps to (raises grpc's AbortError)."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error in handler", exc_info=exc)
    await context.abort(code, message)


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard grpc.health.v1 (overall and per service) plus server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (tests, the local launcher)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def run_until_signalled(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """Start, then wait for SIGINT / SIGTERM and stop cleanly."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await start()
    await done.wait()
    await stop()
