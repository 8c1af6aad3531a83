"""Authentication of kvmesh's internal gRPC calls: router -> worker and worker -> worker
(PullKV, ReleaseKV).

A shared internal token travels in the `kvmesh-internal-token` metadata of every call a
kvmesh process makes to a worker (a client interceptor on the channel adds it), and a
server interceptor on every worker checks it in constant time: a call without it gets
UNAUTHENTICATED, so a client that reaches a worker port cannot run Generate, Prefill,
PullKV, ReleaseKV, CachePrompt or read Stats. Health checks and reflection stay open
(load balancers and probes need them; they reveal nothing about requests).

Where the token comes from, first hit wins: `KVMESH_INTERNAL_TOKEN`, the file named by
the config (`ServingConfig.security.internal_token_file`), the file named by
`KVMESH_INTERNAL_TOKEN_FILE`. The operator puts it in a Secret; `kvmesh serve --local`
makes one up per run. Optionally the internal channels also use mutual TLS (a cluster CA
signs every process's certificate): `KVMESH_INTERNAL_TLS_{CERT,KEY,CA}_FILE`.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.rpc.server import CHANNEL_OPTIONS, OPEN_METHOD_PREFIXES, Refusal
from kvmesh.rpc.tls import TLSFiles, add_port, channel_credentials

TOKEN_ENV = "KVMESH_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "KVMESH_INTERNAL_TOKEN_FILE"
TLS_ENV = {"cert": "KVMESH_INTERNAL_TLS_CERT_FILE", "key": "KVMESH_INTERNAL_TLS_KEY_FILE",
           "ca": "KVMESH_INTERNAL_TLS_CA_FILE", "server_name": "KVMESH_INTERNAL_TLS_SERVER_NAME"}
METADATA_KEY = "kvmesh-internal-token"


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"internal token file {path!r} cannot be read ({exc}); fix the path or its mode") from None
    if not token:
        raise ValueError(f"internal token file {path!r} is empty; put the shared token in it")
    return token


@dataclass(frozen=True)
class InternalAuth:
    """How this process authenticates internal calls: a token and/or mutual TLS.

    `tls_server_name` overrides the name checked against worker certificates (workers are
    dialled by IP; give their certificate's DNS name here)."""

    token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def load(cls, token_file: str | None = None) -> "InternalAuth":
        """From the environment and the configured token file (see the module docstring)."""
        token = os.environ.get(TOKEN_ENV) or None
        file = token_file or os.environ.get(TOKEN_FILE_ENV)
        if token is None and file:
            token = _read_token(file)
        tls = {k: os.environ.get(v) or None for k, v in TLS_ENV.items()}
        auth = cls(token, tls["cert"], tls["key"], tls["ca"], tls["server_name"])
        if auth.mtls is None and any((auth.tls_cert_file, auth.tls_key_file, auth.tls_ca_file)):
            raise ValueError("internal mutual TLS needs all of " + ", ".join(
                TLS_ENV[k] for k in ("cert", "key", "ca")))
        return auth

    @property
    def mtls(self) -> TLSFiles | None:
        if self.tls_cert_file and self.tls_key_file and self.tls_ca_file:
            return TLSFiles(cert_file=self.tls_cert_file, key_file=self.tls_key_file, client_ca_file=self.tls_ca_file)
        return None

    @property
    def enabled(self) -> bool:
        return self.token is not None or self.mtls is not None

    # -- server side (workers) ------------------------------------------------------------

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [InternalTokenInterceptor(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        return add_port(server, address, self.mtls)

    # -- client side (router, PullKV) --------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        """An aio channel to a worker that carries this process's credentials."""
        # One instance per call kind: grpc.aio files each interceptor under its first matching kind only.
        interceptors = [_UnaryTokenInterceptor(self.token), _StreamTokenInterceptor(self.token)] if self.token else None
        if self.mtls is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
        creds = channel_credentials(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        options = list(CHANNEL_OPTIONS)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every worker RPC without the internal token (UNAUTHENTICATED); health and
    reflection stay open."""

    def __init__(self, token: str):
        self._token = token.encode()
        self._refusal = Refusal("worker RPCs are internal: the call lacks the cluster's internal token "
                                f"(metadata {METADATA_KEY!r}, from {TOKEN_ENV}); call the router instead")

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        sent = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA_KEY:
                sent = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(sent.encode(), self._token):
            return await continuation(handler_call_details)
        return self._refusal.handler_for(await continuation(handler_call_details))


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(METADATA_KEY, token)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryTokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the internal token to every unary call on a channel."""

    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._token), request)


class _StreamTokenInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    """Adds the internal token to every server-streaming call on a channel."""

    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._token), request)
