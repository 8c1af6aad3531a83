"""How long a RESOURCE_EXHAUSTED caller should wait, on the wire.

The server ends the call with trailing metadata `retry-after` (whole seconds, as HTTP's
header) and the standard `google.rpc.RetryInfo` detail in `grpc-status-details-bin`
(what grpcio-status and other languages' clients read). The HTTP layer turns the
former into a `Retry-After` header on its 429.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

RETRY_AFTER_KEY = "retry-after"
DETAILS_KEY = "grpc-status-details-bin"


def retry_after_metadata(seconds: float, message: str = "rate limit exceeded") -> tuple[tuple[str, object], ...]:
    """Trailing metadata for a RESOURCE_EXHAUSTED abort that asks the client to wait `seconds`."""
    whole = max(1, math.ceil(seconds))
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=whole))
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message)
    status.details.add().Pack(info)
    return ((RETRY_AFTER_KEY, str(whole)), (DETAILS_KEY, status.SerializeToString()))


def retry_after_of(exc: grpc.aio.AioRpcError) -> int | None:
    """The `retry-after` seconds a failed call's trailers carry, if any."""
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None
