"""Error types shared by the engine, the CLI and (later) the gRPC / HTTP front ends.

Every error raised for bad user input names the offending field and says what to
change, so front ends can map it 1:1 onto INVALID_ARGUMENT / HTTP 400.
"""


class KVMeshError(Exception):
    """Base class for kvmesh errors."""


class InvalidRequestError(KVMeshError, ValueError):
    """A request (prompt or sampling parameters) is invalid.

    `field` names the offending parameter, e.g. "top_p" or "prompt".
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class ModelNotFoundError(KVMeshError, FileNotFoundError):
    """The model path does not exist or is not a usable checkpoint folder."""


class ConfigError(KVMeshError, ValueError):
    """An engine configuration that cannot work (e.g. a KV cache too small)."""
