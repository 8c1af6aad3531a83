"""Helpers of the security tests: certificates made in the test (a CA and a leaf valid
for 127.0.0.1 / localhost, via `cryptography`), a real redis-server with a password,
and an event loop on a background thread for in-process gRPC servers."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
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


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="security-test-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PasswordRedis:
    """redis-server on a free loopback port with `--requirepass`."""

    def __init__(self, password: str):
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does)")
        import redis

        self.password, self.port = password, free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--requirepass", password], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=password)
        for _ in range(250):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def url(self, with_password: bool = True) -> str:
        auth = f":{self.password}@" if with_password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(port=self.port, password=self.password)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
