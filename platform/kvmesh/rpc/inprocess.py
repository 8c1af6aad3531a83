"""Calling a grpc.aio servicer method in-process, with gRPC's semantics and none of its cost.

The router process serves the OpenAI HTTP API next to the public gRPC service. Sending
each HTTP request through a loopback gRPC channel to the router's own servicer cost a
serialisation, a socket write and read and a deserialisation per streamed message at
each end, plus gRPC's poller threads waking for them (the client side alone was ~7% of
the router's py-spy samples in a 16-stream burst, on a 2-core node where every wake-up
preempts the model's compute threads). `InProcessContext` lets the HTTP layer await the servicer's
handler directly on the router's event loop instead; it implements the part of
`grpc.aio.ServicerContext` kvmesh's servicers use, so they run unchanged:

- `invocation_metadata()` carries the caller's metadata (the API key, trace context);
- `abort(code, details, trailing_metadata)` records the status and raises
  `grpc.aio.AbortError`, as grpc does; `unary_stream` / `unary_unary` turn it into the
  `grpc.aio.AioRpcError` a real client would see (code, details, trailers such as
  `retry-after`), so callers handle one exception type whichever way they call;
- `time_remaining()` counts down from the call's timeout, which the handler passes on to
  its own downstream calls (a deadline still ends a stuck request).

Cancellation is Python's: a consumer that stops (a client that went away) closes the
stream, which closes the handler's generator at its `yield`; its `finally` blocks run as
they do when gRPC cancels a call (the router then cancels the worker stream, which frees
the request's KV blocks).
"""

from __future__ import annotations

import time
from collections import namedtuple
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

Metadatum = namedtuple("Metadatum", ["key", "value"])  # grpc's own shape: `.key` / `.value`, or a pair
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class InProcessContext:
    """The `grpc.aio.ServicerContext` of one in-process call (see the module docstring)."""

    def __init__(self, metadata: Sequence[tuple[str, Any]] = (), timeout_s: float | None = None):
        self._metadata = tuple(Metadatum(k, v) for k, v in metadata)
        self._deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None
        self._trailing: tuple[tuple[str, Any], ...] = ()

    def invocation_metadata(self) -> tuple[Metadatum, ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, Any]] = ()) -> None:
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self._trailing = tuple(metadata)

    def rpc_error(self) -> grpc.aio.AioRpcError:
        """What a gRPC client would have received for the recorded status."""
        code = self._code or grpc.StatusCode.UNKNOWN
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*self._trailing),
                                    details=self._details or code.name)


async def unary_stream(handler: Callable[[Req, InProcessContext], AsyncIterator[Resp]], request: Req,
                       context: InProcessContext) -> AsyncIterator[Resp]:
    """The messages of a server-streaming handler; an abort raises `grpc.aio.AioRpcError`.
    Closing this stream (or cancelling its consumer) closes the handler's generator."""
    stream = handler(request, context)
    try:
        async for msg in stream:
            yield msg
    except grpc.aio.AbortError:
        raise context.rpc_error() from None
    finally:
        await stream.aclose()


async def unary_unary(handler: Callable[[Req, InProcessContext], Awaitable[Resp]], request: Req,
                      context: InProcessContext) -> Resp:
    """The reply of a unary handler; an abort raises `grpc.aio.AioRpcError`."""
    try:
        return await handler(request, context)
    except grpc.aio.AbortError:
        raise context.rpc_error() from None
