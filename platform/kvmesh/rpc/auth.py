"""Optional API key on the public endpoints (router gRPC and the OpenAI HTTP API).

Set `KVMESH_API_KEY` (the operator sets it from `spec.auth.apiKeySecretRef`): clients
then send `authorization: Bearer <key>` (gRPC metadata or HTTP header; the `openai`
client does this with `api_key=`). Health checks, reflection and /metrics stay open.
Worker endpoints are internal and carry no key.
"""

from __future__ import annotations

import hmac
import os

import grpc

ENV_VAR = "KVMESH_API_KEY"
_OPEN_GRPC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def api_key() -> str | None:
    return os.environ.get(ENV_VAR) or None


def authorized(header: str | None, key: str) -> bool:
    """Constant-time check of an `authorization` value against the key."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), key.encode())


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the key with UNAUTHENTICATED (a message that says what to send)."""

    def __init__(self, key: str):
        self._key = key

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"missing or wrong API key: send metadata 'authorization: Bearer <key>' "
                                f"(the server's {ENV_VAR})")

        async def deny_stream(request, context):
            await deny_unary(request, context)
            yield  # pragma: no cover - abort raises

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_OPEN_GRPC_PREFIXES):
            return await continuation(handler_call_details)
        meta = dict(handler_call_details.invocation_metadata or ())
        if authorized(meta.get("authorization"), self._key):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
