"""What the router and the workers share over gRPC: message conversion (convert),
exception -> status mapping (status), server boilerplate and channel options (server),
API-key authentication (auth). Imports no torch, no engine internals beyond the
torch-free request types, and nothing from router/, worker/ or serve/."""

from kvmesh.rpc.convert import (
    check_token_ids,
    logprobs_to_proto,
    output_to_proto,
    params_from_proto,
    params_to_proto,
    prompt_cache_id,
    prompt_from_request,
)
from kvmesh.rpc.server import (
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    add_health_and_reflection,
    free_port,
    run_until_signalled,
    set_serving,
)
from kvmesh.rpc.status import StatusError, abort_with, status_of

__all__ = [
    "CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES", "StatusError", "abort_with", "add_health_and_reflection",
    "check_token_ids", "free_port",
    "logprobs_to_proto", "output_to_proto", "params_from_proto", "params_to_proto", "prompt_cache_id",
    "prompt_from_request", "run_until_signalled", "set_serving", "status_of",
]
