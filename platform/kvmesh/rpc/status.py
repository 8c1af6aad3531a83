"""kvmesh errors <-> gRPC status, for every kvmesh servicer and client.

A servicer ends a call with `abort_with(context, exc)`: the status code and message
`status_of` maps the exception to, plus the standard rich-error detail in the trailers
(`grpc-status-details-bin`, a `google.rpc.Status`, as grpcio-status writes it): a
`google.rpc.BadRequest` field violation for an invalid field, a `google.rpc.RetryInfo`
(and `retry-after`) for a rate limit. The offending field therefore travels as data,
and `error_of_rpc` turns a failed call back into the typed kvmesh error on the other
side (the router reading a worker, the HTTP layer reading the router over loopback), so
no caller parses a message to learn which field was wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from google.rpc import error_details_pb2, status_pb2

from kvmesh.errors import (
    EngineDeadError,
    InvalidRequestError,
    KVMeshError,
    NotFoundError,
    RateLimitedError,
    ResourceExhaustedError,
    StepFailedError,
    UnavailableError,
)
from kvmesh.rpc.retry_info import DETAILS_KEY, RETRY_AFTER_KEY, retry_after_metadata, retry_after_of

logger = logging.getLogger(__name__)

Trailers = tuple[tuple[str, str | bytes], ...]


class StatusError(KVMeshError):
    """An error that already knows its gRPC status code (raised inside handlers), for the
    statuses no typed kvmesh error names (INTERNAL, DEADLINE_EXCEEDED, a worker's code
    passed on). `field` is set when the status is about one request field."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception from the engine (or a downstream call) to a gRPC status."""
    if isinstance(exc, StatusError):
        return exc.code, exc.message
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, ResourceExhaustedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, StepFailedError):
        # This request only; the engine serves on. The router counts it as a worker failure.
        return grpc.StatusCode.INTERNAL, f"internal error while running the request: {exc.cause!r}"
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, f"engine is down: {exc}"
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory"
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


def status_trailers(exc: BaseException, code: grpc.StatusCode, message: str) -> Trailers:
    """The rich-error trailers of `exc`: BadRequest for a field, RetryInfo for a rate limit."""
    if isinstance(exc, RateLimitedError):
        return retry_after_metadata(exc.retry_after_s, message)
    field = getattr(exc, "field", None)
    if code != grpc.StatusCode.INVALID_ARGUMENT or not field:
        return ()
    reason = getattr(exc, "reason", message)
    bad = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=reason)])
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(bad)
    return ((DETAILS_KEY, status.SerializeToString()),)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, trailers: Sequence = ()) -> None:
    """End the RPC with the status `exc` maps to and its rich-error detail (raises grpc's
    AbortError); `trailers` are sent too (e.g. the router's route decision)."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error in handler", exc_info=exc)
    await context.abort(code, message, trailing_metadata=(*trailers, *status_trailers(exc, code, message)))


def _details_of(exc: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    for key, value in exc.trailing_metadata() or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except Exception:  # a foreign peer's garbage is no detail
                return None
            return status
    return None


def field_violation_of(exc: grpc.aio.AioRpcError) -> tuple[str, str] | None:
    """(field, description) of the first BadRequest field violation the call's status carries."""
    status = _details_of(exc)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            for v in bad.field_violations:
                return v.field, v.description
    return None


def error_of_rpc(exc: grpc.aio.AioRpcError, prefix: str = "") -> KVMeshError:
    """The typed kvmesh error a failed call stands for (`prefix`, e.g. "worker: ",
    goes before messages that are passed on)."""
    code, details = exc.code(), exc.details() or exc.code().name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violation = field_violation_of(exc)
        if violation is not None:
            return InvalidRequestError(*violation)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_after = retry_after_of(exc)
        if retry_after is not None:
            return RateLimitedError(details, retry_after)
    if code == grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(prefix + details)
    return StatusError(code, prefix + details)


__all__ = ["RETRY_AFTER_KEY", "StatusError", "abort_with", "error_of_rpc", "field_violation_of", "status_of",
           "status_trailers"]
