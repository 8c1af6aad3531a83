"""TLS for kvmesh's gRPC servers and channels (PEM files on disk).

Public front ends (the router's `kvmesh.v1.LLM`, the OpenAI HTTP API) take a certificate
and key (`TLSFiles`); internal channels (router -> worker, worker -> worker PullKV) can
additionally use mutual TLS: every process presents a certificate signed by a cluster CA
and accepts only peers that do (`InternalAuth` in rpc/internal_auth.py).
"""

from __future__ import annotations

from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator


class TLSFiles(BaseModel):
    """A certificate chain and its private key (PEM), plus an optional CA for client certificates."""

    model_config = ConfigDict(extra="forbid")

    cert_file: str = Field(description="PEM certificate chain the server presents.")
    key_file: str = Field(description="PEM private key of cert_file.")
    client_ca_file: str | None = Field(
        None, description="PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).")

    @model_validator(mode="after")
    def _readable(self) -> "TLSFiles":
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls.{name}: {path!r} is not a readable file; give the PEM file's path")
        return self

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, client CA or None) as bytes."""
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(), ca


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def add_port(server: grpc.aio.Server, address: str, tls: TLSFiles | None) -> int:
    """Listen on `address`, with TLS when `tls` is given; returns the bound port (0 = failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def channel_credentials(ca_file: str | None, cert_file: str | None = None,
                        key_file: str | None = None) -> grpc.ChannelCredentials:
    """Client credentials: verify the server with `ca_file` (None: the system roots) and,
    for mutual TLS, present `cert_file` / `key_file`."""
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))
