"""The one error hierarchy of kvmesh: every error kvmesh raises on purpose is a KVMeshError.

Every error raised for bad user input names the offending field and says what to
change, so front ends map it 1:1 onto INVALID_ARGUMENT / HTTP 400. Errors that carry a
transport-specific payload (rpc.status.StatusError with its gRPC code, the HTTP
layer's APIError) subclass KVMeshError where they are defined.
"""


class KVMeshError(Exception):
    """Base class for kvmesh errors."""


class InvalidRequestError(KVMeshError, ValueError):
    """A request (prompt or sampling parameters) is invalid.

    `field` names the offending parameter, e.g. "top_p" or "prompt".
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.reason = message  # the message without the field (a BadRequest field violation's description)
        super().__init__(f"{field}: {message}")


class NotFoundError(KVMeshError, LookupError):
    """What the request names does not exist here (gRPC NOT_FOUND, HTTP 404): a model,
    a cached prompt. `field` names the parameter that named it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


class UnavailableError(KVMeshError, RuntimeError):
    """Nothing can serve the request now, but a retry later may succeed (gRPC
    UNAVAILABLE, HTTP 503): no worker registered yet, every worker failed."""


class ModelNotFoundError(KVMeshError, FileNotFoundError):
    """The model path does not exist or is not a usable checkpoint folder."""


class ConfigError(KVMeshError, ValueError):
    """An engine configuration that cannot work (e.g. a KV cache too small)."""


class EngineDeadError(KVMeshError, RuntimeError):
    """The engine's step loop crashed; no further requests can be served (UNAVAILABLE)."""


class KVTransferError(KVMeshError, RuntimeError):
    """A KV transfer between workers failed its protocol (layout, checksum, size);
    the receiving worker recomputes the prompt instead."""


class BlockDecodeError(KVMeshError, ValueError):
    """A KV block read from a shared store is unusable (foreign model or geometry, bad
    checksum, truncated); `kind` names the reason for the rejection counters."""

    def __init__(self, kind: str, message: str):
        self.kind = kind  # "corrupt" | "foreign" | "truncated" | "forged" (no valid HMAC)
        super().__init__(f"{kind}: {message}")


class StepFailedError(KVMeshError, RuntimeError):
    """A step of the engine raised (a kernel, the sampler, a KV connector). The requests
    of that step were failed and their KV blocks freed; the engine keeps serving every
    other request. `request_ids` names the failed requests; `cause` is the exception."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        self.request_ids = list(request_ids)
        self.cause = cause
        super().__init__(f"engine step failed for {len(self.request_ids)} request(s): {cause!r}")


class ResourceExhaustedError(KVMeshError, RuntimeError):
    """A quota or capacity limit refuses the request now (gRPC RESOURCE_EXHAUSTED, HTTP
    429); `field` names the limit. It is refused at once, never queued behind the limit."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


class RateLimitedError(ResourceExhaustedError):
    """The caller's rate limit refuses the request now; `retry_after_s` says when to come
    back (gRPC RESOURCE_EXHAUSTED with a google.rpc.RetryInfo, HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__("rate_limit", message)
        self.args = (message,)

    def __str__(self) -> str:
        return self.reason


class RankFailedError(KVMeshError, RuntimeError):
    """A rank of a tensor-parallel group died, failed or stopped answering (worker/parallel.py):
    the group cannot run another step and reports itself unhealthy until it is restarted
    (gRPC UNAVAILABLE)."""
