"""The OpenAI error shape: `APIError` is `{"error": {"message", "type", "param", "code"}}`
with its HTTP status; `APIError.of` maps the router's typed errors onto it
(InvalidRequestError -> 400 with `param` the field it names, UnavailableError -> 503,
RateLimitedError -> 429 with Retry-After, ...); `code` is always a string."""

from __future__ import annotations

import math
from typing import Any

import grpc

from kvmesh.errors import KVMeshError, RateLimitedError
from kvmesh.rpc.status import error_of_rpc, status_of

HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class APIError(KVMeshError):
    """An OpenAI-style HTTP error: `status` is the HTTP status, `body()` the JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers: dict[str, str] = {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code or _CODE_OF_STATUS.get(self.status, self.type)}}

    @classmethod
    def of(cls, exc: BaseException) -> APIError:
        """The OpenAI error of a typed kvmesh error from the router (the field it names
        becomes `param`), of a failed gRPC call (decoded to its typed error first), or of
        anything else (a 500)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, grpc.aio.AioRpcError):
            exc = error_of_rpc(exc)
        if isinstance(exc, RateLimitedError):  # the router's per-API-key rate limit (router/ratelimit.py)
            err = cls(429, str(exc), "rate_limit_exceeded", code="rate_limit_exceeded")
            err.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            return err
        code, message = status_of(exc)
        status, type_ = HTTP_OF_GRPC.get(code, (500, "internal_error"))
        return cls(status, message, type_, param=getattr(exc, "field", None), code=code.name.lower())


_CODE_OF_STATUS = {400: "invalid_request", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found",
                   405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type",
                   422: "invalid_request", 429: "rate_limit_exceeded", 499: "cancelled", 500: "internal_error",
                   503: "unavailable", 504: "timeout"}

