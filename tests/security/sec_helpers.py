"""Helpers of the security tests: certificates made in the test (a CA and a leaf valid
for 127.0.0.1 / localhost, via `cryptography`), a real redis-server with a password,
and an event loop on a background thread for in-process gRPC servers."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Certs:
    ca: Path     # CA certificate (PEM); trust this to verify `cert`
    cert: Path   # leaf certificate for 127.0.0.1 / localhost, signed by the CA
    key: Path    # the leaf's private key
    other_ca: Path  # an unrelated CA (its leaf must be refused under mutual TLS)
    other_cert: Path
    other_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def make_pair(tmp: Path, prefix: str) -> tuple[Path, Path, Path]:
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"{prefix} CA")).issuer_name(_name(f"{prefix} CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.DNSName("kvmesh-worker"),
                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    leaf = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return (_write(tmp / f"{prefix}-ca.pem", ca.public_bytes(pem)),
            _write(tmp / f"{prefix}-cert.pem", leaf.public_bytes(pem)),
            _write(tmp / f"{prefix}-key.pem", key_pem))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
