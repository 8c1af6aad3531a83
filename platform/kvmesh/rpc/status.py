"""Exceptions -> gRPC status codes, for every kvmesh servicer."""

from __future__ import annotations

import logging

import grpc

from kvmesh.errors import EngineDeadError, InvalidRequestError, KVMeshError, ResourceExhaustedError, StepFailedError

logger = logging.getLogger(__name__)


class StatusError(KVMeshError):
    """An error that already knows its gRPC status code (raised inside handlers)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception from the engine (or a downstream call) to a gRPC status."""
    if isinstance(exc, StatusError):
        return exc.code, exc.message
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
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


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status `exc` maps to (raises grpc's AbortError)."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error in handler", exc_info=exc)
    await context.abort(code, message)
