"""API keys on the public endpoints (router gRPC and the OpenAI HTTP API).

Set `KVMESH_API_KEY` (one key; the operator sets it from `spec.auth.apiKeySecretRef`)
and/or `KVMESH_API_KEYS_FILE` (a file with one key per line, `#` comments; each key is a
tenant): clients then send `authorization: Bearer <key>` (gRPC metadata or HTTP header;
the `openai` client does this with `api_key=`). Health checks, reflection and /metrics
stay open. Keys are compared through their SHA-256 digests and `hmac.compare_digest`, so
the check takes the same time whatever the key.

Each key names a tenant: `ApiKeys.tenant_of` gives a stable opaque id (a digest prefix of
the key), which the router mixes into the request's cache salt (prefix-cache hits never
cross tenants) and uses as the rate-limit bucket. Worker endpoints use the internal token
instead (rpc/internal_auth.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import grpc

from kvmesh.rpc.server import OPEN_METHOD_PREFIXES, Refusal

ENV_VAR = "KVMESH_API_KEY"
FILE_ENV_VAR = "KVMESH_API_KEYS_FILE"
_BEARER = "Bearer "


def api_key() -> str | None:
    """The single `KVMESH_API_KEY` (what the HTTP layer sends to its own router)."""
    return os.environ.get(ENV_VAR) or None


def authorized(header: str | None, key: str) -> bool:
    """Constant-time check of an `authorization` value against one key."""
    if not header or not header.startswith(_BEARER):
        return False
    return hmac.compare_digest(header[len(_BEARER):].strip().encode(), key.encode())


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The accepted keys, by digest; empty means the API is open."""

    def __init__(self, keys: list[str] | tuple[str, ...] = ()):
        self._digests = {_digest(k): _digest(k).hex()[:16] for k in keys if k}
        # The key this process's own loopback calls use (HTTP layer -> router: ListModels, health).
        self.service_key: str | None = next((k for k in keys if k), None)

    @classmethod
    def from_env(cls) -> "ApiKeys":
        keys = [k for k in [api_key()] if k]
        path = os.environ.get(FILE_ENV_VAR)
        if path:
            try:
                lines = Path(path).read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"{FILE_ENV_VAR}={path!r} cannot be read ({exc}); fix the path") from None
            keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def tenant_of(self, header: str | None) -> str | None:
        """The tenant id of a valid `authorization: Bearer <key>` value, else None."""
        if not header or not header.startswith(_BEARER):
            return None
        sent = _digest(header[len(_BEARER):].strip())
        found = None
        for digest, tenant in self._digests.items():  # every entry compared: no early exit
            if hmac.compare_digest(sent, digest):
                found = tenant
        return found


def tenant_salt(tenant: str | None, cache_salt: str) -> str:
    """The effective cache salt of a request: its own salt inside its tenant's space."""
    if tenant is None:
        return cache_salt
    return f"tenant:{tenant}\0{cache_salt}"


def metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid key with UNAUTHENTICATED (a message that says what to send)."""

    def __init__(self, keys: str | ApiKeys):
        self._keys = ApiKeys([keys]) if isinstance(keys, str) else keys
        self._refusal = Refusal(f"missing or wrong API key: send metadata 'authorization: Bearer <key>' "
                                f"(one of the server's {ENV_VAR} / {FILE_ENV_VAR} keys)")

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        header = metadata_value(handler_call_details.invocation_metadata, "authorization")
        if self._keys.tenant_of(header) is not None:
            return await continuation(handler_call_details)
        return self._refusal.handler_for(await continuation(handler_call_details))
